"""Why a convolution-heavy model's eager baseline reads above KernelBench's numbers: TF32.

cudagym's harness pins `torch.backends.cudnn.allow_tf32` (and the matmul flag) off in every job,
so that the reference is computed in full float32 (REWARD_HACKING.md, #7) and the eager and
torch.compile baselines run the same arithmetic as the reference. Stock PyTorch leaves cuDNN's
TF32 on by default (`torch.backends.cudnn.allow_tf32 = True`; the matmul flag defaults off), and
so does a KernelBench-style harness: its convolutions, and cuDNN's RNNs, run on TF32 tensor
cores there.

This probe times the eager forward of KernelBench-format files in one plain process (no cudagym
harness), with Triton's `do_bench` (median, L2 flushed) and with CUDA events around each call
plus a synchronize (KernelBench's way), once with each setting of the two flags.

Usage: python benchmarks/probe_tf32_baseline.py FILE.py [FILE.py ...]   (needs a GPU and triton)
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
from pathlib import Path
from typing import Any

from timing_driver import events_ms  # this folder's module


def load(path: Path) -> Any:
    spec = importlib.util.spec_from_file_location(path.stem, path)
    if spec is None or spec.loader is None:
        raise SystemExit(f"{path}: not a Python file")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def time_file(path: Path) -> dict[str, float]:
    """do_bench and events medians of one file's eager forward, TF32 off and on (ms)."""
    import torch
    from triton.testing import do_bench

    mod = load(path)
    torch.manual_seed(0)
    model = mod.Model(*mod.get_init_inputs()).cuda()
    inputs = [x.cuda() if isinstance(x, torch.Tensor) else x for x in mod.get_inputs()]

    def call() -> None:
        with torch.no_grad():
            model(*inputs)

    row: dict[str, float] = {}
    for tf32 in (False, True):
        torch.backends.cudnn.allow_tf32 = tf32
        torch.backends.cuda.matmul.allow_tf32 = False  # torch's default either way
        call()
        torch.cuda.synchronize()
        row[f"bench{tf32}"] = float(do_bench(call, return_mode="median"))
        row[f"events{tf32}"] = statistics.median(events_ms(call, 50))
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("files", nargs="+", type=Path)
    args = ap.parse_args()
    import torch
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"eager forward, {torch.cuda.get_device_name()} (ms; TF32 off is cudagym's setting)")
    for c in ("problem", "do_bench TF32 off", "do_bench TF32 on (torch default)", "off/on",
              "events TF32 off", "events TF32 on"):
        table.add_column(c)
    for path in args.files:
        row = time_file(path)
        table.add_row(path.stem, f"{row['benchFalse']:.3f}", f"{row['benchTrue']:.3f}",
                      f"{row['benchFalse'] / row['benchTrue']:.2f}x", f"{row['eventsFalse']:.3f}",
                      f"{row['eventsTrue']:.3f}")
        torch.cuda.empty_cache()
    Console().print(table)


if __name__ == "__main__":
    main()
