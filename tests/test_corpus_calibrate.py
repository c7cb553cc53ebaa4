"""The CPU-testable parts of `--calibrate` (the GPU path runs on the GPU machine)."""

from __future__ import annotations

import math

import pytest
import torch

from cudagym.errors import ConfigError
from cudagym.tasks.corpus.calibrate import (CalibrationRow, measure_task, require_cuda, sample_ids, summarize,
                                            time_eager_ms)
from cudagym.tasks.corpus.composer import Composer
from cudagym.tasks.model import Task


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU error")
def test_require_cuda_errors_clearly_without_gpu():
    with pytest.raises(ConfigError, match="CUDA GPU"):
        require_cuda()


def test_time_eager_ms_counts_calls_and_reports_spread():
    calls = []
    t = time_eager_ms(lambda: calls.append(1), device="cpu", warmup=2, repeats=7)
    assert len(calls) == 9 and t.repeats == 7 and t.median_ms >= 0 and t.iqr_ms >= 0


def test_measure_task_on_cpu_sizes():
    c = Composer().compose(0, 1)
    small = Task(id="t", code=c.code, cpu_sizes=c.cpu_sizes).resized(**c.cpu_sizes)
    t = measure_task(small.code, device="cpu", warmup=1, repeats=3)
    assert t.median_ms > 0


def test_sample_is_reproducible_and_ordered():
    ids = [f"t{i:03d}" for i in range(500)]
    a, b = sample_ids(ids, 200, 0), sample_ids(ids, 200, 0)
    assert a == b and len(a) == 200 and a == sorted(a) and a != sample_ids(ids, 200, 1)
    assert sample_ids(ids[:5], 200, 0) == ids[:5]


def test_summary_share_in_window_and_log_error():
    rows = [CalibrationRow(id="a", est_ms=2.0, measured_ms=1.0), CalibrationRow(id="b", est_ms=5.0, measured_ms=5.0),
            CalibrationRow(id="c", est_ms=10.0, measured_ms=200.0), CalibrationRow(id="d", est_ms=3.0, measured_ms=None,
                                                                                   error="OOM")]
    s = summarize(rows, 1.0, 100.0)
    assert s["measured"] == 3 and s["failed"] == 1
    assert s["share_in_window"] == round(2 / 3, 4)
    assert s["median_abs_log_ratio"] == round(math.log(2.0), 4)
    assert sum(b["tasks"] for b in s["buckets"]) == 3
    assert s["worst"][0]["id"] == "c"
