"""`--calibrate`: measure real eager times of a sample of built tasks on the GPU.

For each sampled task (full sizes, fp32, TF32 off as in verification) the model and inputs are
built on the GPU and `time_eager_ms` times the forward: `warmup` untimed calls, then `repeats`
calls each bracketed by CUDA events after a device synchronize; the statistic is the median
(and the IQR). Reported: the share of tasks whose measured time lies in the workload window,
and the estimate's error as the median of |ln(est_ms / measured_ms)| (0.69 means "typically
off by 2x"), with a table per measured-time bucket and the worst tasks. Measured times are
written to `<out>/calibration.parquet` and as a `measured_ms` column of `tasks.parquet`.
"""

from __future__ import annotations

import json
import math
import os
import random
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from pydantic import BaseModel

from cudagym.errors import ConfigError


class EagerTiming(BaseModel):
    """Median and interquartile range (ms) of `repeats` timed forward calls."""

    median_ms: float
    iqr_ms: float
    repeats: int


class CalibrationRow(BaseModel):
    id: str
    est_ms: float
    measured_ms: float | None
    iqr_ms: float | None = None
    error: str | None = None


def require_cuda() -> None:
    """Raise `ConfigError` unless a CUDA GPU is usable (calibration measures real GPU times)."""
    import torch

    if not torch.cuda.is_available():
        raise ConfigError("--calibrate measures eager times on a CUDA GPU, and this machine has none "
                          f"(torch {torch.__version__}, torch.cuda.is_available() is False); run it on "
                          "the GPU machine, or drop --calibrate to rely on the FLOP/byte estimate")


def time_eager_ms(fn: Callable[[], Any], *, device: str = "cuda", warmup: int = 3, repeats: int = 20) -> EagerTiming:
    """Time `fn()`: `warmup` untimed calls, then `repeats` timed calls; median and IQR in ms.

    On CUDA each call is bracketed by CUDA events recorded after `torch.cuda.synchronize()`; on the
    CPU (tests, CPU target) by `time.perf_counter`.
    """
    import torch

    cuda = torch.device(device).type == "cuda"
    for _ in range(warmup):
        fn()
    if cuda:
        torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda.synchronize()
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    q = statistics.quantiles(times, n=4) if len(times) >= 2 else [times[0]] * 3
    return EagerTiming(median_ms=statistics.median(times), iqr_ms=q[2] - q[0], repeats=repeats)


def measure_task(code: str, *, device: str = "cuda", warmup: int = 3, repeats: int = 20) -> EagerTiming:
    """Build the task at its full sizes on `device` and time its eager forward."""
    import torch

    from cudagym.tasks.corpus.estimate import load_module

    mod = load_module(code)
    prev = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    try:
        torch.manual_seed(0)
        with torch.device(device):
            model = mod.Model(*mod.get_init_inputs())
            inputs = list(mod.get_inputs())
        with torch.no_grad():
            return time_eager_ms(lambda: model(*inputs), device=device, warmup=warmup, repeats=repeats)
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = prev


def sample_ids(ids: list[str], k: int, seed: int) -> list[str]:
    """A reproducible sample of `k` ids (all of them if there are fewer), in input order."""
    if k >= len(ids):
        return list(ids)
    chosen = set(random.Random(f"cudagym-calibrate:{seed}").sample(ids, k))
    return [i for i in ids if i in chosen]


def summarize(rows: list[CalibrationRow], min_ms: float, max_ms: float) -> dict[str, Any]:
    """Share in the window, median |ln(est/measured)|, and a per-bucket table."""
    ok = [r for r in rows if r.measured_ms is not None and r.measured_ms > 0 and r.est_ms > 0]
    logs = [abs(math.log(r.est_ms / r.measured_ms)) for r in ok]  # type: ignore[operator]
    signed = [math.log(r.est_ms / r.measured_ms) for r in ok]  # type: ignore[operator]
    in_window = [r for r in ok if min_ms <= r.measured_ms <= max_ms]  # type: ignore[operator]
    buckets: list[dict[str, Any]] = []
    edges = [0.0, 0.1, 1.0, 10.0, 100.0, math.inf]
    for lo, hi in zip(edges, edges[1:]):
        sel = [r for r in ok if lo <= r.measured_ms < hi]  # type: ignore[operator]
        if sel:
            buckets.append({"measured_ms": f"[{lo:g}, {hi:g})", "tasks": len(sel),
                            "median_abs_log_ratio": round(statistics.median(
                                abs(math.log(r.est_ms / r.measured_ms)) for r in sel), 3),  # type: ignore[operator]
                            "median_est_over_measured": round(statistics.median(
                                r.est_ms / r.measured_ms for r in sel), 3)})  # type: ignore[operator]
    worst = sorted(ok, key=lambda r: -abs(math.log(r.est_ms / r.measured_ms)))[:10]  # type: ignore[operator]
    return {
        "sampled": len(rows), "measured": len(ok), "failed": len(rows) - len(ok),
        "share_in_window": round(len(in_window) / len(ok), 4) if ok else None,
        "window_ms": [min_ms, max_ms],
        "median_abs_log_ratio": round(statistics.median(logs), 4) if logs else None,
        "median_log_ratio": round(statistics.median(signed), 4) if signed else None,
        "buckets": buckets,
        "worst": [r.model_dump() for r in worst],
        "errors": [r.model_dump() for r in rows if r.error][:10],
    }


def calibrate_dir(out: str | Path, *, sample: int = 200, seed: int = 0, warmup: int = 3, repeats: int = 20,
                  console: Any = None) -> dict[str, Any]:
    """Measure a sample of the built corpus in `out` on the GPU; write and return the summary."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    import torch
    from rich.console import Console
    from rich.progress import Progress

    from cudagym.tasks.corpus.build import PARQUET_NAME

    require_cuda()
    console = console or Console(stderr=True)
    out = Path(out)
    table = pq.read_table(out / PARQUET_NAME)
    rows = table.to_pylist()
    by_id = {r["id"]: r for r in rows}
    chosen = sample_ids(list(by_id), sample, seed)
    report_json = out / "report.json"
    report_cfg = json.loads(report_json.read_text())["config"]["filters"] if report_json.exists() else {}
    min_ms, max_ms = report_cfg.get("min_ms", 1.0), report_cfg.get("max_ms", 100.0)
    results: list[CalibrationRow] = []
    with Progress(console=console) as bar:
        job = bar.add_task(f"timing eager on {torch.cuda.get_device_name()}", total=len(chosen))
        for tid in chosen:
            r = by_id[tid]
            try:
                t = measure_task(r["code"], warmup=warmup, repeats=repeats)
                results.append(CalibrationRow(id=tid, est_ms=r["est_ms"], measured_ms=t.median_ms, iqr_ms=t.iqr_ms))
            except Exception as e:  # noqa: BLE001 - OOM or a task failure: recorded, not fatal
                results.append(CalibrationRow(id=tid, est_ms=r["est_ms"], measured_ms=None,
                                              error=f"{type(e).__name__}: {str(e)[:200]}"))
            finally:
                torch.cuda.empty_cache()
            bar.advance(job)
    summary = summarize(results, min_ms, max_ms)
    summary["device"] = torch.cuda.get_device_name()
    summary["torch"] = torch.__version__
    measured = {r.id: r.measured_ms for r in results}
    pq.write_table(pa.Table.from_pylist([r.model_dump() for r in results]), out / "calibration.parquet")
    col = pa.array([measured.get(r["id"]) for r in rows], type=pa.float64())
    if "measured_ms" in table.column_names:
        table = table.drop(["measured_ms"])
    tmp = out / (PARQUET_NAME + ".tmp")
    pq.write_table(table.append_column("measured_ms", col), tmp)
    os.replace(tmp, out / PARQUET_NAME)
    (out / "calibration.json").write_text(json.dumps(summary, indent=1))
    return summary


def print_calibration(summary: dict[str, Any], console: Any = None) -> None:
    from rich.console import Console
    from rich.table import Table

    console = console or Console()
    t = Table(title=f"calibration on {summary.get('device', '?')}: {summary['measured']}/{summary['sampled']} "
                    f"measured; in window {summary['window_ms']} ms: "
                    f"{100 * (summary['share_in_window'] or 0):.1f}%; median |ln(est/measured)| = "
                    f"{summary['median_abs_log_ratio']}")
    for c in ("measured ms", "tasks", "median |ln ratio|", "median est/measured"):
        t.add_column(c, justify="right")
    for b in summary["buckets"]:
        t.add_row(b["measured_ms"], str(b["tasks"]), str(b["median_abs_log_ratio"]), str(b["median_est_over_measured"]))
    console.print(t)
