"""Why some kernels read longer under the CUDA profiler than under Nsight Compute.

Found on an H200 (torch 2.11, CUDA 13): the CUDA profiler's concurrent-kernel tracing slows
kernels of many short-lived blocks. With events around the kernel, `sbg` takes 57.9 us without
the profiler and 64.9 us with it running (ncu: 56.4 us); v1, v3 and v4 are 4.6-6.7 us slower
too. torch's `mul`, cuBLAS's `mm`, Triton's `sbg-triton` and the grid-stride v2 change by at
most 0.4 us. The L2 preparation and the timer's streams change nothing (`read` and `protocol`
agree within 0.3 us).
The timer that replaced the traced one (gate kernels and events, no profiler: `timer`) reads
every kernel here at 0.955-0.992x ncu (H200, 2026-11-22).

Several kernels run after different preparations of the GPU: torch's elementwise `mul` at the
bundled tasks' sizes (16M floats: it reads 64 MB and writes 64 MB), a compute-bound one (`mm`: a
1024x1024 float32 matmul), and three of `ew_scale_bias_gelu`: the honest solution's kernel, called
through ctypes (`sbg`) and through a torch extension (`sbg-ext`), both built with the evaluator
first, and torch.compile's Triton kernel of the reference (`sbg-triton`). Then the same computation
in other launch shapes (`benchmarks/probe/launch_shapes.cu`, built into the `sbg` library): v1 1024
threads per block, v2 grid-stride over 8 blocks per SM, v3 32-bit indices, v4 a plain copy in the
original shape.
Each runs after one of two preparations:

- read:          the harness's L2 flush (reading a buffer twice the L2's size);
- protocol:      the traced timer's protocol (before the gate kernels): flush and a one-thread
                 sleep window on a second stream, which the kernel's stream waits for; a marker
                 after it on the second stream.

Each kernel's own duration is read several ways, in separate processes: CUDA events right around
it, without and with the CUDA profiler running (`events`, `events+cupti`), the CUDA profiler's
own record of the kernel (CUPTI, through torch: `cupti`), the current timer (`timer`: a
`DeviceTimer` call, gate kernels and events, its overhead left out; shown on the protocol rows),
and Nsight Compute's
gpu__time_duration with `--cache-control all` (ncu flushes caches itself before the kernel) and
with `--cache-control none` (ncu keeps the state the preparation left), with clocks not locked
(`--clock-control none`, as in the profile tool's ncu summary). The SM clock (NVML) is sampled while the
kernels run under the profiler and under ncu.

Usage: python benchmarks/probe_ncu_gap.py [--calls 200]   (needs a GPU and ncu on PATH)
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import ctypes
import importlib.util
import io
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = str(Path(__file__).resolve().parent.parent)

VARIANTS = ("read", "protocol")
SHAPES = ("v1", "v2", "v3", "v4")  # benchmarks/probe/launch_shapes.cu
KERNELS = ("mul", "mm", "sbg", "sbg-ext", "sbg-triton", *SHAPES)
KIND = {"sbg-ext": "sbg"}  # kernels of the same name (told apart by their order in ncu's log)


def job(mode: str, calls: int, artifacts: str) -> dict[str, dict[str, float]]:
    import pynvml
    import torch

    from cudagym import runtime
    from cudagym.sandbox.timing import DeviceTimer

    pynvml.nvmlInit()
    nvml = pynvml.nvmlDeviceGetHandleByIndex(0)
    dev = torch.device("cuda")
    n = 16 * 2**20
    x, y, o = torch.randn(n, device=dev), torch.randn(n, device=dev), torch.empty(n, device=dev)
    a, b, c = (torch.randn(1024, 1024, device=dev) for _ in range(3))
    ctypes_dir, ext_dir = artifacts.split(os.pathsep)
    os.environ[runtime.ENV_VAR] = ctypes_dir
    sys.path.insert(0, ext_dir)
    xs = x.view(4096, 4096)
    sbg = {}
    for name, fmt in (("sbg", "cuda"), ("sbg-ext", "cuda_binding")):
        path = os.path.join(ROOT, "examples", "solutions", "ew_scale_bias_gelu", fmt, "model_new.py")
        spec = importlib.util.spec_from_file_location(f"model_new_{fmt}", path)
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        sbg[name] = mod.ModelNew(4096, 1.7).to(dev)
        torch.nn.init.normal_(sbg[name].bias)
    bias = sbg["sbg"].bias.detach()
    lib = runtime.kernel_library()
    sms = torch.cuda.get_device_properties(dev).multi_processor_count

    def shape(k: int) -> Any:
        def launch() -> None:
            stream = ctypes.c_void_p(torch.cuda.current_stream().cuda_stream)
            lib.probe_shape(k, ctypes.c_void_p(x.data_ptr()), ctypes.c_void_p(bias.data_ptr()),
                            ctypes.c_void_p(o.data_ptr()), ctypes.c_int64(n), ctypes.c_int64(4096),
                            ctypes.c_float(1.7), sms, stream)
        return launch

    triton = torch.compile(lambda v: torch.nn.functional.gelu(v * 1.7 + bias))
    l2 = torch.cuda.get_device_properties(dev).L2_cache_size
    buf = torch.zeros(2 * l2 // 4, dtype=torch.int32, device=dev)
    sink = torch.empty(buf.numel() // 1024, dtype=torch.int32, device=dev)
    marker = torch.empty(1, dtype=torch.int32, device=dev)
    side = torch.cuda.Stream()
    cycles = sleep_cycles(200.0)
    kernels = {"mul": lambda: torch.mul(x, 1.7, out=o), "add": lambda: torch.add(x, y, out=o),
               "mm": lambda: torch.mm(a, b, out=c), "sbg": lambda: sbg["sbg"](xs),
               "sbg-ext": lambda: sbg["sbg-ext"](xs), "sbg-triton": lambda: triton(xs),
               **{v: shape(i + 1) for i, v in enumerate(SHAPES)}}
    clocks: dict[str, list[int]] = {}
    cudart = torch.cuda.cudart()

    def prepare(variant: str) -> None:
        if variant == "read":
            torch.sum(buf.view(-1, 1024), dim=1, out=sink)

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
        if variant == "protocol":  # the GPU is still running the window or the kernel
            clocks.setdefault(kernel, []).append(pynvml.nvmlDeviceGetClockInfo(nvml, pynvml.NVML_CLOCK_SM))
        if variant == "protocol":
            side.wait_stream(caller)
            with torch.cuda.stream(side):
                marker.zero_()
        torch.cuda.synchronize()

    out: dict[str, dict[str, float]] = {}
    if mode == "timer":
        timer = DeviceTimer(dev)
        for kernel in KERNELS:
            fn = kernels[kernel]
            for _ in range(20):
                timer.call(fn, [])
            timer.start()
            for _ in range(calls):
                timer.call(fn, [])
            out[f"{kernel}/protocol"] = {"median_us": 1e3 * statistics.median(timer.finish())}
        return out
    for kernel in KERNELS:
        for variant in VARIANTS:
            for _ in range(20):
                one(variant, kernel)
            key = f"{kernel}/{variant}"
            if mode == "ncu":  # ncu profiles the kernels between start and stop only
                print(key, flush=True)
                for _ in range(min(calls, 15)):
                    one(variant, kernel, (cudart.cudaProfilerStart, cudart.cudaProfilerStop))
                if variant == "protocol":
                    print(f"clock {kernel} {statistics.median(clocks[kernel])}", flush=True)
                continue
            from torch.profiler import ProfilerActivity, profile

            if mode.startswith("events"):
                evs = []
                cupti = (profile(activities=[ProfilerActivity.CUDA]) if mode == "events+cupti"
                         else contextlib.nullcontext())
                with cupti:
                    for _ in range(calls):
                        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                        one(variant, kernel, (s.record, e.record))
                        evs.append(s.elapsed_time(e))
                out[key] = {"median_us": 1e3 * statistics.median(evs)}
                continue

            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                for _ in range(calls):
                    one(variant, kernel)
            durs = [e.time_range.end - e.time_range.start for e in prof.events()
                    if e.device_type == torch.autograd.DeviceType.CUDA and kind_of(e.name) == KIND.get(kernel, kernel)]
            out[key] = {"median_us": per_call(durs, calls)}
            if variant == "protocol":
                out[key]["sm_mhz"] = statistics.median(clocks[kernel][-calls:])
    return out


def sleep_cycles(us: float) -> int:
    """GPU clock cycles of torch's sleep kernel that last about `us` microseconds."""
    import torch

    probe = 1_000_000
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    for _ in range(2):  # the first run loads the kernel
        start.record()
        torch.cuda._sleep(probe)
        end.record()
        end.synchronize()
    return max(1, int(probe * us / 1e3 / max(start.elapsed_time(end), 1e-6)))


def kind_of(name: str) -> str:
    """Which probe kernel a kernel name belongs to ("" for the preparations' own kernels)."""
    n = name.lower()
    if any(p in n for p in ("reduce", "fill", "spin")):
        return ""
    if "probe_v" in n:
        return n[n.index("probe_v") + 6:][:2]
    for kernel, pattern in (("sbg-triton", "triton"), ("mul", "mulfunctor"), ("add", "add"),
                            ("sbg", "scale_bias_gelu")):
        if pattern in n:
            return kernel
    return "mm"


def per_call(durations: list[float], calls: int) -> float:
    """The median kernel time per call (the mean, if a call ran more than one kernel)."""
    if len(durations) == calls:
        return statistics.median(durations)
    return sum(durations) / calls


def ncu_run(calls: int, cache: str, clock: str, artifacts: str) -> dict[str, dict[str, float]]:
    ncu = shutil.which("ncu")
    if ncu is None:
        return {}
    with tempfile.TemporaryDirectory() as d:
        log = os.path.join(d, "ncu.csv")
        cmd = [ncu, "--csv", "--clock-control", clock, "--cache-control", cache, "--profile-from-start", "off",
               "--metrics", "gpu__time_duration.sum", "--log-file", log,
               sys.executable, __file__, "--child", "ncu", "--calls", str(calls), "--artifacts", artifacts]
        r = subprocess.run(cmd, capture_output=True, text=True)
        keys = [line.strip() for line in r.stdout.splitlines() if "/" in line and line.split("/")[0] in KERNELS]
        sm = {line.split()[1]: float(line.split()[2]) for line in r.stdout.splitlines() if line.startswith("clock ")}
        text = Path(log).read_text() if os.path.exists(log) else ""
    start = text.find('"ID"')
    if start < 0:
        print(r.stdout[-2000:], r.stderr[-2000:], text[-2000:])
        return {}
    unit = {"nsecond": 1e-3, "usecond": 1.0, "msecond": 1e3}
    by_kind: dict[str, list[float]] = {}
    for row in csv.DictReader(io.StringIO(text[start:])):
        if row["Metric Name"] == "gpu__time_duration.sum":
            value = float(row["Metric Value"].replace(",", "")) * unit.get(row["Metric Unit"], 1e-3)
            by_kind.setdefault(kind_of(row["Kernel Name"]), []).append(value)
    per = min(calls, 15)
    res: dict[str, dict[str, float]] = {}
    for kernel, vals in by_kind.items():  # in each kernel's rows, the variants follow in order
        ks = [k for k in keys if KIND.get(k.split("/")[0], k.split("/")[0]) == kernel]
        size = len(vals) // max(len(ks), 1)
        for i, k in enumerate(ks):
            res[k] = {"median_us": per_call(vals[i * size:(i + 1) * size], per)}
    for kernel, mhz in sm.items():
        res.setdefault(f"{kernel}/protocol", {})["sm_mhz"] = mhz
    return res


def build_sbg() -> str:
    """Build the honest ew_scale_bias_gelu solutions (ctypes, extension); their artifact directories."""
    from cudagym.rewards.evaluator import Evaluator, EvaluatorConfig
    from cudagym.sandbox.workspace import Workspace
    from cudagym.tasks.loaders import bundled_task

    cache = Path(tempfile.mkdtemp(prefix="cudagym-probe-"))
    with Evaluator(EvaluatorConfig(target="cuda", cache_dir=cache, compile_baseline=False)) as ev:
        task = bundled_task("ew_scale_bias_gelu").for_target(ev.target)
        dirs = []
        for fmt in ("cuda", "cuda_binding"):
            ws = Workspace.from_solution(cache / fmt, task, Path(ROOT) / "examples" / "solutions" / task.id / fmt)
            if fmt == "cuda":
                shutil.copy(Path(ROOT) / "benchmarks" / "probe" / "launch_shapes.cu", ws.root / "kernels")
            built = ev.compile(task, ws)
            assert built.ok and built.artifact_dir, built
            dirs.append(built.artifact_dir)
        return os.pathsep.join(dirs)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--calls", type=int, default=200)
    ap.add_argument("--child", choices=("cupti", "events", "events+cupti", "timer", "ncu"), help=argparse.SUPPRESS)
    ap.add_argument("--artifacts", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        res = job(a.child, a.calls, a.artifacts)
        if a.child != "ncu":
            print(json.dumps(res))
        return
    artifacts = build_sbg()
    cols: dict[str, dict[str, dict[str, float]]] = {}
    for mode in ("events", "events+cupti", "cupti", "timer"):
        r = subprocess.run([sys.executable, __file__, "--child", mode, "--calls", str(a.calls),
                            "--artifacts", artifacts],
                           capture_output=True, text=True)
        if r.returncode:
            sys.exit(r.stderr[-3000:])
        cols[mode] = json.loads(r.stdout.strip().splitlines()[-1])
    for cache, clock in (("all", "none"),):
        cols[f"ncu/{cache}" + ("/base" if clock == "base" else "")] = ncu_run(a.calls, cache, clock, artifacts)
    print("SM clock (MHz, median) while the protocol ran: "
          + ", ".join(f"{k}: cupti {cols['cupti'].get(f'{k}/protocol', {}).get('sm_mhz')}, "
                      f"ncu {cols['ncu/all'].get(f'{k}/protocol', {}).get('sm_mhz')}" for k in KERNELS))
    names = list(cols)
    print(f"{'kernel/preparation':22s}" + "".join(f"{n:>14s}" for n in names) + "   cupti/ncu   timer/ncu")
    for k in (f"{kn}/{v}" for kn in KERNELS for v in VARIANTS):
        vals = [cols[n].get(k, {}).get("median_us") for n in names]
        ncu = cols["ncu/all"].get(k, {}).get("median_us")
        ratios = [f"{v / ncu:12.3f}" if v and ncu else f"{'-':>12s}" for v in (vals[2], vals[3])]
        print(f"{k:22s}" + "".join(f"{v:14.2f}" if v else f"{'-':>14s}" for v in vals) + "".join(ratios))
    print("(medians in microseconds)")


if __name__ == "__main__":
    main()
