"""What a candidate's `model_new.py` may import to reach its compiled kernels.

The compile tool builds `kernels/` into one artifact directory. Inside verify and profile
workers the harness puts that directory on `sys.path` and in `CUDAGYM_KERNELS`:

- sources with `extern "C"` launchers and no torch binding become `libkernels.so`, loaded
  with `kernel_library()` and called through ctypes (`ptr(tensor)`, `stream()`);
- if `kernels/*_binding.cpp` exist, everything links into the torch extension `kernel_ext`
  (`import kernel_ext` or `extension()`); bindings use `PYBIND11_MODULE(TORCH_EXTENSION_NAME, m)`.

Calls through ctypes or a binding are the candidate's own kernels and pass the op audit; torch
compute ops called from Python (or from a binding through `at::`) do not.
"""

from __future__ import annotations

import ctypes
import importlib
import os
from pathlib import Path
from types import ModuleType

ENV_VAR = "CUDAGYM_KERNELS"
LIBRARY_NAME = "libkernels.so"
EXTENSION_NAME = "kernel_ext"


def artifact_dir() -> Path:
    d = os.environ.get(ENV_VAR)
    if not d:
        raise RuntimeError("no compiled kernels: run the compile tool first (CUDAGYM_KERNELS is not set)")
    return Path(d)


def kernel_library() -> ctypes.CDLL:
    """The workspace's kernels as a ctypes library (sources without a torch binding)."""
    path = artifact_dir() / LIBRARY_NAME
    if not path.is_file():
        raise RuntimeError(f"{LIBRARY_NAME} was not built (kernels/ has a *_binding.cpp: use extension())")
    return ctypes.CDLL(str(path))


def extension() -> ModuleType:
    """The workspace's torch extension module (built when kernels/*_binding.cpp exist)."""
    return importlib.import_module(EXTENSION_NAME)


def ptr(tensor) -> ctypes.c_void_p:  # noqa: ANN001 - a torch.Tensor
    """The data pointer of a tensor, for a ctypes call."""
    return ctypes.c_void_p(tensor.data_ptr())


def stream() -> ctypes.c_void_p:
    """The current CUDA stream handle (`cudaStream_t`), or NULL on the CPU target."""
    import torch

    if torch.cuda.is_available() and torch.cuda.is_initialized():
        return ctypes.c_void_p(torch.cuda.current_stream().cuda_stream)
    return ctypes.c_void_p(0)
