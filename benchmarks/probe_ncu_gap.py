"""Why a short memory-bound kernel reads longer under the CUDA profiler than under Nsight Compute.

Two elementwise kernels of the bundled tasks' sizes (16M floats: `mul` reads 64 MB and writes
64 MB; `add` reads 128 MB and writes 64 MB) run after different preparations of the GPU:

- none:          nothing (back to back after a synchronize);
- read:          the harness's L2 flush (reading a buffer twice the L2's size);
- write:         the older flush (zeroing that buffer: the L2 is left full of dirty lines);
- read+window:   the flush, then a 200 us sleep kernel (the launch window), same stream;
- protocol:      the timer's whole protocol: flush and window on a second stream, which the
                 kernel's stream waits for; a marker after it on the second stream.

Each kernel's own duration is read three ways, in separate processes: CUDA events right around
it (no profiler), the CUDA profiler (CUPTI, through torch), and Nsight Compute's
gpu__time_duration with `--cache-control all` (ncu flushes caches itself before the kernel) and
with `--cache-control none` (ncu keeps the state the preparation left). Clocks are not locked
(`--clock-control none`), as in the profile tool's ncu summary.

Usage: python benchmarks/probe_ncu_gap.py [--calls 200]   (needs a GPU and ncu on PATH)
"""

from __future__ import annotations

import argparse
import csv
import io
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile

VARIANTS = ("none", "read", "write", "read+window", "protocol")
KERNELS = ("mul", "add")


def job(mode: str, calls: int) -> dict[str, dict[str, float]]:
    import torch

    from cudagym.sandbox.timing import _sleep_cycles

    dev = torch.device("cuda")
    n = 16 * 2**20
    x, y, o = torch.randn(n, device=dev), torch.randn(n, device=dev), torch.empty(n, device=dev)
    l2 = torch.cuda.get_device_properties(dev).L2_cache_size
    buf = torch.zeros(2 * l2 // 4, dtype=torch.int32, device=dev)
    sink = torch.empty(buf.numel() // 1024, dtype=torch.int32, device=dev)
    marker = torch.empty(1, dtype=torch.int32, device=dev)
    side = torch.cuda.Stream()
    cycles = _sleep_cycles(200.0)
    kernels = {"mul": lambda: torch.mul(x, 1.7, out=o), "add": lambda: torch.add(x, y, out=o)}
    cudart = torch.cuda.cudart()

    def prepare(variant: str) -> None:
        if variant in ("read", "read+window"):
            torch.sum(buf.view(-1, 1024), dim=1, out=sink)
        if variant == "write":
            buf.zero_()
        if variant == "read+window":
            torch.cuda._sleep(cycles)

    def one(variant: str, kernel: str, wrap: tuple = (None, None)) -> None:
        torch.cuda.synchronize()
        caller = torch.cuda.current_stream()
        if variant == "protocol":
            with torch.cuda.stream(side):
                torch.sum(buf.view(-1, 1024), dim=1, out=sink)
                torch.cuda._sleep(cycles)
            caller.wait_stream(side)
        else:
            prepare(variant)
        if wrap[0]:
            wrap[0]()
        kernels[kernel]()
        if wrap[1]:
            wrap[1]()
        if variant == "protocol":
            side.wait_stream(caller)
            with torch.cuda.stream(side):
                marker.zero_()
        torch.cuda.synchronize()

    out: dict[str, dict[str, float]] = {}
    for kernel in KERNELS:
        for variant in VARIANTS:
            for _ in range(20):
                one(variant, kernel)
            key = f"{kernel}/{variant}"
            if mode == "ncu":  # ncu profiles the kernels between start and stop only
                print(key, flush=True)
                for _ in range(min(calls, 30)):
                    one(variant, kernel, (cudart.cudaProfilerStart, cudart.cudaProfilerStop))
                continue
            if mode == "events":
                evs = []
                for _ in range(calls):
                    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    one(variant, kernel, (s.record, e.record))
                    evs.append(s.elapsed_time(e))
                out[key] = {"median_us": 1e3 * statistics.median(evs)}
                continue
            from torch.profiler import ProfilerActivity, profile

            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                for _ in range(calls):
                    one(variant, kernel)
            name = "MulFunctor" if kernel == "mul" else "add"
            durs = [e.time_range.end - e.time_range.start for e in prof.events()
                    if e.device_type == torch.autograd.DeviceType.CUDA and name in e.name
                    and "reduce" not in e.name]
            out[key] = {"median_us": statistics.median(durs), "n": len(durs)}
    return out


def ncu_run(calls: int, cache: str) -> dict[str, dict[str, float]]:
    ncu = shutil.which("ncu")
    if ncu is None:
        return {}
    with tempfile.TemporaryDirectory() as d:
        log = os.path.join(d, "ncu.csv")
        cmd = [ncu, "--csv", "--clock-control", "none", "--cache-control", cache, "--profile-from-start", "off",
               "--metrics", "gpu__time_duration.sum", "--log-file", log,
               sys.executable, __file__, "--child", "ncu", "--calls", str(calls)]
        r = subprocess.run(cmd, capture_output=True, text=True)
        keys = [line.strip() for line in r.stdout.splitlines() if "/" in line and line.split("/")[0] in KERNELS]
        text = open(log).read() if os.path.exists(log) else ""
    start = text.find('"ID"')
    if start < 0:
        print(r.stdout[-2000:], r.stderr[-2000:], text[-2000:])
        return {}
    unit = {"nsecond": 1e-3, "usecond": 1.0, "msecond": 1e3}
    vals = [float(row["Metric Value"].replace(",", "")) * unit.get(row["Metric Unit"], 1e-3)
            for row in csv.DictReader(io.StringIO(text[start:])) if row["Metric Name"] == "gpu__time_duration.sum"]
    per = min(calls, 30)
    if len(vals) != per * len(keys):
        print(f"ncu: {len(vals)} kernels for {len(keys)} variants of {per} calls")
        return {}
    return {k: {"median_us": statistics.median(vals[i * per:(i + 1) * per])} for i, k in enumerate(keys)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--calls", type=int, default=200)
    ap.add_argument("--child", choices=("cupti", "events", "ncu"), help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        res = job(a.child, a.calls)
        if a.child != "ncu":
            print(json.dumps(res))
        return
    cols: dict[str, dict[str, dict[str, float]]] = {}
    for mode in ("events", "cupti"):
        r = subprocess.run([sys.executable, __file__, "--child", mode, "--calls", str(a.calls)],
                           capture_output=True, text=True, check=True)
        cols[mode] = json.loads(r.stdout.strip().splitlines()[-1])
    for cache in ("all", "none"):
        cols[f"ncu/{cache}"] = ncu_run(a.calls, cache)
    names = list(cols)
    print(f"{'kernel/preparation':22s}" + "".join(f"{n:>12s}" for n in names) + "   cupti/ncu-all")
    for k in (f"{kn}/{v}" for kn in KERNELS for v in VARIANTS):
        vals = [cols[n].get(k, {}).get("median_us") for n in names]
        ratio = (vals[1] / vals[2]) if vals[1] and vals[2] else None
        print(f"{k:22s}" + "".join(f"{v:12.2f}" if v else f"{'-':>12s}" for v in vals)
              + (f"   {ratio:.3f}" if ratio else ""))
    print("(medians in microseconds)")


if __name__ == "__main__":
    main()
