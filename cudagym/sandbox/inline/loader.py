"""The candidate's side of `load_inline`/`load` (`cudagym.sandbox.inline`): the `InlineLoader`
installed in place of torch's two functions in a job that runs candidate code, which imports
cached modules read-only and records every other call as a request or a problem.
"""

from __future__ import annotations

import importlib.util
import inspect
import json
import os
import sys
import types
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from cudagym.sandbox.deps import VariantStore
from cudagym.sandbox.inline.requests import (INLINE_DIR, MAX_REQUEST_BYTES, META_FILE, ExtensionNotBuilt,
                                             canonical_args, compiler_identity, inline_key, with_cuda_of)


# -- the candidate's side: the loader -------------------------------------------------------------


@dataclass
class InlineLoader:
    """`load_inline` and `load` in a process that runs candidate code (see the module docstring).

    `missing`: requests (`{"kind", "args", "site"}`) for calls whose module is not in the cache;
    `failures`: cached modules that failed to load; `loaded`: names of modules imported.
    """

    cache_root: Path  # <cache>/build/inline
    workspace: Path
    missing: list[dict[str, Any]] = field(default_factory=list)
    failures: list[str] = field(default_factory=list)
    loaded: list[str] = field(default_factory=list)
    originals: dict[str, Callable[..., Any]] = field(default_factory=dict, repr=False)  # torch's, by kind
    _modules: dict[str, Any] = field(default_factory=dict, repr=False)
    _identity: dict[bool, str] = field(default_factory=dict, repr=False)

    def load_inline(self, *args: Any, **kwargs: Any) -> Any:
        return self._load("load_inline", args, kwargs)

    def load(self, *args: Any, **kwargs: Any) -> Any:
        return self._load("load", args, kwargs)

    def problems(self) -> list[str]:
        """What went wrong with this process's extensions, for the harness to report: modules
        requested here but not built by the compile step, and modules that failed to load."""
        return [f"{r['kind']} module '{r['args']['name']}' ({r['site']}) was not built by the compile step"
                for r in self.missing] + self.failures

    def _load(self, kind: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        site = _call_site(self.workspace)
        bound = inspect.signature(self.originals[kind]).bind(*args, **kwargs)
        bound.apply_defaults()
        canon = canonical_args(dict(bound.arguments), self.workspace, Path.cwd())
        with_cuda = with_cuda_of(kind, canon)
        if with_cuda not in self._identity:
            self._identity[with_cuda] = compiler_identity(with_cuda)
        key = inline_key(kind, canon, self._identity[with_cuda], self.workspace)
        if key in self._modules:
            return self._modules[key]
        name = canon["name"]
        entry = VariantStore(self.cache_root).find(key, self.workspace)
        if entry is None:
            request = {"kind": kind, "args": canon, "site": site}
            size = len(json.dumps(request))
            if size > MAX_REQUEST_BYTES:
                self._fail(f"{kind} module '{name}' ({site}): its arguments are {size >> 10} KB; the compile step "
                           f"builds extensions of up to {MAX_REQUEST_BYTES >> 10} KB")
            elif request not in self.missing:
                self.missing.append(request)
            raise ExtensionNotBuilt(f"{kind} module '{name}' ({site}) is not in the build cache: the compile tool "
                                    "builds the extensions a solution asks for")
        try:
            module = _import_cached(entry)
        except Exception as e:
            self._fail(f"extension '{name}' ({site}) failed to load: {type(e).__name__}: {e}; "
                       "the solution fell back to torch")
            raise
        self.loaded.append(name)
        self._modules[key] = module
        return module

    def _fail(self, problem: str) -> None:
        if problem not in self.failures:  # a solution may retry on every call
            self.failures.append(problem)


# The one loader installed in this process (it replaces process-global torch functions); the
# harness asks it for problems at the end of a job. Advisory only: the candidate's code runs in
# the same process and could clear it, and then the op audit and the own-kernel share still see
# a torch fallback.
_INSTALLED: list[InlineLoader] = []


def install_inline_loader(cache_dir: Path, workspace: Path) -> InlineLoader:
    """Replace `torch.utils.cpp_extension.load_inline` and `load` in this process.

    `cache_dir`: the build cache (modules under `cache_dir/inline/`), read-only here;
    `workspace`: the candidate's workspace (paths in requests and manifests are relative to it).
    """
    import torch.utils.cpp_extension as cpp

    loader = InlineLoader(Path(cache_dir).resolve() / INLINE_DIR, Path(workspace).resolve(),
                          originals={"load_inline": cpp.load_inline, "load": cpp.load})
    cpp.load_inline = loader.load_inline
    cpp.load = loader.load
    _INSTALLED[:] = [loader]
    return loader


def inline_problems() -> list[str]:
    """The problems of the loader installed in this process (none installed: none)."""
    return _INSTALLED[0].problems() if _INSTALLED else []


def _call_site(workspace: Path) -> str:
    """`path:line` of the innermost frame in a workspace file: the candidate's call."""
    prefix = str(workspace) + os.sep
    frame: types.FrameType | None = sys._getframe(1)  # noqa: SLF001 - the caller's frame
    while frame is not None:
        if frame.f_code.co_filename.startswith(prefix):
            return f"{frame.f_code.co_filename[len(prefix):]}:{frame.f_lineno}"
        frame = frame.f_back
    return "called from outside the workspace"


def _import_cached(entry: Path) -> Any:
    meta = json.loads((entry / META_FILE).read_text())
    path = entry / meta["file"]
    if not meta["python_module"]:
        import torch

        torch.ops.load_library(str(path))
        return str(path)
    spec = importlib.util.spec_from_file_location(meta["name"], path)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot import cached module {meta['name']} from {path}")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    sys.modules[meta["name"]] = module
    return module
