"""Nsight Compute metrics for the profile tool: the `ncu` job kind's worker side.

The evaluator sends an "ncu" job through `Sandbox.run` like any other job, so the backend's
isolation (its container, namespaces, Landlock, limits) and the GPU lease apply to it. Inside the
sandboxed worker, the harness's `run_ncu` calls `ncu_summary`, which starts `ncu` over a child
worker on the same job (`UNDER_NCU` set in its environment); the child (`run_ncu` again, under
ncu) runs the candidate's forward a few times between cudaProfilerStart and cudaProfilerStop,
and the worker returns ncu's metrics, parsed from its CSV log, in its final frame:
`{"ok": true, "ncu": {...}}` (`{"error": ...}` inside when ncu gave none).
"""

from __future__ import annotations

import csv
import io
import os
import shutil
import signal
import subprocess
import sys
from collections import defaultdict
from pathlib import Path
from typing import Any

from cudagym.sandbox.protocol import LimitsConfig
from cudagym.sandbox.worker.wire import Job

METRICS = (
    "gpu__time_duration.sum",
    "sm__throughput.avg.pct_of_peak_sustained_elapsed",
    "dram__throughput.avg.pct_of_peak_sustained_elapsed",
    "sm__warps_active.avg.pct_of_peak_sustained_active",
)
CALLS = 3  # forward calls of the `ncu` job that ncu records (after one warm-up call)
UNDER_NCU = "CUDAGYM_UNDER_NCU"  # set in the child worker's environment: it runs the calls, no profiler of its own
MARGIN_S = 30.0  # the job's time limit beyond ncu's own, so that the worker outlives a hung ncu to report it
NOT_INSTALLED = "ncu (Nsight Compute) is not installed on this machine"


def ncu_job_limits(limits: LimitsConfig) -> LimitsConfig:
    """An ncu job's limits from a job's: ncu's run may take 3x a job's time (kernel replay), and
    the worker's tree holds ncu and a second worker (with its own start-up threads and memory)."""
    return limits.model_copy(update={"timeout_s": limits.timeout_s * 3 + MARGIN_S,
                                     "memory_mb": max(limits.memory_mb * 2, 16384),
                                     "max_processes": limits.max_processes + (os.cpu_count() or 8) + 64})


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


def ncu_summary(job: Job) -> dict[str, Any]:
    """Run `ncu` over a child worker (`python -m cudagym.sandbox.worker`) given `job`, recording
    only what the child runs between cudaProfilerStart and cudaProfilerStop; the parsed metrics,
    or why there are none. The child inherits this worker's environment (its GPU, its opwatch
    directory) and its confinement; it writes only under the workspace's .build directory."""
    ncu = shutil.which("ncu")
    if ncu is None:
        return {"error": NOT_INSTALLED}
    build = Path(job.workspace) / ".build"
    log = build / "ncu.csv"
    # ncu's injected library takes a lock under $TMPDIR (default /tmp/nvidia) from inside the
    # child, whose writes are confined to the workspace
    tmp = build / "tmp"
    tmp.mkdir(parents=True, exist_ok=True)
    log.unlink(missing_ok=True)  # an earlier job's log, or a link planted in its place
    env = {**os.environ, "PYTHONUNBUFFERED": "1", UNDER_NCU: "1", "TMPDIR": str(tmp)}
    cmd = [ncu, "--csv", "--clock-control", "none", "--target-processes", "all", "--profile-from-start", "off",
           "--metrics", ",".join(METRICS), "--log-file", str(log),
           sys.executable, "-m", "cudagym.sandbox.worker"]
    r, w = os.pipe()  # the child's result channel: its frames are not read (the metrics come from ncu's log)
    try:
        proc = subprocess.Popen([*cmd, str(w)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, pass_fds=(w,), env=env, start_new_session=True)
        os.close(w)
        w = -1
        try:
            out, _ = proc.communicate((job.model_dump_json() + "\n").encode(), timeout=job.limits.timeout_s - MARGIN_S)
        except subprocess.TimeoutExpired:
            try:
                os.killpg(proc.pid, signal.SIGKILL)  # ncu and the child it started
            except OSError:
                proc.kill()
            return {"error": "ncu timed out"}
    finally:
        for fd in (r, w):
            if fd >= 0:
                os.close(fd)
    text = _read_own_file(log)
    result = parse_ncu_csv(text)
    if "error" in result:  # ncu writes its own messages (permissions, no kernels) to the log file
        result["output"] = (out.decode(errors="replace")[-1500:] + "\n--- ncu log ---\n" + text[-1500:]).strip()
    return result


def _read_own_file(path: Path) -> str:
    """`path`'s text if it is a regular file (a link the candidate planted there is not followed:
    what it names is not ncu's log), else ""."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    except OSError:
        return ""
    with os.fdopen(fd, "rb") as f:
        return f.read(1 << 24).decode(errors="replace")
