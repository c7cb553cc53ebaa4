"""What each timed call's evidence costs on a GPU: the close kernel's projections of every output
(`cudagym.sandbox.timing.projection`), and sending the evidence on the pipe.

For each output (fp32 from 4 KB to 256 MB, a 64 MB fp16 one, a 16 MB transposed view) a call that
launches nothing returns it and the close reads it as the harness does; printed: the close's
read phase (median over `--calls`, us: the GPU time per call the evidence takes, left out of the
reported time up to its calibrated cap), the reported time of such a call (should stay ~0), and
the host's time to bring one output's evidence to the host (samples, positions, projections: what
the harness then writes on the pipe). Then a 64 MB relu's reported median. With `--no-projection`
the close kernel is built without its projections (the protocol before them), for comparison;
run both in fresh processes (the gate kernels are compiled once per process).

Usage: python benchmarks/probe_evidence_cost.py [--calls 50] [--no-projection]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

import cudagym.sandbox.timing as timing
import cudagym.sandbox.timing.gate as gate


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--calls", type=int, default=50)
    ap.add_argument("--no-projection", action="store_true")
    args = ap.parse_args()
    if args.no_projection:
        gate._GATE_SOURCE = gate._GATE_SOURCE.replace(
            "if (samples.out[o].proj) project(samples.out[o], (unsigned int)samples.out[o].index, samples.seed);", "")
    timer = timing.DeviceTimer(torch.device("cuda"))
    cal = timer.calibrate()
    label = "samples only" if args.no_projection else "samples + projections"
    print(f"{torch.cuda.get_device_name()} ({label}): overhead {cal.overhead_ns} ns, read cap {cal.read_cap_ns} ns, "
          f"{cal.read_ps_per_element:.3f} ps per element projected, {cal.read_ps_per_strided_element:.3f} strided")
    outputs = {f"fp32 {n >> 10} KB": torch.randn(n // 4, device="cuda") for n in
               (1 << 12, 1 << 16, 1 << 20, 1 << 22, 1 << 24, 1 << 26, 1 << 28)}
    outputs["fp16 64 MB"] = torch.randn(1 << 25, device="cuda").half()
    outputs["fp32 16 MB transposed"] = torch.randn(2048, 2048, device="cuda").t()
    print(f"{'output':24} {'read phase us':>14} {'reported us':>12} {'evidence to host us':>20}")
    for name, out in outputs.items():
        reads, reported, host = [], [], []
        for _ in range(args.calls):
            got: list[timing.Evidence] = []
            _, ms = timer.call(lambda o=out: o, [], lambda o: got.append(timer.read_at_end(o)))
            reads.append(timer.read_phase_ns / 1e3)
            reported.append(ms * 1e3)
            t0 = time.perf_counter()
            ev = got[0]
            for part in (ev.values, ev.positions, ev.projections):
                if part is not None:
                    part.cpu()
            host.append((time.perf_counter() - t0) * 1e6)
        print(f"{name:24} {statistics.median(reads):14.2f} {statistics.median(reported):12.2f} "
              f"{statistics.median(host):20.1f}")
    x = torch.randn(1 << 24, device="cuda")
    ms = [timer.call(torch.relu, [x], lambda o: timer.read_at_end(o))[1] for _ in range(args.calls)]
    print(f"relu 64 MB: reported median {statistics.median(ms) * 1e3:.2f} us, "
          f"read phase {timer.read_phase_ns / 1e3:.2f} us")


if __name__ == "__main__":
    main()
