"""Workload estimates without a GPU: FLOPs and bytes on meta tensors, a roofline time per op.

`estimate_workload(code, gpu)` builds the task's model and inputs on the meta device (no memory,
no compute), runs one forward under a dispatch mode that sees every ATen op, and for each op
takes

    time = max(flops / (peak_flops * eff_compute), bytes / (bandwidth * eff_memory)) + launch

where `flops` come from torch's own FLOP formulas (`torch.utils.flop_counter.flop_registry`;
ops without a formula count one FLOP per output element), `bytes` are the sizes of the op's
tensor inputs and outputs (views count nothing), and the efficiencies are per op family
(`OP_EFFICIENCY`). Peak figures are dense datasheet numbers (`GPUS`); fp32 uses the plain FP32
peak because the reference runs with TF32 off. The estimate is what the workload window filter
compares against; `--calibrate` measures how far it is from real eager times.
"""

from __future__ import annotations

import types
from typing import Any

from pydantic import BaseModel, ConfigDict

from cudagym.errors import TaskError


class GpuSpec(BaseModel):
    """Dense peak throughput of one GPU model (datasheet figures, TFLOP/s and TB/s)."""

    model_config = ConfigDict(frozen=True)
    name: str
    fp32_tflops: float
    tf32_tflops: float
    bf16_tflops: float
    bandwidth_tbps: float
    memory_gib: float
    launch_us: float = 5.0  # eager launch + dispatch overhead per kernel


GPUS: dict[str, GpuSpec] = {g.name: g for g in (
    GpuSpec(name="h100", fp32_tflops=67.0, tf32_tflops=495.0, bf16_tflops=989.0, bandwidth_tbps=3.35, memory_gib=80),
    GpuSpec(name="h200", fp32_tflops=67.0, tf32_tflops=495.0, bf16_tflops=989.0, bandwidth_tbps=4.8, memory_gib=141),
    GpuSpec(name="b200", fp32_tflops=80.0, tf32_tflops=1100.0, bf16_tflops=2250.0, bandwidth_tbps=8.0, memory_gib=180),
    GpuSpec(name="a100", fp32_tflops=19.5, tf32_tflops=156.0, bf16_tflops=312.0, bandwidth_tbps=2.04, memory_gib=80),
    GpuSpec(name="l40s", fp32_tflops=91.6, tf32_tflops=183.0, bf16_tflops=362.0, bandwidth_tbps=0.864, memory_gib=48),
    GpuSpec(name="l4", fp32_tflops=30.3, tf32_tflops=60.0, bf16_tflops=121.0, bandwidth_tbps=0.3, memory_gib=24),
    GpuSpec(name="a10g", fp32_tflops=31.2, tf32_tflops=62.5, bf16_tflops=125.0, bandwidth_tbps=0.6, memory_gib=24),
    GpuSpec(name="rtx4090", fp32_tflops=82.6, tf32_tflops=82.6, bf16_tflops=165.0, bandwidth_tbps=1.01, memory_gib=24),
    GpuSpec(name="v100", fp32_tflops=15.7, tf32_tflops=15.7, bf16_tflops=125.0, bandwidth_tbps=0.9, memory_gib=32),
)}

# (compute efficiency, memory efficiency) per ATen op family; the default is DEFAULT_EFFICIENCY.
OP_EFFICIENCY: dict[str, tuple[float, float]] = {
    "mm": (0.70, 0.8), "addmm": (0.70, 0.8), "bmm": (0.65, 0.8), "baddbmm": (0.65, 0.8),
    "convolution": (0.50, 0.6), "_convolution": (0.50, 0.6),
    "_scaled_dot_product_flash_attention": (0.5, 0.6), "_scaled_dot_product_efficient_attention": (0.5, 0.6),
    "sort": (0.3, 0.25), "topk": (0.3, 0.3), "cumsum": (0.5, 0.4), "cummax": (0.5, 0.3),
    "logcumsumexp": (0.5, 0.3), "max_pool2d_with_indices": (0.5, 0.5), "max_pool3d_with_indices": (0.5, 0.4),
    "avg_pool3d": (0.5, 0.4), "native_group_norm": (0.5, 0.5), "native_batch_norm": (0.5, 0.6),
    "_native_batch_norm_legit": (0.5, 0.6), "_native_batch_norm_legit_functional": (0.5, 0.6),
    "upsample_bilinear2d": (0.5, 0.5), "gather": (0.5, 0.5), "index_select": (0.5, 0.5),
    "repeat_interleave": (0.5, 0.5),
}
DEFAULT_EFFICIENCY = (0.5, 0.75)
TRANSPOSED_CONV_FACTOR = 0.7  # transposed convolutions reach a lower share of peak


class WorkloadEstimate(BaseModel):
    """FLOPs, bytes moved and estimated eager time (ms) of one forward on `gpu`."""

    flops: int
    bytes: int
    est_ms: float
    memory_bytes: int  # inputs + parameters + twice the largest op output (eager footprint)
    kernels: int
    output_bytes: int = 0  # the forward's outputs: each verification trial sends them to the evaluator
    # the evaluator's verify footprint on one GPU: reference and candidate parameters, the inputs
    # and two clones, reference/candidate outputs plus the candidate's snapshot and a poisoned
    # buffer of the same size, and the largest intermediate twice
    verify_bytes: int = 0
    gpu: str


def gpu_spec(name: str) -> GpuSpec:
    try:
        return GPUS[name.lower()]
    except KeyError:
        raise TaskError(f"unknown target GPU {name!r}; known: {', '.join(GPUS)}") from None


def _peak_flops(gpu: GpuSpec, dtype: Any, allow_tf32: bool) -> float:
    import torch

    if dtype in (torch.float16, torch.bfloat16):
        return gpu.bf16_tflops * 1e12
    if dtype == torch.float32 and allow_tf32:
        return gpu.tf32_tflops * 1e12
    return gpu.fp32_tflops * 1e12


def load_module(code: str, name: str = "task") -> types.ModuleType:
    """Execute task source in a fresh module (trusted, generated code only)."""
    mod = types.ModuleType(f"cudagym_corpus_{name}")
    exec(compile(code, f"<{name}>", "exec"), mod.__dict__)  # noqa: S102
    return mod


def estimate_workload(code: str, gpu: GpuSpec, *, allow_tf32: bool = False) -> WorkloadEstimate:
    """Estimate the eager workload of `code` at its full sizes (see the module docstring)."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_flatten
    from torch.utils.flop_counter import flop_registry

    mod = load_module(code)
    totals = {"flops": 0, "bytes": 0, "ms": 0.0, "kernels": 0, "max_out": 0}

    class _Cost(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
            kwargs = kwargs or {}
            out = func(*args, **kwargs)
            if func.is_view or func.overloadpacket.__name__ in ("detach", "alias", "empty", "empty_like"):
                return out
            ins = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
            outs = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]
            nbytes = sum(t.numel() * t.element_size() for t in ins + outs)
            packet = func.overloadpacket
            if packet in flop_registry:
                flops = int(flop_registry[packet](*args, **kwargs, out_val=out))
            else:
                flops = sum(t.numel() for t in outs)
            dtype = outs[0].dtype if outs else torch.float32
            eff_c, eff_m = OP_EFFICIENCY.get(packet.__name__, DEFAULT_EFFICIENCY)
            if packet.__name__ in ("convolution", "_convolution") and len(args) > 6 and args[6]:
                eff_c *= TRANSPOSED_CONV_FACTOR
            t_s = max(flops / (_peak_flops(gpu, dtype, allow_tf32) * eff_c),
                      nbytes / (gpu.bandwidth_tbps * 1e12 * eff_m))
            totals["flops"] += flops
            totals["bytes"] += nbytes
            totals["ms"] += t_s * 1e3 + gpu.launch_us * 1e-3
            totals["kernels"] += 1
            totals["max_out"] = max(totals["max_out"], sum(t.numel() * t.element_size() for t in outs))
            return out

    try:
        with torch.device("meta"), torch.no_grad():
            torch.manual_seed(0)
            model = mod.Model(*mod.get_init_inputs())
            inputs = list(mod.get_inputs())
            static = sum(t.numel() * t.element_size() for t in list(model.parameters()) + list(model.buffers()))
            static += sum(t.numel() * t.element_size() for t in inputs if isinstance(t, torch.Tensor))
            with _Cost():
                result = model(*inputs)
            out_bytes = sum(t.numel() * t.element_size() for t in tree_flatten(result)[0]
                            if isinstance(t, torch.Tensor))
            params = sum(t.numel() * t.element_size() for t in list(model.parameters()) + list(model.buffers()))
    except Exception as e:  # noqa: BLE001 - any failure means the estimate is impossible
        raise TaskError(f"cannot estimate the workload: {type(e).__name__}: {e}") from None
    return WorkloadEstimate(flops=int(totals["flops"]), bytes=int(totals["bytes"]), est_ms=round(totals["ms"], 6),
                            memory_bytes=static + 2 * totals["max_out"], kernels=int(totals["kernels"]),
                            gpu=gpu.name, output_bytes=out_bytes,
                            verify_bytes=2 * params + 3 * (static - params) + 4 * out_bytes + 2 * totals["max_out"])
