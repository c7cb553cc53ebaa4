"""How much host memory a verify job's workers take for a problem with a large output.

A task whose output is `--mib` MiB of fp32 (an outer product of two small vectors: the output, not
the inputs, is large) is verified on the CPU target with its reference submitted as its own
candidate (permissive, no own-kernel share: what `cudagym tasks selfcheck` does). Printed per
worker (candidate, reference): the peak memory its job's memory cgroup was charged (what the
sandbox's memory limit, `LimitsConfig.memory_mb`, is checked against), the bytes of its result
memory in use at its end (outputs and evidence sent to the parent), and the verdict. Outputs above
`cudagym.rewards.compare.LARGE_OUTPUT_BYTES` are checked by samples and projections instead of
being copied whole (`cudagym.sandbox.worker.verify`).

Needs the memory cgroup (v1 or v2) the local sandbox isolates jobs with.

Usage: python benchmarks/probe_verify_memory.py [--mib 1024] [--memory-mb 8192]
"""

from __future__ import annotations

import argparse
import contextvars
import math
import os
import tempfile
import textwrap
import time
from pathlib import Path
from typing import Any

import cudagym.sandbox.local as local
from cudagym.rewards.evaluator import Evaluator, EvaluatorConfig
from cudagym.sandbox.limits import JobCgroup
from cudagym.sandbox.local import LocalSandbox
from cudagym.sandbox.protocol import LimitsConfig, VerifyConfig
from cudagym.sandbox.worker.wire import Job
from cudagym.sandbox.workspace import Workspace
from cudagym.selfcheck import reference_as_candidate
from cudagym.tasks.model import Task

OUTER = """\
import torch
import torch.nn as nn

N = {n}


class Model(nn.Module):
    def forward(self, a, b):
        return torch.outer(a, b)


def get_inputs():
    return [torch.randn(N), torch.randn(N)]


def get_init_inputs():
    return []
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mib", type=int, default=1024, help="the output's size (fp32, MiB)")
    ap.add_argument("--memory-mb", type=int, default=LimitsConfig().memory_mb, help="the job's memory limit")
    ap.add_argument("--whole-output-mb", type=int, default=VerifyConfig().whole_output_mb,
                    help="outputs above this are checked by samples and projections")
    ap.add_argument("--timeout-s", type=float, default=LimitsConfig().timeout_s,
                    help="the job's time limit (the CPU's projections take ~0.3 us per element on 2 cores)")
    args = ap.parse_args()
    n = math.isqrt((args.mib << 20) // 4)
    task = Task(id=f"outer_{args.mib}mib", code=OUTER.format(n=n))
    rows: list[tuple[str, int, int]] = []  # (job kind, peak cgroup bytes, result memory bytes)
    job_cgroups: contextvars.ContextVar[list[JobCgroup]] = contextvars.ContextVar("job_cgroups")
    init, kill, collect, run_on = JobCgroup.__init__, JobCgroup.kill, local.collect_outcome, LocalSandbox._run_on

    def init_and_record(self: JobCgroup, *a: Any, **kw: Any) -> None:
        init(self, *a, **kw)
        job_cgroups.get([]).append(self)

    def kill_and_record(self: JobCgroup) -> None:  # the peak, before the cgroup goes
        files = [p / f for p in self.paths for f in ("memory.peak", "memory.max_usage_in_bytes")]
        self.peak = max((int(f.read_text()) for f in files if f.exists()), default=0)  # type: ignore[attr-defined]
        kill(self)

    def collect_and_record(frames: Any, shm_fd: int, *rest: Any) -> None:
        job_cgroups.get([]).append(os.fstat(shm_fd).st_blocks * 512)  # type: ignore[arg-type]  # pages in use
        collect(frames, shm_fd, *rest)

    async def run_on_and_record(self: LocalSandbox, job: Job, *a: Any) -> Any:
        seen: list[Any] = []
        job_cgroups.set(seen)
        got = await run_on(self, job, *a)
        peak = max((getattr(c, "peak", 0) for c in seen if isinstance(c, JobCgroup)), default=0)
        rows.append((job.kind, peak, sum(x for x in seen if isinstance(x, int))))
        return got

    JobCgroup.__init__ = init_and_record  # type: ignore[method-assign]
    JobCgroup.kill = kill_and_record  # type: ignore[method-assign]
    local.collect_outcome = collect_and_record  # type: ignore[assignment]
    LocalSandbox._run_on = run_on_and_record  # type: ignore[method-assign]
    with tempfile.TemporaryDirectory() as tmp:
        cfg = EvaluatorConfig(target="cpu", cache_dir=Path(tmp) / "cache", mode="permissive",
                              verify=VerifyConfig(min_own_share=0.0, whole_output_mb=args.whole_output_mb),
                              limits=LimitsConfig(memory_mb=args.memory_mb, timeout_s=args.timeout_s))
        ev = Evaluator(cfg)
        try:
            ws = Workspace.create(Path(tmp) / "ws", task)
            ws.write("model_new.py", textwrap.dedent(reference_as_candidate(task.code)))
            t0 = time.perf_counter()
            v = ev.verify(task, ws)
            secs = time.perf_counter() - t0
        finally:
            ev.close()
    print(f"output {n}x{n} fp32 = {4 * n * n / 2**20:.0f} MiB, memory limit {args.memory_mb} MiB, "
          f"{VerifyConfig().trials} trials, outputs over {args.whole_output_mb} MiB by samples and projections")
    print(f"verdict: ok={v.ok} trials {v.trials_passed}/{v.trials} {v.error_kind or ''} in {secs:.1f} s")
    for line in v.reasons[:4]:
        print("   ", line[:200])
    print(f"{'job':12} {'peak cgroup MiB':>16} {'result memory MiB':>18}")
    for kind, peak, res in rows:
        print(f"{kind:12} {peak / 2**20:16.0f} {res / 2**20:18.0f}")


if __name__ == "__main__":
    main()
