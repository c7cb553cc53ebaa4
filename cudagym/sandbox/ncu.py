"""Nsight Compute metrics for the profile tool: `ncu` runs a sandboxed worker as a subprocess."""

from __future__ import annotations

import asyncio
import csv
import io
import os
import shutil
import sys
from collections import defaultdict
from typing import TYPE_CHECKING, Any

from cudagym.sandbox.limits import namespace_prefix

if TYPE_CHECKING:
    from cudagym.rewards.evaluator import Evaluator
    from cudagym.sandbox.workspace import Workspace
    from cudagym.tasks.model import Task

METRICS = (
    "gpu__time_duration.sum",
    "sm__throughput.avg.pct_of_peak_sustained_elapsed",
    "dram__throughput.avg.pct_of_peak_sustained_elapsed",
    "sm__warps_active.avg.pct_of_peak_sustained_active",
)
CALLS = 3  # forward calls of the `ncu` job that ncu records (after one warm-up call)


def parse_ncu_csv(text: str) -> dict[str, Any]:
    """Per-kernel mean metrics and the total kernel time per forward call (ms)."""
    start = text.find('"ID"')
    if start < 0:
        return {"error": "ncu produced no metrics (no kernels ran?)", "kernels": []}
    rows = list(csv.DictReader(io.StringIO(text[start:])))
    per: dict[str, dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
    for r in rows:
        try:
            value = float(str(r.get("Metric Value", "")).replace(",", ""))
        except ValueError:
            continue
        unit = r.get("Metric Unit", "")
        if r.get("Metric Name") == "gpu__time_duration.sum":
            value *= {"nsecond": 1e-6, "usecond": 1e-3, "msecond": 1.0, "second": 1e3}.get(unit, 1e-6)
        per[r.get("Kernel Name", "?")][r.get("Metric Name", "?")].append(value)
    kernels = []
    total_ms = 0.0
    for name, metrics in per.items():
        entry: dict[str, Any] = {"kernel": name[:200], "launches": len(metrics.get("gpu__time_duration.sum", []))}
        for m, vals in metrics.items():
            entry[m] = sum(vals) / len(vals)
        total_ms += sum(metrics.get("gpu__time_duration.sum", []))
        kernels.append(entry)
    kernels.sort(key=lambda e: -e.get("gpu__time_duration.sum", 0) * e["launches"])
    return {"kernels": kernels, "kernel_ms_per_call": total_ms / CALLS}


async def ncu_summary(evaluator: Evaluator, task: Task, workspace: Workspace, artifact_dir: str | None) -> dict[str, Any]:
    ncu = shutil.which("ncu")
    if ncu is None:
        return {"error": "ncu (Nsight Compute) is not installed on this machine"}
    job = evaluator._job("ncu", task, workspace, artifact_dir=artifact_dir)
    log = workspace.build_dir / "ncu.csv"
    r, w = os.pipe()
    env = {k: v for k, v in os.environ.items() if k in ("PATH", "LD_LIBRARY_PATH", "PYTHONPATH", "CUDA_VISIBLE_DEVICES", "HOME")}
    env.update(CUDAGYM_DEVICE="cuda", PYTHONUNBUFFERED="1", CUDAGYM_UNDER_NCU="1",  # no profiler of our own
               CUDAGYM_OPWATCH_DIR=str(getattr(evaluator.sandbox, "opwatch_dir", "")))
    # ncu's injected library takes a lock under $TMPDIR (default /tmp/nvidia) from inside the
    # worker, whose writes are confined to the workspace
    tmp = workspace.build_dir / "tmp"
    tmp.mkdir(parents=True, exist_ok=True)
    env["TMPDIR"] = str(tmp)
    # only the candidate's calls: the worker brackets them with cudaProfilerStart/Stop
    cmd = [*namespace_prefix(), ncu, "--csv", "--clock-control", "none", "--target-processes", "all",
           "--profile-from-start", "off",
           "--metrics", ",".join(METRICS), "--log-file", str(log),
           sys.executable, "-m", "cudagym.sandbox.worker", str(w)]
    proc = await asyncio.create_subprocess_exec(*cmd, stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
                                                stderr=asyncio.subprocess.STDOUT, pass_fds=(w,), env=env)
    os.close(w)
    try:
        out, _ = await asyncio.wait_for(proc.communicate((job.model_dump_json() + "\n").encode()),
                                        timeout=evaluator.config.limits.timeout_s * 3)
    except asyncio.TimeoutError:
        proc.kill()
        return {"error": "ncu timed out"}
    finally:
        os.close(r)
    text = log.read_text(errors="replace") if log.exists() else ""
    result = parse_ncu_csv(text)
    if "error" in result:  # ncu writes its own messages (permissions, no kernels) to the log file
        result["output"] = (out.decode(errors="replace")[-1500:] + "\n--- ncu log ---\n" + text[-1500:]).strip()
    return result
