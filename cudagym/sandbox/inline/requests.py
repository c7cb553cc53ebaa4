"""A `load_inline`/`load` request (`cudagym.sandbox.inline`): its canonical arguments, the
compilers' identity and the key that names its module in the build cache; the package's limits and
errors.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

from cudagym.sandbox.toolchain import source_listing


INLINE_FORMAT = "cudagym-inline-v4"
INLINE_DIR = "inline"  # under the build cache
META_FILE = "meta.json"
MAX_ERROR_LINES = 40
MAX_REQUEST_BYTES = 256 * 1024  # of one request's arguments (sources included)
MAX_REQUESTS_PER_PASS = 3  # requests a compile pass reports (the rest come in the next pass)
MAX_SOURCE_BYTES = 64 << 20  # of the workspace files a build job gets (its copy of kernels/, model_new.py)
MAX_SOURCE_FILES = 1024
SOURCE_COPY = "ws"  # under a build job's staging directory
COPIED_FILES = ("model_new.py",)  # with kernels/, what of the workspace a build job's copy holds
KINDS = ("load_inline", "load")

_NOT_KEYED = frozenset({"build_directory", "verbose", "keep_intermediates", "use_pch"})  # do not change the module
_LISTS = frozenset({"cpp_sources", "cuda_sources", "sycl_sources", "extra_cflags", "extra_cuda_cflags",
                    "extra_sycl_cflags", "extra_ldflags", "extra_include_paths", "sources"})
PATH_ARGS = frozenset({"extra_include_paths", "sources"})


class InlineCompileError(RuntimeError):
    """A `load_inline`/`load` module failed to compile or was refused; the message is readable."""


class ExtensionNotBuilt(RuntimeError):  # noqa: N818 - what the candidate sees, as torch's own errors read
    """Raised to the candidate for a module that is not in the build cache (already recorded)."""


# -- requests: canonical arguments and their key ------------------------------------------------


def canonical_args(arguments: dict[str, Any], workspace: Path, cwd: Path) -> dict[str, Any]:
    """torch's bound arguments in one JSON-able form: lists for string-or-list arguments, paths
    (`sources`, `extra_include_paths`) resolved from `cwd` as torch resolves them, relative when
    inside `workspace`; arguments that do not change the module dropped. TypeError if a value
    has a type torch would not accept."""
    out: dict[str, Any] = {}
    for k, v in arguments.items():
        if k in _NOT_KEYED:
            continue
        if k in _LISTS:
            items = [] if v is None else [v] if isinstance(v, (str, os.PathLike)) else v
            if not isinstance(items, (list, tuple)) or not all(isinstance(x, (str, os.PathLike)) for x in items):
                raise TypeError(f"{k} must be a string or a list of strings")
            out[k] = [_workspace_path(os.fspath(x), workspace, cwd) if k in PATH_ARGS else os.fspath(x) for x in items]
        elif k == "functions":
            if isinstance(v, str):
                v = [v]
            if isinstance(v, dict) and all(isinstance(a, str) and isinstance(b, str) for a, b in v.items()):
                out[k] = dict(sorted(v.items()))
            elif v is None or (isinstance(v, (list, tuple)) and all(isinstance(f, str) for f in v)):
                out[k] = None if v is None else list(v)
            else:
                raise TypeError("functions must be a name, a list of names or a dict of names to docstrings")
        elif k == "name":
            if not isinstance(v, str):
                raise TypeError("name must be a string")
            out[k] = v
        else:
            out[k] = None if v is None else bool(v)
    return out


def _workspace_path(path: str, workspace: Path, cwd: Path) -> str:
    full = os.path.normpath(os.path.join(str(cwd), path))  # what torch's os.path.abspath gives
    ws = str(workspace)
    return full[len(ws) + 1 :] if full.startswith(ws + "/") else full


def with_cuda_of(kind: str, args: dict[str, Any]) -> bool:
    """Whether torch compiles this request with nvcc (as `_jit_compile` decides it)."""
    if args.get("with_cuda") is not None:
        return bool(args["with_cuda"])
    if kind == "load_inline":
        return bool(args.get("cuda_sources"))
    return any(s.endswith((".cu", ".cuh")) for s in args.get("sources", []))


def compiler_identity(with_cuda: bool) -> str:
    """The compilers of torch's JIT builds in a worker, as path and `--version`: `c++` on PATH
    and, for CUDA, CUDA_HOME's nvcc (the build job drops CXX, CC and PYTORCH_NVCC)."""
    import torch.utils.cpp_extension as cpp

    tools = ["c++"] + ([os.path.join(cpp.CUDA_HOME, "bin", "nvcc")] if with_cuda and cpp.CUDA_HOME else [])
    parts = []
    for tool in tools:
        path = shutil.which(tool)
        try:
            version = subprocess.run([path, "--version"], capture_output=True, text=True, timeout=60,
                                     stdin=subprocess.DEVNULL).stdout if path else "not found"
        except (OSError, subprocess.TimeoutExpired) as e:
            version = f"cannot run: {e}"
        parts.append(f"{tool}: {os.path.realpath(path) if path else ''}\n{version}")
    return "\n".join(parts)


def _arch_list(with_cuda: bool) -> str:
    """What torch compiles CUDA code for: TORCH_CUDA_ARCH_LIST, else the visible GPUs."""
    env = os.environ.get("TORCH_CUDA_ARCH_LIST")
    if env is not None or not with_cuda:
        return env or ""
    import torch

    if not torch.cuda.is_available():
        return ""
    return ";".join(sorted({"%d.%d" % torch.cuda.get_device_capability(i) for i in range(torch.cuda.device_count())}))


def inline_key(kind: str, args: dict[str, Any], identity: str, workspace: Path | None = None) -> str:
    """The first-level cache key of a request (canonical `args`; `identity` of its compilers).
    A request whose sources or include paths lie in `workspace` is keyed by the names of the
    files its build job's copy would hold too (`workspace_listing`): a file's mere existence can
    change a build (`__has_include`, a header found earlier on the search path)."""
    import torch

    payload = {"format": INLINE_FORMAT, "kind": kind, "args": args, "torch": torch.__version__,
               "python": sys.version, "arch": _arch_list(with_cuda_of(kind, args)), "compilers": identity}
    if workspace is not None and _reads_workspace(args, workspace):
        payload["workspace_files"] = workspace_listing(workspace)
    return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()


def workspace_listing(workspace: Path) -> str:
    """The names of the files a build job's copy of `workspace` holds (see `job_request`)."""
    return source_listing(Path(workspace), files=COPIED_FILES)


def _reads_workspace(args: dict[str, Any], workspace: Path) -> bool:
    """Whether canonical `args` name a source or an include directory in `workspace` (relative)
    or the workspace itself."""
    ws = str(workspace)
    return any(not os.path.isabs(p) or p == ws for k in PATH_ARGS for p in args.get(k, []))
