"""The strict op-audit rule: which ATen ops `ModelNew.forward` may run.

Kept apart from the harness so that the evaluator applies its own copy of the rule to the op
counts a worker reports: a candidate that rebinds the rule inside its process changes nothing.
"""

from __future__ import annotations

from collections.abc import Mapping

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
        ns, _, base = name.partition("::")
        if (ns in _TORCH_NAMESPACES and base not in STRICT_ALLOWED) or name.startswith(_TORCH_REGIONS):
            out.append(name)
    return sorted(out)
