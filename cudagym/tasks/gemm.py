"""The half-precision GEMM task family (CUDA-L2 style): `C = A @ B` over a spread of (M, N, K).

`gemm_configs(n, seed)` draws `n` distinct configurations, deterministically per seed, in equal
shares from five shape classes:

- ``small``: every side 64-512;
- ``skinny``: one of M or N is 1-64 (a GEMV-like batch), the others 1024-16384;
- ``square``: M = N = K, 512-8192;
- ``large``: every side 2048-16384, not square;
- ``deep``: K 8192-65536 with M, N 256-2048 (long reductions).

Each class is drawn half aligned (every side a multiple of 128) and half unaligned (at least one
side off every multiple of 8: the case cuBLAS's tensor-core paths pad or leave). Dtypes alternate
over `dtypes` (float16 and bfloat16 by default).

`gemm_tasks(configs)` writes each as a normal task (KernelBench format; `Task.source` is
`GEMM_SOURCE`). Inputs are `randn` scaled by K^-1/4, so every output element has a standard
deviation of 1 whatever K: one tolerance then fits every shape. The tolerances (`GEMM_TOLERANCE`)
allow a kernel that accumulates in fp32 in any order (and rounds once) about 10 units in the
last place of an fp16 output near 1 (5 in bf16); accumulating in half precision adds an error
that grows with K (how far it gets past these bounds is not measured yet). On the CPU target the sizes shrink to at most
64 per side (`cpu_sizes`), the same shape class.

`write_gemm_parquet(tasks, path)` stores them in the Ops-6K parquet layout that
`cudagym.tasks.loaders.load_parquet` reads (`cudagym tasks gemm` does both).
"""

from __future__ import annotations

import json
import random
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Literal

from cudagym.errors import TaskError
from cudagym.tasks.model import Task, Tolerance

GEMM_SOURCE = "cudagym-gemm"
ShapeClass = Literal["small", "skinny", "square", "large", "deep"]
SHAPE_CLASSES: tuple[ShapeClass, ...] = ("small", "skinny", "square", "large", "deep")
GEMM_DTYPES = ("float16", "bfloat16")
# fp16 has 10 mantissa bits (an ulp at 1 is ~1e-3), bf16 7 (~7.8e-3 at 1)
GEMM_TOLERANCE = {"float16": Tolerance(atol=1e-2, rtol=1e-2), "bfloat16": Tolerance(atol=4e-2, rtol=4e-2)}
CPU_MAX_SIDE = 64


@dataclass(frozen=True)
class GemmConfig:
    """One GEMM problem: C[M, N] = A[M, K] @ B[K, N] in `dtype`."""

    m: int
    n: int
    k: int
    dtype: str
    shape_class: ShapeClass
    aligned: bool

    @property
    def id(self) -> str:
        short = {"float16": "fp16", "bfloat16": "bf16"}.get(self.dtype, self.dtype)
        return f"gemm_{short}_{self.m}x{self.n}x{self.k}"


def _side(rng: random.Random, lo: int, hi: int, aligned: bool) -> int:
    """A size in [lo, hi]: a multiple of 128 if `aligned`, else any size (see `_unaligned`)."""
    if aligned:
        return rng.randint(max(lo, 128) // 128, max(hi // 128, 1)) * 128
    return rng.randint(lo, hi)


def _unaligned(rng: random.Random, sides: list[int]) -> list[int]:
    """`sides` with at least one (picked at random) moved off every multiple of 8."""
    if all(s % 8 == 0 for s in sides):
        i = rng.randrange(len(sides))
        sides[i] += rng.choice((1, 3, 5, 7)) if sides[i] > 8 else 1
    return sides


def _draw(rng: random.Random, shape_class: ShapeClass, aligned: bool) -> tuple[int, int, int]:
    s = lambda lo, hi: _side(rng, lo, hi, aligned)  # noqa: E731
    if shape_class == "small":
        m, n, k = s(64, 512), s(64, 512), s(64, 512)
    elif shape_class == "skinny":
        thin = rng.randint(1, 64) if not aligned else rng.choice((16, 32, 64))
        wide, k = s(1024, 16384), s(1024, 16384)
        m, n = (thin, wide) if rng.random() < 0.5 else (wide, thin)
    elif shape_class == "square":
        m = n = k = s(512, 8192)
    elif shape_class == "large":
        m, n, k = s(2048, 16384), s(2048, 16384), s(2048, 16384)
        if m == n == k:
            k += 128
    else:  # deep
        m, n, k = s(256, 2048), s(256, 2048), s(8192, 65536)
    if not aligned:
        if shape_class == "square":
            m = n = k = _unaligned(rng, [m])[0]
        else:
            m, n, k = _unaligned(rng, [m, n, k])
    return m, n, k


def gemm_configs(n: int, seed: int = 0, dtypes: tuple[str, ...] = GEMM_DTYPES) -> list[GemmConfig]:
    """`n` distinct GEMM configurations (see the module's text); the same for the same arguments."""
    if n < 1:
        raise TaskError("the GEMM family needs at least one configuration")
    bad = [d for d in dtypes if d not in GEMM_TOLERANCE]
    if not dtypes or bad:
        raise TaskError(f"GEMM dtypes must be among {', '.join(GEMM_TOLERANCE)} (got {', '.join(dtypes) or 'none'})")
    rng = random.Random(f"cudagym-gemm:{seed}")
    out: list[GemmConfig] = []
    seen: set[tuple[int, int, int, str]] = set()
    tries = 0
    while len(out) < n:
        tries += 1
        if tries > 100 * n + 1000:
            raise TaskError(f"could not draw {n} distinct GEMM configurations")
        i = len(out)
        shape_class = SHAPE_CLASSES[i % len(SHAPE_CLASSES)]
        aligned = (i // len(SHAPE_CLASSES)) % 2 == 0
        dtype = dtypes[(i // (2 * len(SHAPE_CLASSES))) % len(dtypes)]
        m, nn, k = _draw(rng, shape_class, aligned)
        if (m, nn, k, dtype) in seen:
            continue
        seen.add((m, nn, k, dtype))
        out.append(GemmConfig(m, nn, k, dtype, shape_class, aligned))
    return out


def _cpu_side(side: int, aligned: bool) -> int:
    """A side of at most `CPU_MAX_SIDE` that keeps its alignment class (thin sides stay thin)."""
    if side <= 16:
        return side
    small = min(CPU_MAX_SIDE, max(16, side // 64))
    return small - small % 8 if aligned else small - 1 + small % 2  # odd: off every multiple of 8


def gemm_source(c: GemmConfig) -> str:
    """The task's KernelBench-format source."""
    return f'''import torch
import torch.nn as nn

M = {c.m}
N = {c.n}
K = {c.k}


class Model(nn.Module):
    """C = A @ B in {c.dtype} ({c.shape_class}, {"aligned" if c.aligned else "unaligned"})."""

    def forward(self, A, B):
        return torch.matmul(A, B)


def get_inputs():
    # scaled so that every element of C has a standard deviation of 1, whatever K
    scale = K ** -0.25
    A = torch.randn(M, K) * scale
    B = torch.randn(K, N) * scale
    return [A.to(torch.{c.dtype}), B.to(torch.{c.dtype})]


def get_init_inputs():
    return []
'''


def gemm_task(c: GemmConfig) -> Task:
    """The configuration as a validated `Task`."""
    cpu: dict[str, int | float] = {"M": _cpu_side(c.m, c.aligned), "N": _cpu_side(c.n, c.aligned),
                                   "K": _cpu_side(c.k, c.aligned)}
    task = Task(id=c.id, code=gemm_source(c), source=GEMM_SOURCE, ops=["matmul"], dtype=c.dtype,
                tolerance=GEMM_TOLERANCE[c.dtype], cpu_sizes=cpu,
                metadata={"shape_class": c.shape_class, "aligned": c.aligned, "m": c.m, "n": c.n, "k": c.k})
    task.validate_source()
    return task


def gemm_tasks(configs: list[GemmConfig]) -> list[Task]:
    return [gemm_task(c) for c in configs]


def write_gemm_parquet(tasks: list[Task], path: Path) -> Path:
    """The tasks as an Ops-6K-layout parquet file (written whole, then renamed into place)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = [{"id": t.id, "ops": list(t.ops), "data_source": t.source, "code": t.code, "dtype": t.dtype,
             "atol": t.effective_tolerance.atol, "rtol": t.effective_tolerance.rtol,
             "cpu_sizes": json.dumps(t.cpu_sizes),
             **{k: t.metadata[k] for k in ("shape_class", "aligned", "m", "n", "k")}}
            for t in tasks]
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    pq.write_table(pa.Table.from_pylist(rows), tmp)
    tmp.replace(path)
    return path


def config_rows(configs: list[GemmConfig]) -> list[dict[str, object]]:
    """The configurations as plain rows (for a summary file or a table)."""
    return [{"id": c.id, **asdict(c)} for c in configs]
