"""The environment's own overhead per step, excluding compile/verify/profile time.

Protocol: one env on the CPU target, one episode; each row times `env.step(action)` (the sync
API: parse → tool → observation → info, including the private event loop) over `--reps`
repetitions after 20 warm-up steps and reports the median and p90 in milliseconds. The
evaluator is a stub that returns canned results at once (only in this benchmark: the point is
to exclude evaluator time). The baseline rows time the raw `Workspace` operation each file tool
wraps, in the same run; "overhead" is env median minus raw median.

    python benchmarks/bench_env_overhead.py [--reps 300]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from cudagym.env import KernelEnv
from cudagym.core.verdict import CompileResult, ProfileResult, TimingStats, Verdict, VerifyResult
from cudagym.sandbox.workspace import Workspace
from cudagym.tasks.loaders import bundled_task
from cudagym.tasks.model import Target

KERNEL = ("// a kernel\n" + "\n".join(f"extern \"C\" void f{i}(float* x) {{ x[{i}] += 1.0f; }}" for i in range(60))
          + "\n")


class StubEvaluator:
    """Canned results with no work: isolates the environment's overhead."""

    target = Target.CPU

    async def acompile(self, task: Any, ws: Any) -> CompileResult:
        return CompileResult(ok=True, cached=True, seconds=0.0)

    async def averify(self, task: Any, ws: Any) -> VerifyResult:
        return VerifyResult(ok=True, correct=True, trials=6, trials_passed=6, max_abs_error=1e-6)

    async def aprofile(self, task: Any, ws: Any, ncu: bool = False) -> ProfileResult:
        t = TimingStats.from_samples([1.0, 1.1, 0.9])
        return ProfileResult(ok=True, candidate=t, eager=t, compiled=t, speedup_vs_eager=1.0, speedup_vs_compile=1.0)

    async def aevaluate(self, task: Any, ws: Any) -> Verdict:
        return Verdict(reward=1.0, milestone="correct", compiled=True, correct=True, reasons=["stub"])

    def close(self) -> None:
        pass


def timed_ms(fn: Callable[[], Any], reps: int, warmup: int = 20) -> tuple[float, float]:
    for _ in range(warmup):
        fn()
    samples = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        samples.append((time.perf_counter() - t0) * 1e3)
    samples.sort()
    return statistics.median(samples), samples[int(0.9 * (len(samples) - 1))]


def text(name: str, **args) -> str:
    return f"Next step.\n<tool_call>{json.dumps({'name': name, 'arguments': args})}</tool_call>"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=300)
    a = ap.parse_args()
    task = bundled_task("ew_scale_bias_gelu")
    root = Path(tempfile.mkdtemp(prefix="bench-env-"))
    env = KernelEnv(tasks=[task], evaluator=StubEvaluator(), workspace_root=root / "env", max_turns=10**9)
    env.reset()
    env.step(text("write_file", path="kernels/k.cpp", content=KERNEL))
    raw = Workspace.create(root / "raw", task.for_target(Target.CPU))
    raw.write("kernels/k.cpp", KERNEL)
    toggle = [0]

    def edit_env() -> None:
        old, new = ("x[0] += 1.0f", "x[0] += 2.0f") if toggle[0] % 2 == 0 else ("x[0] += 2.0f", "x[0] += 1.0f")
        toggle[0] += 1
        env.step(text("edit_file", path="kernels/k.cpp", old_string=old, new_string=new))

    def edit_raw() -> None:
        old, new = ("x[0] += 1.0f", "x[0] += 2.0f") if toggle[0] % 2 == 0 else ("x[0] += 2.0f", "x[0] += 1.0f")
        toggle[0] += 1
        raw.edit("kernels/k.cpp", old, new)

    rows = [
        ("write_file (4 KB)", lambda: env.step(text("write_file", path="kernels/k.cpp", content=KERNEL)),
         lambda: raw.write("kernels/k.cpp", KERNEL)),
        ("edit_file", edit_env, edit_raw),
        ("read_file", lambda: env.step(text("read_file", path="kernels/k.cpp")), lambda: raw.read("kernels/k.cpp")),
        ("list_files", lambda: env.step(text("list_files")), lambda: raw.list()),
        ("write_file (structured)",
         lambda: env.step({"name": "write_file", "arguments": {"path": "kernels/k.cpp", "content": KERNEL}}),
         lambda: raw.write("kernels/k.cpp", KERNEL)),
        ("compile (stub evaluator)", lambda: env.step(text("compile")), None),
        ("verify (stub evaluator)", lambda: env.step(text("verify")), None),
        ("profile (stub evaluator)", lambda: env.step(text("profile")), None),
        ("unparseable text (error obs)", lambda: env.step("I am thinking without a tool call."), None),
        ("4 calls in one turn", lambda: env.step(text("list_files") + text("read_file", path="model.py")
                                                 + text("compile") + text("verify")), None),
    ]
    print(f"env step overhead, CPU target, {a.reps} reps after 20 warm-up (ms; median / p90)")
    print(f"{'step':32} {'env median':>11} {'env p90':>9} {'raw ws median':>14} {'overhead':>9}")
    worst = 0.0
    for name, env_fn, raw_fn in rows:
        med, p90 = timed_ms(env_fn, a.reps)
        if raw_fn is not None:
            rmed, _ = timed_ms(raw_fn, a.reps)
            over = med - rmed
            print(f"{name:32} {med:11.3f} {p90:9.3f} {rmed:14.3f} {over:9.3f}")
        else:
            over = med
            print(f"{name:32} {med:11.3f} {p90:9.3f} {'-':>14} {over:9.3f}")
        worst = max(worst, over)
    print(f"worst per-step overhead: {worst:.3f} ms (target < 5 ms)")
    env.close()


if __name__ == "__main__":
    main()
