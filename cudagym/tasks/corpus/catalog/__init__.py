"""The seed catalog: torch operators and transformer-style blocks the composer chains.

Each `OpSpec` knows which inputs it accepts (rank, which dims must be fixed — a constructor
argument can only come from a dim that does not scale with the problem size), how to start a
chain (`starts`: the input layouts it can take as the model's first input), and how to emit
itself: `sample(ctx, state)` draws constructor arguments from `ctx.rng` and writes `__init__`
and `forward` lines through `ctx` (see `composer.EmitContext`). It returns False (or raises
`Reject`) when it does not fit the state; shape checking itself is done by the composer on meta
tensors, so a sample only has to be plausible, not proven.

Conventions of emitted code: the running tensor is `x`; sizes are constructor arguments
(lower-case names in `__init__`, UPPER-case module constants in the source); other scalars
(slopes, eps, clamp bounds) are literals.

The package's modules: `spec` (`OpSpec`, `Catalog` and the helpers that build specs), `ops`
(torch's operators, by family) and `blocks` (transformer-style blocks and their sources).
"""

from cudagym.tasks.corpus.catalog.blocks import BLOCK_SOURCES, add_blocks
from cudagym.tasks.corpus.catalog.ops import add_operators
from cudagym.tasks.corpus.catalog.spec import ANY_RANK, GENERIC_STARTS, IMAGE_LAYOUTS, Catalog, OpSpec, Reject

__all__ = ["ANY_RANK", "BLOCK_SOURCES", "GENERIC_STARTS", "IMAGE_LAYOUTS", "Catalog", "OpSpec", "Reject",
           "default_catalog"]


def default_catalog() -> Catalog:
    """The full seed catalog (a fresh object: callers may filter it)."""
    cat = Catalog()
    add_operators(cat)
    add_blocks(cat)
    return cat
