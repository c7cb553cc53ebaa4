"""The problems of the timing-fidelity benchmark (`bench_baselines.py`), in KernelBench format.

Each problem is Python source defining `class Model(nn.Module)`, `get_inputs()` and
`get_init_inputs()`, as a KernelBench file does: inputs come from plain `torch.randn(...)` on
the host's default device, and whoever runs the problem moves them (and the model) to its
device. Sizes are module-level constants; `cpu_sizes` shrinks them for the CPU target and the
unit test.

Together the problems span 3 µs (one launch of a tiny kernel: about the least a kernel takes)
to 9 ms of GPU time per forward call on an H100, L2 flushed: single elementwise ops at several
sizes, reductions, normalizations, matrix products, convolutions, chains of 2-4 ops, small
multi-layer models, and float16 cases.
`expected_us` is the GPU time per call that Nsight Compute measured on an H100 (80GB HBM3,
torch 2.11: the sum of a call's kernels' gpu__time_duration, median of 20 calls, 2026-11; no
kernel measured under 2.6 µs there); `time_class` is its class: tiny < 10 µs, small 10-100 µs,
medium 0.1-1 ms, large > 1 ms.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Literal

from cudagym.tasks.model import Task

TimeClass = Literal["tiny", "small", "medium", "large"]
CLASS_BOUNDS_US: dict[TimeClass, tuple[float, float]] = {
    "tiny": (0.0, 10.0), "small": (10.0, 100.0), "medium": (100.0, 1000.0), "large": (1000.0, float("inf")),
}


def time_class(us: float) -> TimeClass:
    """The class a GPU time per call (µs) falls in."""
    return next(c for c, (lo, hi) in CLASS_BOUNDS_US.items() if lo <= us < hi)


@dataclass(frozen=True)
class TimingProblem:
    """One benchmark problem: KernelBench-format source plus what the benchmark needs to know."""

    name: str
    source: str
    expected_us: float  # GPU time per forward call on an H100 (see the module's text)
    dtype: str = "float32"
    cpu_sizes: dict[str, int] = field(default_factory=dict)

    @property
    def time_class(self) -> TimeClass:
        return time_class(self.expected_us)

    def task(self) -> Task:
        """The problem as a cudagym `Task` (validated; its CPU sizes apply on the CPU target)."""
        task = Task(id=self.name, code=self.source, source="timing-benchmark", dtype=self.dtype,
                    cpu_sizes=self.cpu_sizes)
        task.validate_source()
        return task


def candidate_source(reference: str) -> str:
    """A `model_new.py` that runs exactly the reference's torch ops: `Model` renamed `ModelNew`
    everywhere (the class and its `super(Model, self)` call)."""
    return re.sub(r"\bModel\b", "ModelNew", reference)


_HEADER = "import torch\nimport torch.nn as nn\nimport torch.nn.functional as F\n"


def _consts(**sizes: int) -> str:
    return "".join(f"{k} = {v}\n" for k, v in sizes.items())


def _unary(expr: str, rows: int, cols: int, dtype: str = "float32") -> str:
    """An elementwise op of one (ROWS, COLS) input `x`, written as the expression `expr`."""
    dt = "" if dtype == "float32" else f", dtype=torch.{dtype}"
    return f'''{_HEADER}
{_consts(ROWS=rows, COLS=cols)}

class Model(nn.Module):
    def __init__(self):
        super(Model, self).__init__()

    def forward(self, x):
        return {expr}


def get_inputs():
    return [torch.randn(ROWS, COLS{dt})]


def get_init_inputs():
    return []
'''


def _matmul(n: int, dtype: str = "float32") -> str:
    dt = "" if dtype == "float32" else f", dtype=torch.{dtype}"
    return f'''{_HEADER}
{_consts(N=n)}

class Model(nn.Module):
    """C = A @ B for square (N, N) matrices."""

    def __init__(self):
        super(Model, self).__init__()

    def forward(self, a, b):
        return torch.matmul(a, b)


def get_inputs():
    return [torch.randn(N, N{dt}), torch.randn(N, N{dt})]


def get_init_inputs():
    return []
'''


def _conv2d(batch: int, cin: int, cout: int, size: int) -> str:
    return f'''{_HEADER}
{_consts(BATCH=batch, IN_CH=cin, OUT_CH=cout, SIZE=size)}

class Model(nn.Module):
    """A 3x3 convolution with padding 1 and a bias."""

    def __init__(self, in_ch, out_ch):
        super(Model, self).__init__()
        self.conv = nn.Conv2d(in_ch, out_ch, kernel_size=3, padding=1)

    def forward(self, x):
        return self.conv(x)


def get_inputs():
    return [torch.randn(BATCH, IN_CH, SIZE, SIZE)]


def get_init_inputs():
    return [IN_CH, OUT_CH]
'''


_SCALE_BIAS_GELU = f'''{_HEADER}
{_consts(ROWS=4096, COLS=4096)}

class Model(nn.Module):
    """gelu(x * scale + bias): three elementwise kernels in eager mode."""

    def __init__(self, cols, scale):
        super(Model, self).__init__()
        self.scale = scale
        self.bias = nn.Parameter(torch.randn(cols))

    def forward(self, x):
        return F.gelu(x * self.scale + self.bias)


def get_inputs():
    return [torch.randn(ROWS, COLS)]


def get_init_inputs():
    return [COLS, 1.7]
'''

_ADD_RELU_SCALE = f'''{_HEADER}
{_consts(ROWS=16, COLS=1024)}

class Model(nn.Module):
    """relu(x + y) * 0.5 on small tensors: three launch-bound kernels."""

    def __init__(self):
        super(Model, self).__init__()

    def forward(self, x, y):
        return torch.relu(x + y) * 0.5


def get_inputs():
    return [torch.randn(ROWS, COLS), torch.randn(ROWS, COLS)]


def get_init_inputs():
    return []
'''

_GEMM_BIAS_RELU = f'''{_HEADER}
{_consts(BATCH=1024, IN_FEATURES=4096, OUT_FEATURES=4096)}

class Model(nn.Module):
    """relu(x @ W^T + b)."""

    def __init__(self, in_features, out_features):
        super(Model, self).__init__()
        self.linear = nn.Linear(in_features, out_features)

    def forward(self, x):
        return torch.relu(self.linear(x))


def get_inputs():
    return [torch.randn(BATCH, IN_FEATURES)]


def get_init_inputs():
    return [IN_FEATURES, OUT_FEATURES]
'''

_CONV_BN_RELU = f'''{_HEADER}
{_consts(BATCH=32, IN_CH=32, OUT_CH=64, SIZE=64)}

class Model(nn.Module):
    """relu(batchnorm(conv3x3(x))), batch norm in training mode (batch statistics)."""

    def __init__(self, in_ch, out_ch):
        super(Model, self).__init__()
        self.conv = nn.Conv2d(in_ch, out_ch, kernel_size=3, padding=1, bias=False)
        self.bn = nn.BatchNorm2d(out_ch)

    def forward(self, x):
        return torch.relu(self.bn(self.conv(x)))


def get_inputs():
    return [torch.randn(BATCH, IN_CH, SIZE, SIZE)]


def get_init_inputs():
    return [IN_CH, OUT_CH]
'''

_MLP = '''{header}
{consts}

class Model(nn.Module):
    """Three linear layers with ReLU between them."""

    def __init__(self, in_features, hidden, out_features):
        super(Model, self).__init__()
        self.net = nn.Sequential(
            nn.Linear(in_features, hidden), nn.ReLU(),
            nn.Linear(hidden, hidden), nn.ReLU(),
            nn.Linear(hidden, out_features),
        )

    def forward(self, x):
        return self.net(x)


def get_inputs():
    return [torch.randn(BATCH, IN_FEATURES)]


def get_init_inputs():
    return [IN_FEATURES, HIDDEN, OUT_FEATURES]
'''

_RESBLOCK = f'''{_HEADER}
{_consts(BATCH=8, CHANNELS=64, SIZE=56)}

class Model(nn.Module):
    """A ResNet basic block: relu(x + bn(conv(relu(bn(conv(x)))))), training-mode batch norm."""

    def __init__(self, channels):
        super(Model, self).__init__()
        self.conv1 = nn.Conv2d(channels, channels, kernel_size=3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(channels)
        self.conv2 = nn.Conv2d(channels, channels, kernel_size=3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(channels)

    def forward(self, x):
        h = torch.relu(self.bn1(self.conv1(x)))
        return torch.relu(x + self.bn2(self.conv2(h)))


def get_inputs():
    return [torch.randn(BATCH, CHANNELS, SIZE, SIZE)]


def get_init_inputs():
    return [CHANNELS]
'''

_MLP_NORM = f'''{_HEADER}
{_consts(BATCH=512, DIM=1024, HIDDEN=4096)}

class Model(nn.Module):
    """A transformer MLP: LayerNorm, Linear up, GELU, Linear down, plus the residual."""

    def __init__(self, dim, hidden):
        super(Model, self).__init__()
        self.norm = nn.LayerNorm(dim)
        self.up = nn.Linear(dim, hidden)
        self.down = nn.Linear(hidden, dim)

    def forward(self, x):
        return x + self.down(F.gelu(self.up(self.norm(x))))


def get_inputs():
    return [torch.randn(BATCH, DIM)]


def get_init_inputs():
    return [DIM, HIDDEN]
'''

_ATTENTION = f'''{_HEADER}
{_consts(BATCH=4, SEQ=256, DIM=512, HEADS=8)}

class Model(nn.Module):
    """A pre-norm self-attention block: LayerNorm, one QKV projection, scaled dot-product
    attention over HEADS heads, the output projection, plus the residual."""

    def __init__(self, dim, heads):
        super(Model, self).__init__()
        self.heads = heads
        self.norm = nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x):
        b, s, d = x.shape
        q, k, v = self.qkv(self.norm(x)).view(b, s, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        h = F.scaled_dot_product_attention(q, k, v)
        return x + self.proj(h.transpose(1, 2).reshape(b, s, d))


def get_inputs():
    return [torch.randn(BATCH, SEQ, DIM)]


def get_init_inputs():
    return [DIM, HEADS]
'''

_LAYERNORM = f'''{_HEADER}
{_consts(ROWS=4096, COLS=4096)}

class Model(nn.Module):
    """LayerNorm over the last dimension, with its affine weight and bias."""

    def __init__(self, cols):
        super(Model, self).__init__()
        self.norm = nn.LayerNorm(cols)

    def forward(self, x):
        return self.norm(x)


def get_inputs():
    return [torch.randn(ROWS, COLS)]


def get_init_inputs():
    return [COLS]
'''

PROBLEMS: tuple[TimingProblem, ...] = (
    # single elementwise ops
    TimingProblem("relu_1x1024", _unary("torch.relu(x)", 1, 1024), 2.8),
    TimingProblem("relu_16x16384", _unary("torch.relu(x)", 16, 16384), 3.3),
    TimingProblem("hardtanh_16x16384", _unary("F.hardtanh(x, min_val=-0.5, max_val=0.5)", 16, 16384), 3.3),
    TimingProblem("sigmoid_fp16_16x16384", _unary("torch.sigmoid(x)", 16, 16384, "float16"), 3.6,
                  dtype="float16"),
    TimingProblem("relu_512x16384", _unary("torch.relu(x)", 512, 16384), 20, cpu_sizes={"ROWS": 16}),
    TimingProblem("gelu_fp16_4096x4096", _unary("F.gelu(x)", 4096, 4096, "float16"), 24, dtype="float16",
                  cpu_sizes={"ROWS": 64, "COLS": 512}),
    TimingProblem("relu_4096x16384", _unary("torch.relu(x)", 4096, 16384), 174, cpu_sizes={"ROWS": 64}),
    TimingProblem("transpose_4096x4096", _unary("x.t().contiguous()", 4096, 4096), 139,
                  cpu_sizes={"ROWS": 256, "COLS": 512}),
    # normalizations and reductions
    TimingProblem("softmax_16x16384", _unary("torch.softmax(x, dim=1)", 16, 16384), 8.6),
    TimingProblem("layernorm_4096x4096", _LAYERNORM, 62, cpu_sizes={"ROWS": 64, "COLS": 1024}),
    TimingProblem("sum_16x16384", _unary("torch.sum(x, dim=1)", 16, 16384), 7.3),
    TimingProblem("mean_8192x8192", _unary("torch.mean(x, dim=1)", 8192, 8192), 94,
                  cpu_sizes={"ROWS": 256, "COLS": 1024}),
    # matrix products and convolutions (float32 without TF32: the harness pins TF32 off)
    TimingProblem("matmul_256", _matmul(256), 12),
    TimingProblem("matmul_fp16_4096", _matmul(4096, "float16"), 180, dtype="float16", cpu_sizes={"N": 128}),
    TimingProblem("matmul_6144", _matmul(6144), 9080, cpu_sizes={"N": 128}),
    TimingProblem("conv2d_16x64x56", _conv2d(16, 64, 128, 56), 273,
                  cpu_sizes={"BATCH": 1, "IN_CH": 8, "OUT_CH": 8, "SIZE": 16}),
    TimingProblem("conv2d_32x128x56", _conv2d(32, 128, 256, 56), 1460,
                  cpu_sizes={"BATCH": 1, "IN_CH": 8, "OUT_CH": 8, "SIZE": 16}),
    # chains of 2-4 ops
    TimingProblem("add_relu_scale_16x1024", _ADD_RELU_SCALE, 8.8),
    TimingProblem("scale_bias_gelu_4096x4096", _SCALE_BIAS_GELU, 138, cpu_sizes={"ROWS": 64, "COLS": 1024}),
    TimingProblem("gemm_bias_relu_1024x4096", _GEMM_BIAS_RELU, 688,
                  cpu_sizes={"BATCH": 16, "IN_FEATURES": 256, "OUT_FEATURES": 256}),
    TimingProblem("conv_bn_relu_32x32x64", _CONV_BN_RELU, 234,
                  cpu_sizes={"BATCH": 2, "IN_CH": 4, "OUT_CH": 8, "SIZE": 16}),
    # small multi-layer models
    TimingProblem("mlp_tiny_b8", _MLP.format(header=_HEADER, consts=_consts(BATCH=8, IN_FEATURES=256, HIDDEN=512,
                                                                            OUT_FEATURES=10)), 28),
    TimingProblem("mlp_b256", _MLP.format(header=_HEADER, consts=_consts(BATCH=256, IN_FEATURES=1024, HIDDEN=4096,
                                                                         OUT_FEATURES=1024)), 401,
                  cpu_sizes={"BATCH": 8, "IN_FEATURES": 64, "HIDDEN": 128, "OUT_FEATURES": 32}),
    TimingProblem("resblock_8x64x56", _RESBLOCK, 192, cpu_sizes={"BATCH": 1, "CHANNELS": 8, "SIZE": 16}),
    # level 2-3 style blocks (measured like the rest: nvidia-h100-x1, 2026-11-26)
    TimingProblem("mlp_norm_b512", _MLP_NORM, 291, cpu_sizes={"BATCH": 8, "DIM": 64, "HIDDEN": 256}),
    TimingProblem("attention_b4x256x512", _ATTENTION, 118, cpu_sizes={"BATCH": 1, "SEQ": 16, "DIM": 64, "HEADS": 4}),
)


def problems_by_name(names: list[str] | None = None) -> list[TimingProblem]:
    """The named problems in the given order (all of them for None); unknown names raise KeyError."""
    if names is None:
        return list(PROBLEMS)
    index = {p.name: p for p in PROBLEMS}
    unknown = [n for n in names if n not in index]
    if unknown:
        raise KeyError(f"unknown problem(s) {unknown}; known: {', '.join(index)}")
    return [index[n] for n in names]
