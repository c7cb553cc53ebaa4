"""The catalog's vocabulary (`cudagym.tasks.corpus.catalog`): `OpSpec` (one op the composer can
chain), `Catalog`, `Reject`, the input layouts, and the helpers the op families build their specs
with.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TypeVar

from cudagym.tasks.corpus.emit import EmitContext, Reject, State

ANY_RANK = (2, 3, 4, 5)
# Input layouts a chain can start from (see composer.START_LAYOUTS).
IMAGE_LAYOUTS = {1: "image1d", 2: "image2d", 3: "image3d"}
GENERIC_STARTS = ("features", "seq", "image2d")


@dataclass(frozen=True)
class OpSpec:
    name: str
    category: str
    ranks: tuple[int, ...]
    sample: Callable[[EmitContext, State], bool]
    starts: tuple[str, ...] = GENERIC_STARTS
    terminal: bool = False  # output is reduced to a scalar/loss: only last in a chain
    block: str | None = None  # helper class source this op needs (transformer blocks)
    dtypes: tuple[str, ...] = ("float32",)
    weight: float = 1.0  # relative sampling weight


@dataclass
class Catalog:
    ops: list[OpSpec] = field(default_factory=list)

    def add(self, spec: OpSpec) -> None:
        if any(o.name == spec.name for o in self.ops):
            raise ValueError(f"duplicate op {spec.name}")
        self.ops.append(spec)

    def by_name(self, name: str) -> OpSpec:
        for o in self.ops:
            if o.name == name:
                return o
        raise KeyError(name)

    @property
    def names(self) -> list[str]:
        return [o.name for o in self.ops]


# -- helpers --------------------------------------------------------------------------------
def need_fixed(state: State, *dims: int) -> None:
    for d in dims:
        if not state.fixed(d):
            raise Reject(f"dim {d} scales with the problem size")


def module_op(cat: Catalog, name: str, category: str, ctor: Callable[[EmitContext, State], str],
              attr: str, ranks: tuple[int, ...] = ANY_RANK, starts: tuple[str, ...] = GENERIC_STARTS,
              weight: float = 1.0, terminal: bool = False) -> None:
    """An `nn.Module` op: `self.<attr> = <ctor>` in `__init__`, `x = self.<attr>(x)` in forward."""

    def sample(ctx: EmitContext, state: State) -> bool:
        expr = ctor(ctx, state)
        a = ctx.attr(attr)
        ctx.init(f"self.{a} = {expr}")
        ctx.fwd(f"x = self.{a}(x)")
        return True

    cat.add(OpSpec(name, category, ranks, sample, starts=starts, weight=weight, terminal=terminal))


def fn_op(cat: Catalog, name: str, category: str, expr: Callable[[EmitContext, State], str] | str,
          ranks: tuple[int, ...] = ANY_RANK, starts: tuple[str, ...] = GENERIC_STARTS,
          weight: float = 1.0, terminal: bool = False) -> None:
    """A functional op: `x = <expr>` in forward (expr may use `x`)."""

    def sample(ctx: EmitContext, state: State) -> bool:
        e = expr(ctx, state) if callable(expr) else expr
        ctx.fwd(f"x = {e}")
        return True

    cat.add(OpSpec(name, category, ranks, sample, starts=starts, weight=weight, terminal=terminal))


_T = TypeVar("_T")


def choice(ctx: EmitContext, options: Sequence[_T]) -> _T:
    return ctx.rng.choice(options)


def reduce_dim(ctx: EmitContext, state: State) -> int:
    """A dim to reduce over that keeps dim 0 (the batch): the last dim, or the channel dim."""
    return ctx.rng.choice([-1, 1]) if state.rank > 2 else -1
