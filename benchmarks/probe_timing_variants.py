"""Where the spread of a launch-bound call's time comes from: interval definitions compared.

One short elementwise GPU call (one kernel of about 0.07 ms) is timed in `--jobs` fresh
processes, each timing it several ways in the same process. Printed: per-process medians and
the CV across processes for each way. The ways:

- sync-both: flush, synchronize, start event, call, device-wide synchronize, end event
  (the protocol before this probe);
- sync-before/stream-end: as above, but the end event is recorded on the stream right after the
  call (no side-stream coverage);
- overlap/stream-end: flush, start event, call, end event, no synchronize between (Triton's
  do_bench; the call's launch overlaps the flush);
- overlap/cupti: as overlap, with an end marker (a 4-byte memset) after the call; under the CUDA
  profiler, the interval is from the flush's end to the latest end of any GPU activity of the
  call on any stream (side streams covered) or the marker's start;
- kernel: the kernel's own GPU time from the profiler.

Usage: python benchmarks/probe_timing_variants.py [--jobs 10] [--calls 300] [--spin]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys


def job(calls: int, spin: bool) -> dict[str, float]:
    if spin:
        from cudagym.sandbox.timing.gate import cudart

        cudart().cudaSetDeviceFlags(1)  # cudaDeviceScheduleSpin, before the context exists
    import torch
    from torch.profiler import ProfilerActivity, profile

    dev = torch.device("cuda")
    n = 16 * 2**20
    x, y = torch.randn(n, device=dev), torch.randn(n, device=dev)
    flush_buf = torch.empty(2 * 50 * 2**20 // 4, dtype=torch.int32, device=dev)
    marker = torch.empty(1, dtype=torch.int32, device=dev)
    fn = lambda: torch.add(x, y, alpha=0.5)  # noqa: E731
    sync = torch.cuda.synchronize
    ev = lambda: torch.cuda.Event(enable_timing=True)  # noqa: E731

    def sync_both() -> float:
        flush_buf.zero_()
        sync()
        s, e = ev(), ev()
        s.record()
        fn()
        sync()
        e.record()
        e.synchronize()
        return s.elapsed_time(e)

    def stream_end() -> float:
        flush_buf.zero_()
        sync()
        s, e = ev(), ev()
        s.record()
        fn()
        e.record()
        sync()
        return s.elapsed_time(e)

    def overlap() -> float:
        flush_buf.zero_()
        s, e = ev(), ev()
        s.record()
        fn()
        e.record()
        sync()
        return s.elapsed_time(e)

    out: dict[str, float] = {"cpu": float(os.sched_getaffinity(0).__len__())}
    for name, f in (("sync-both", sync_both), ("sync-before/stream-end", stream_end), ("overlap/stream-end", overlap)):
        for _ in range(100):
            f()
        out[name] = statistics.median(f() for _ in range(calls))
    # overlap/cupti and kernel time
    for _ in range(100):
        flush_buf.zero_()
        fn()
        marker.zero_()
        sync()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            flush_buf.zero_()
            fn()
            marker.zero_()
            sync()
    acts = sorted((e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA),
                  key=lambda e: e.time_range.start)
    # sequence per call: flush (memset/fill kernel), the call's kernel(s), marker (fill of 4 bytes)
    per_call, kern = [], []
    i = 0
    while i + 2 < len(acts):
        f, k, m = acts[i], acts[i + 1], acts[i + 2]
        per_call.append((max(k.time_range.end, m.time_range.start) - f.time_range.end) / 1e3)
        kern.append((k.time_range.end - k.time_range.start) / 1e3)
        i += 3
    out["overlap/cupti"] = statistics.median(per_call)
    out["kernel"] = statistics.median(kern)
    out["n_acts"] = float(len(acts))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--jobs", type=int, default=10)
    ap.add_argument("--calls", type=int, default=300)
    ap.add_argument("--spin", action="store_true", help="spin-wait synchronization (cudaDeviceScheduleSpin)")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        print(json.dumps(job(a.calls, a.spin)))
        return
    rows = []
    for j in range(a.jobs):
        cmd = [sys.executable, __file__, "--child", "--calls", str(a.calls)] + (["--spin"] if a.spin else [])
        rows.append(json.loads(subprocess.run(cmd, check=True, capture_output=True, text=True).stdout))
        print(j, {k: round(v, 4) for k, v in rows[-1].items()}, flush=True)
    print(f"\nCV across {a.jobs} processes{' (spin)' if a.spin else ''}:")
    for k in rows[0]:
        if k in ("cpu", "n_acts"):
            continue
        xs = [r[k] for r in rows]
        m = statistics.mean(xs)
        print(f"  {k:24s} median {statistics.median(xs):.4f} ms  range {min(xs):.4f}-{max(xs):.4f}  "
              f"CV {100 * statistics.stdev(xs) / m:.2f}%")


if __name__ == "__main__":
    main()
