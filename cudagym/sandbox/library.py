"""Library baselines of GEMM tasks: cuBLASLt through nvmath-python, measured in the baseline job.

Two baselines beside eager (`torch.matmul`, whose kernel torch picks from cuBLAS or cuBLASLt) and
torch.compile, for a task whose reference is `C = A @ B` on two half-precision matrices (the
GEMM family, `cudagym.tasks.gemm`):

- ``cublaslt``: cuBLASLt with its default heuristic: `nvmath.linalg.advanced.Matmul.plan()` asks
  `cublasLtMatmulAlgoGetHeuristic` for candidates and every call runs the first, as a library
  caller that does not tune gets;
- ``cublaslt_tuned``: the same plan, then `Matmul.autotune()`: each candidate algorithm timed over
  `AUTOTUNE_ITERATIONS` calls, the fastest run from then on.

Both plan once per job (planning and tuning are not timed, as a server plans once per shape) on
the job's first input set, run on torch's current stream, and take each call's operands by
`reset_operands_unchecked` (a pointer swap; the shapes are the task's). Before its timed loop
each is checked against the reference on one input set at the task's tolerance: a library
result that does not match is an error of that baseline, never a time.

The worker imports nvmath only here (trusted code: the baseline job runs no candidate code).
Without it, or on the CPU target, the baselines are reported unavailable with the reason.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

LIBRARY_BASELINES = ("cublaslt", "cublaslt_tuned")
LIBRARY_TITLES = {"cublaslt": "cuBLASLt (heuristic)", "cublaslt_tuned": "cuBLASLt (autotuned)"}
AUTOTUNE_ITERATIONS = 10
INSTALL_HINT = "pip install 'cudagym[gemm]' (nvmath-python)"


class LibraryUnavailableError(Exception):
    """The library baseline cannot be measured here; the message says why."""


def _matmul_operands(args: list[Any]) -> tuple[torch.Tensor, torch.Tensor]:
    """The two matrices of a `C = A @ B` reference, or LibraryUnavailableError."""
    if (len(args) != 2 or not all(isinstance(a, torch.Tensor) for a in args)
            or args[0].dim() != 2 or args[1].dim() != 2 or args[0].shape[1] != args[1].shape[0]):
        shapes = [tuple(a.shape) if isinstance(a, torch.Tensor) else type(a).__name__ for a in args]
        raise LibraryUnavailableError(f"the reference's inputs are not two matrices A[M, K], B[K, N] (got {shapes})")
    if args[0].device.type != "cuda":
        raise LibraryUnavailableError("cuBLASLt baselines need a CUDA GPU")
    return args[0], args[1]


def library_matmul(name: str, args: list[Any]) -> Callable[..., torch.Tensor]:
    """A callable `fn(A, B) -> C` of library baseline `name`, planned (and tuned) on `args`."""
    if name not in LIBRARY_BASELINES:
        raise LibraryUnavailableError(f"unknown library baseline {name!r} (known: {', '.join(LIBRARY_BASELINES)})")
    a, b = _matmul_operands(args)
    try:
        from nvmath.linalg.advanced import Matmul
    except ImportError as e:
        raise LibraryUnavailableError(f"nvmath-python is not installed ({e}); {INSTALL_HINT}") from None
    try:
        mm = Matmul(a, b)
        mm.plan()
        if name == "cublaslt_tuned":
            mm.autotune(iterations=AUTOTUNE_ITERATIONS)
        torch.cuda.current_stream(a.device).synchronize()
    except Exception as e:  # noqa: BLE001 - the library's own error, reported as the baseline's
        raise LibraryUnavailableError(f"nvmath could not plan this matmul: {type(e).__name__}: "
                                      f"{str(e)[:300]}") from None
    reset = mm.reset_operands_unchecked
    execute = mm.execute

    def call(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        reset(a=x, b=y)
        return execute()

    call.matmul = mm  # type: ignore[attr-defined]  # kept alive with the callable
    return call
