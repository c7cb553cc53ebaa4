"""The composer: chains 1–5 seed operators into one KernelBench-format task.

Every chain is drawn from a `random.Random` seeded by ``f"{seed}:{index}"`` (string seeds hash
with SHA-512, so they are stable across runs and Python versions): the same seed and index
always give the same source text.

Shapes are tracked at two problem sizes at once: the *full* sizes written into the source (for
the target GPU) and the *small* sizes of `Task.cpu_sizes` (used to run the CPU checks quickly).
Only the batch and the spatial/sequence extents differ between the two (`Dim.full != Dim.small`);
channels, features and every constructor argument are the same at both. A constructor argument
can therefore only come from a fixed dim, which keeps every task valid at both sizes. After each
op the composer executes the new `__init__`/`forward` lines on meta tensors at both sizes; an op
that fails is rolled back and another one is drawn.
"""

from __future__ import annotations

import random
import re
from typing import Any

from pydantic import BaseModel, Field

from cudagym.tasks.corpus.catalog import BLOCK_SOURCES, Catalog, OpSpec, default_catalog
from cudagym.tasks.corpus.emit import Dim, EmitContext, InputArg, Reject, State

# Ops-6K's mix: about 84% of tasks chain two operators.
DEFAULT_OP_COUNT_WEIGHTS: dict[int, float] = {1: 0.04, 2: 0.84, 3: 0.08, 4: 0.03, 5: 0.01}


class ComposerConfig(BaseModel):
    """How chains are drawn."""

    op_count_weights: dict[int, float] = Field(default_factory=lambda: dict(DEFAULT_OP_COUNT_WEIGHTS))
    dtype: str = "float32"
    max_attempts_per_op: int = 24
    max_chain_attempts: int = 8


class ComposedTask(BaseModel):
    """One composed chain: its source, op names and sizes."""

    index: int
    ops: list[str]
    code: str
    cpu_sizes: dict[str, int]


# -- start layouts --------------------------------------------------------------------------
def _start(ctx: EmitContext, layout: str, n_ops: int) -> State:
    r = ctx.rng
    big_spatial = n_ops > 2  # longer chains shrink more, so start the small size larger

    def _batch(options: list[int]) -> Dim:
        v = r.choice(options)
        return Dim(v, 2, ctx.scaled("batch", v, 2))

    def fixed(base: str, options: list[int]) -> Dim:
        v = r.choice(options)
        return Dim(v, v, ctx.const(base, v))

    def spatial(base: str, options: list[int], small: int) -> Dim:
        v = r.choice(options)
        return Dim(v, small, ctx.scaled(base, v, small))

    dims: tuple[Dim, ...]
    if layout == "features":
        dims = (_batch([128, 256, 512, 1024, 2048]), fixed("features", [256, 512, 1024, 2048, 4096]))
    elif layout == "seq":
        dims = (_batch([4, 8, 16, 32]), spatial("seq_len", [128, 256, 512, 1024, 2048], 16 if big_spatial else 8),
                fixed("dim", [256, 512, 768, 1024]))
    elif layout == "tokens":
        dims = (_batch([8, 16, 32, 64]), spatial("seq_len", [128, 256, 512, 1024], 8))
    elif layout == "image1d":
        dims = (_batch([16, 32, 64, 128]), fixed("in_channels", [3, 8, 16, 32, 64]),
                spatial("length", [1024, 2048, 4096, 8192, 16384], 64 if big_spatial else 32))
    elif layout == "image2d":
        hw = r.choice([64, 128, 256, 512])
        small = 32 if big_spatial else 16
        dims = (_batch([8, 16, 32, 64]), fixed("in_channels", [3, 8, 16, 32, 64]),
                Dim(hw, small, ctx.scaled("height", hw, small)), Dim(hw, small, ctx.scaled("width", hw, small)))
    elif layout == "image3d":
        d = r.choice([16, 32, 64])
        hw = r.choice([32, 64, 128])
        small = 16 if big_spatial else 8
        dims = (_batch([2, 4, 8, 16]), fixed("in_channels", [3, 8, 16]), Dim(d, small, ctx.scaled("depth", d, small)),
                Dim(hw, small, ctx.scaled("height", hw, small)), Dim(hw, small, ctx.scaled("width", hw, small)))
    else:
        raise ValueError(f"unknown layout {layout}")
    if layout == "tokens":
        vocab = fixed("vocab_size", [1000, 8000, 32000])
        ctx.inputs.append(InputArg("x", [d.name for d in dims], "randint", vocab.name))  # type: ignore[misc]
        return State(dims, integer=True)
    ctx.inputs.append(InputArg("x", [d.name for d in dims]))  # type: ignore[misc]
    return State(dims)


# -- meta execution -------------------------------------------------------------------------
class _MetaRunner:
    """Executes emitted lines on meta tensors at one size (full or small)."""

    def __init__(self, which: int, base_ns: dict) -> None:
        import torch.nn as nn

        self.which = which  # 0: full, 1: small
        self.mod = nn.Module()
        self.ns = dict(base_ns, self=self.mod)

    def run(self, ctx: EmitContext, n_init: int, n_fwd: int, n_inputs: int, x: Any) -> tuple[Any, dict[str, Any]]:
        import torch

        ns = dict(self.ns)
        ns.update({k.lower(): v[self.which] for k, v in ctx.consts.items()})
        ns["x"] = x
        with torch.device("meta"):
            for line in ctx.init_lines[n_init:]:
                exec(line, ns)  # noqa: S102
            for arg in ctx.inputs[n_inputs:]:
                shape = [ctx.consts[d][self.which] for d in arg.dims]
                ns[arg.name] = (torch.zeros(shape, dtype=torch.long) if arg.kind == "randint"
                                else torch.empty(shape))
            for line in ctx.fwd_lines[n_fwd:]:
                exec(line, ns)  # noqa: S102
        out = ns["x"]
        if not isinstance(out, torch.Tensor):
            raise Reject("forward produced a non-tensor")
        return out, {a.name: ns[a.name] for a in ctx.inputs[n_inputs:]}


def _block_namespace() -> dict:
    """torch, nn, F, math and the helper block classes, for executing emitted lines."""
    import math

    import torch
    import torch.nn as nn
    import torch.nn.functional as F

    ns: dict = {"torch": torch, "nn": nn, "F": F, "math": math}
    for name, src in BLOCK_SOURCES.items():
        exec(compile(src, f"<block {name}>", "exec"), ns)  # noqa: S102 - our own source
    return ns


def _next_state(ctx: EmitContext, before: State, full, small, new_consts: list[str]) -> State:  # noqa: ANN001
    dims = []
    for i, (f, s) in enumerate(zip(full.shape, small.shape)):
        name = None
        if i < before.rank and (before.dims[i].full, before.dims[i].small) == (f, s):
            name = before.dims[i].name
        if name is None:
            for c in new_consts:
                if ctx.consts[c] == (f, s):
                    name = c
                    break
        if name is None and f != s:
            for c, v in ctx.consts.items():
                if v == (f, s):
                    name = c
                    break
        dims.append(Dim(int(f), int(s), name))
    integer = not (full.is_floating_point())
    return State(tuple(dims), integer)


# -- composing ------------------------------------------------------------------------------
class Composer:
    """Draws chains from a catalog; `compose(seed, index)` is a pure function of its arguments."""

    def __init__(self, config: ComposerConfig | None = None, catalog: Catalog | None = None) -> None:
        self.config = config or ComposerConfig()
        self.catalog = catalog or default_catalog()
        self.ops = [o for o in self.catalog.ops if self.config.dtype in o.dtypes]
        self._base_ns = _block_namespace()

    def _op_count(self, rng: random.Random) -> int:
        ks = sorted(self.config.op_count_weights)
        return rng.choices(ks, weights=[self.config.op_count_weights[k] for k in ks])[0]

    def compose(self, seed: int, index: int) -> ComposedTask | None:
        """The task at `index` of the stream for `seed`, or None if no chain could be built."""
        for attempt in range(self.config.max_chain_attempts):
            rng = random.Random(f"cudagym-ops:{seed}:{index}:{attempt}")
            task = self._try(rng, index)
            if task is not None:
                return task
        return None

    def _try(self, rng: random.Random, index: int) -> ComposedTask | None:
        import torch

        n_ops = self._op_count(rng)
        ctx = EmitContext(rng)
        first = self._pick(rng, [o for o in self.ops if not (n_ops > 1 and o.terminal)])
        layout = rng.choice(first.starts)
        state = _start(ctx, layout, n_ops)
        runners = (_MetaRunner(0, self._base_ns), _MetaRunner(1, self._base_ns))
        xs = []
        for r, w in zip(runners, (0, 1)):
            arg = ctx.inputs[0]
            shape = [ctx.consts[d][w] for d in arg.dims]
            xs.append(torch.zeros(shape, dtype=torch.long, device="meta") if state.integer
                      else torch.empty(shape, device="meta"))
        ops: list[str] = []
        for pos in range(n_ops):
            last = pos == n_ops - 1
            if pos == 0:
                candidates = [first]
            else:
                candidates = [o for o in self.ops if state.rank in o.ranks and (last or not o.terminal)
                              and o.name != "nn.Embedding"]
            placed = False
            for _ in range(self.config.max_attempts_per_op):
                if not candidates:
                    break
                op = candidates[0] if pos == 0 else self._pick(rng, candidates)
                snap = ctx.snapshot()
                counts = (len(ctx.init_lines), len(ctx.fwd_lines), len(ctx.inputs))
                consts_before = set(ctx.consts)
                try:
                    if state.integer and op.name != "nn.Embedding":
                        raise Reject("integer input")
                    if op.name == "nn.Embedding":
                        self._embedding(ctx, state)
                    elif state.rank not in op.ranks:
                        raise Reject("rank")
                    else:
                        op.sample(ctx, state)
                    outs = [r.run(ctx, *counts, x) for r, x in zip(runners, xs)]
                    full, small = outs[0][0], outs[1][0]
                    if full.numel() == 0 or small.numel() == 0 or (full.dim() == 0 and not last):
                        raise Reject("empty or scalar output")
                    if full.dim() != small.dim():
                        raise Reject("rank differs between sizes")
                    if pos < n_ops - 1 and (full.dim() < 2 or full.dim() > 5):
                        raise Reject("intermediate rank out of range")
                    if not full.is_floating_point():
                        raise Reject("integer output")
                except Reject:
                    ctx.restore(snap)
                    if pos == 0:
                        return None
                    continue
                except Exception:  # noqa: BLE001 - a shape error of a drawn op: draw another
                    ctx.restore(snap)
                    if pos == 0:
                        return None
                    continue
                new_consts = [c for c in ctx.consts if c not in consts_before]
                state = _next_state(ctx, state, full, small, new_consts) if full.dim() > 0 else State(())
                xs = [full, small]
                ops.append(op.name)
                placed = True
                break
            if not placed:
                return None
            if state.rank == 0 and pos < n_ops - 1:
                return None
        return ComposedTask(index=index, ops=ops, code=render(ctx, ops),
                            cpu_sizes={k: v[1] for k, v in ctx.consts.items() if v[0] != v[1]})

    @staticmethod
    def _pick(rng: random.Random, ops: list[OpSpec]) -> OpSpec:
        return rng.choices(ops, weights=[o.weight for o in ops])[0]

    @staticmethod
    def _embedding(ctx: EmitContext, state: State) -> None:
        if not state.integer:
            raise Reject("embedding takes token ids")
        vocab = ctx.inputs[0].high
        assert vocab is not None  # noqa: S101 - integer inputs carry their class count
        dim = ctx.size("embedding_dim", ctx.rng.choice([256, 512, 768, 1024]))
        a = ctx.attr("embedding")
        ctx.init(f"self.{a} = nn.Embedding({vocab.lower()}, {dim})")
        ctx.fwd(f"x = self.{a}(x)")


# -- rendering ------------------------------------------------------------------------------
def _short(op: str) -> str:
    return op.split(".", 1)[-1]


def render(ctx: EmitContext, ops: list[str]) -> str:
    """KernelBench-format source for an emitted chain."""
    init_src = "\n".join(ctx.init_lines)
    used = [n for n in ctx.consts if ctx.consts[n][0] == ctx.consts[n][1]
            and re.search(rf"\b{n.lower()}\b", init_src)]
    uses_math = any("math." in BLOCK_SOURCES[h] for h in ctx.helpers)
    lines = ['"""' + " -> ".join(_short(o) for o in ops) + '."""', ""]
    if uses_math:
        lines.append("import math")
        lines.append("")
    lines += ["import torch", "import torch.nn as nn", "import torch.nn.functional as F", ""]
    lines += [f"{n} = {v[0]}" for n, v in ctx.consts.items()]
    lines.append("")
    for h in ctx.helpers:
        lines += ["", BLOCK_SOURCES[h].strip("\n"), ""]
    lines += ["", "class Model(nn.Module):"]
    lines.append(f"    def __init__(self{''.join(', ' + n.lower() for n in used)}):")
    lines.append("        super().__init__()")
    lines += [f"        {ln}" for ln in ctx.init_lines]
    lines.append("")
    lines.append(f"    def forward(self{''.join(', ' + a.name for a in ctx.inputs)}):")
    lines += [f"        {ln}" for ln in ctx.fwd_lines]
    lines.append("        return x")
    lines += ["", "", "def get_inputs():"]
    for a in ctx.inputs:
        shape = ", ".join(a.dims)
        if len(a.dims) == 1:
            shape += ","
        if a.kind == "randint":
            expr = f"torch.randint(0, {a.high}, ({shape}))"
        elif a.kind == "rand":
            expr = f"torch.rand({shape.rstrip(',')})"
        elif a.kind == "sign":
            expr = f"torch.randn({shape.rstrip(',')}).sign()"
        else:
            expr = f"torch.randn({shape.rstrip(',')})"
        lines.append(f"    {a.name} = {expr}")
    lines.append(f"    return [{', '.join(a.name for a in ctx.inputs)}]")
    lines += ["", "", "def get_init_inputs():", f"    return [{', '.join(used)}]", ""]
    return "\n".join(lines)
