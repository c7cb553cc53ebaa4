"""The audit rules: which ATen ops `ModelNew.forward` may run (strict), which kernels it may
launch, by origin (strict), what share of the work its own kernels must do (permissive), and
that timed calls do no foreign work beyond what the measured calls did (permissive).

Kept apart from the harness so that the evaluator applies its own copy of the rules to the op
counts and kernel records a worker reports: a candidate that rebinds the rule inside its
process changes nothing.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

# Ops ModelNew.forward may run in strict mode: allocation, views, layout copies, metadata.
STRICT_ALLOWED = frozenset(
    """empty empty_like empty_strided new_empty new_empty_strided zeros zeros_like new_zeros
    ones ones_like full full_like new_full new_ones fill_ zero_ lift_fresh detach detach_ alias view
    _unsafe_view reshape _reshape_alias as_strided permute transpose t expand expand_as squeeze
    unsqueeze slice select narrow split split_with_sizes chunk unbind unflatten flatten movedim
    contiguous clone copy_ resize_ record_stream _local_scalar_dense sym_size sym_stride
    sym_numel is_contiguous size stride dim numel""".split()
)
_TORCH_NAMESPACES = frozenset({"aten", "prims", "prim", "quantized", "torchvision", "torchaudio",
                               "_c10d_functional", "c10d", "mkldnn", "onednn", "xformers", "triton"})


# Ranges that stand for torch-generated code run inside the forward (torch.compile's kernels
# reach the device without ATen ops of their own): torch compute by another name
_TORCH_REGIONS = ("Torch-Compiled Region", "TorchDynamo")


def forbidden_ops(ops: Mapping[str, int]) -> list[str]:
    """The ops in `ops` that strict mode forbids (torch compute ops), sorted."""
    out = []
    for name in ops:
        if str(name).startswith("kernel\t"):  # kernel records travel with the op counts
            continue
        ns, _, base = name.partition("::")
        if (ns in _TORCH_NAMESPACES and base not in STRICT_ALLOWED) or name.startswith(_TORCH_REGIONS):
            out.append(name)
    return sorted(out)


def op_counts(counts: Mapping[str, int]) -> dict[str, int]:
    """The op counts among a worker's reported counts (kernel records travel with them)."""
    return {k: v for k, v in counts.items() if not str(k).startswith("kernel\t")}


# -- kernel origin (GPU) -----------------------------------------------------------------------
# torch's kernels of the allowed copy and fill ops (clone, contiguous, copy_, fill_, zeros...):
# named by torch's own code, and taken only from torch's own libraries
_TORCH_COPY_FILL = re.compile(r"FillFunctor|direct_copy_kernel_cuda|copy_device_to_device|CatArrayBatchedCopy_contig"
                              r"|float8_copy_kernel_cuda|copy_kernel_cuda|_copy_kernel\b")
_TORCH_LIBRARY = re.compile(r"^libtorch(_cuda|_cpu)?[._]")
_MEMORY_IMAGE = "<memory:"  # "<memory:DIGEST>": a module image loaded from memory (`cudagym.sandbox.origin`)


@dataclass(frozen=True)
class Origins:
    """Which origins are the candidate's: files under its build artifacts and its cached
    extensions (trusted build outputs no candidate job can write); in-memory images by digest
    (`own_images`: permissive mode's JIT kernels compiled from the candidate's own source,
    `cudagym.sandbox.jit.own_jit_images`; strict mode passes none); and the libraries its objects
    call that strict mode allows (cuBLAS, cuDNN: `cudagym.sandbox.origin.import_audit`)."""

    own_roots: tuple[str, ...]
    libraries: frozenset[str] = frozenset()
    own_images: frozenset[str] = frozenset()

    def is_own(self, origin: str) -> bool:
        if origin.startswith(_MEMORY_IMAGE) and origin.endswith(">"):
            return origin[len(_MEMORY_IMAGE):-1] in self.own_images
        if not origin.startswith("/"):
            return False
        path = os.path.realpath(origin)
        return any(path.startswith(os.path.realpath(r).rstrip("/") + "/") for r in self.own_roots if r)

    def is_allowed_library(self, origin: str) -> bool:
        return os.path.basename(origin).startswith(tuple(self.libraries)) if self.libraries else False

    def is_torch_copy(self, name: str, origin: str) -> bool:
        return bool(_TORCH_LIBRARY.match(os.path.basename(origin)) and _TORCH_COPY_FILL.search(name))


def describe_kernel(name: str, origin: str) -> str:
    where = os.path.basename(origin) if origin.startswith("/") else origin
    return f"{name[:120]} (from {where})"


def foreign_kernels(records: Iterable[Any], origins: Origins) -> list[str]:
    """Kernels strict mode forbids: neither the candidate's own, nor of a library its own code
    calls, nor torch's copies and fills; each named with its origin, most launched first."""
    bad = [r for r in records if not (origins.is_own(r.origin) or origins.is_allowed_library(r.origin)
                                      or origins.is_torch_copy(r.name, r.origin))
           and not (r.via == "graph" and r.name == "<graph launch>" and origins.is_own(r.origin))]
    bad.sort(key=lambda r: -r.launches)
    return list(dict.fromkeys(describe_kernel(r.name, r.origin) for r in bad))


def own_time_share(records: Iterable[Any], origins: Origins) -> float:
    """The candidate's own kernels' share of the GPU time of a measured call (permissive mode).

    Where the measured call's launches carry no GPU time (a launch path whose events the watcher
    could not place; seen on an H100 for kernels launched through a host stub), the share is
    taken in threads launched (grid x block, summed) instead: a coarser measure of work, but one
    the candidate cannot shrink for torch's kernels without shrinking their work."""
    records = list(records)
    total = mine = 0
    for r in records:
        if r.name == "<graph launch>":  # a graph's time: its nodes are recorded beside it, untimed
            total += r.time_ns
            mine += r.time_ns if origins.is_own(r.origin) else 0
            continue
        total += r.time_ns
        if origins.is_own(r.origin):
            mine += r.time_ns
    if total > 0:
        return mine / total
    threads = [(r.threads, origins.is_own(r.origin)) for r in records if r.name != "<graph launch>"]
    total = sum(t for t, _ in threads)
    return sum(t for t, own in threads if own) / total if total > 0 else 0.0


def unmeasured_work(measured: Mapping[str, float], measured_calls: int, timed: Mapping[str, float],
                    timed_calls: int) -> list[str]:
    """Foreign work that timed calls did beyond what the measured calls did, per call: the
    items (torch compute ops on the CPU, foreign kernels' threads on the GPU) whose mean per
    timed call exceeds their mean per measured call. A candidate that behaves one way while
    its share is measured (profiler on) and another way once timed is caught by the excess."""
    if measured_calls <= 0 or timed_calls <= 0:
        return []
    out = []
    for key, amount in timed.items():
        per_timed = amount / timed_calls
        per_measured = measured.get(key, 0) / measured_calls
        if per_timed > per_measured * 1.01 + 1e-9:
            out.append(key)
    return sorted(out)


def foreign_work(records: Iterable[Any], origins: Origins) -> dict[str, float]:
    """Threads launched per foreign kernel (torch's copies and fills and the allowed libraries
    left out), keyed by `describe_kernel`: what `unmeasured_work` compares on the GPU."""
    out: dict[str, float] = {}
    for r in records:
        if r.name == "<graph launch>" or origins.is_own(r.origin) or origins.is_torch_copy(r.name, r.origin):
            continue
        key = describe_kernel(r.name, r.origin)
        out[key] = out.get(key, 0) + max(r.threads, r.launches)
    return out
