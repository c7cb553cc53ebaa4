"""What an op writes through when the composer samples it (`cudagym.tasks.corpus.composer`):
the chain's state so far (`State`, its `Dim`s), the task being written (`EmitContext` and its
`InputArg`s), and `Reject`, which an op raises when it does not fit that state. The catalog's
op families (`cudagym.tasks.corpus.catalog`) and the composer both build on these.
"""

from __future__ import annotations

import copy
import random
from collections.abc import Sequence
from dataclasses import dataclass, field


class Reject(Exception):
    """The op does not fit the current state."""


@dataclass(frozen=True)
class Dim:
    full: int
    small: int
    name: str | None = None  # the module constant this dim equals, where known


@dataclass(frozen=True)
class State:
    dims: tuple[Dim, ...]
    integer: bool = False

    @property
    def rank(self) -> int:
        return len(self.dims)

    def fixed(self, i: int) -> bool:
        d = self.dims[i]
        return d.full == d.small


@dataclass
class InputArg:
    name: str
    dims: list[str]  # UPPER-case constant names
    kind: str = "randn"  # randn | rand | sign | randint
    high: str | None = None  # randint's exclusive bound (a constant name)


@dataclass
class EmitContext:
    """What an op's `sample` writes through. Names are unique per task; `snapshot`/`restore` undo."""

    rng: random.Random
    consts: dict[str, tuple[int, int]] = field(default_factory=dict)  # NAME -> (full, small)
    inputs: list[InputArg] = field(default_factory=list)
    attrs: list[str] = field(default_factory=list)
    init_lines: list[str] = field(default_factory=list)
    fwd_lines: list[str] = field(default_factory=list)
    helpers: list[str] = field(default_factory=list)

    def snapshot(self) -> EmitContext:
        return copy.deepcopy(self)

    def restore(self, snap: EmitContext) -> None:
        for f in ("consts", "inputs", "attrs", "init_lines", "fwd_lines", "helpers"):
            setattr(self, f, copy.deepcopy(getattr(snap, f)))

    # -- names ----------------------------------------------------------------------------
    def const(self, base: str, full: int, small: int | None = None) -> str:
        name = base.upper()
        k = 2
        while name in self.consts:
            name = f"{base.upper()}_{k}"
            k += 1
        self.consts[name] = (full, full if small is None else small)
        return name

    def size(self, base: str, value: int) -> str:
        """A new fixed size constant; returns the `__init__` argument name (lower case)."""
        return self.const(base, int(value)).lower()

    def scaled(self, base: str, full: int, small: int) -> str:
        """A new problem-size constant (batch, spatial); returns its UPPER name."""
        return self.const(base, full, small)

    def dim(self, state: State, i: int, base: str) -> str:
        """The `__init__` argument holding fixed dim `i` of `state` (a new constant if unnamed)."""
        d = state.dims[i]
        if d.full != d.small:
            raise Reject(f"dim {i} is not fixed")
        if d.name is not None and self.consts.get(d.name) == (d.full, d.small):
            return d.name.lower()
        return self.size(base, d.full)

    def attr(self, base: str) -> str:
        name, k = base, 2
        while name in self.attrs:
            name = f"{base}{k}"
            k += 1
        self.attrs.append(name)
        return name

    def input(self, base: str, dims: Sequence[Dim | str], kind: str = "randn", high: Dim | None = None) -> str:
        """A new model input of the given dims (Dim or a lower-case name from `size`)."""
        names = [self._dim_const(d, "size") for d in dims]
        high_name = self._dim_const(high, "num_classes") if high is not None else None
        name, k = base, 2
        taken = {"x"} | {i.name for i in self.inputs}
        while name in taken:
            name = f"{base}{k}"
            k += 1
        self.inputs.append(InputArg(name, names, kind, high_name))
        return name

    def _dim_const(self, d: Dim | str, base: str) -> str:
        if isinstance(d, str):
            return d.upper()
        if d.name is not None and self.consts.get(d.name) == (d.full, d.small):
            return d.name
        if d.full != d.small:
            raise Reject("cannot name a derived problem-size dim")
        return self.const(base, d.full)

    # -- code -----------------------------------------------------------------------------
    def init(self, line: str) -> None:
        self.init_lines.append(line)

    def fwd(self, line: str) -> None:
        self.fwd_lines.append(line)

    def helper(self, name: str) -> None:
        if name not in self.helpers:
            self.helpers.append(name)
