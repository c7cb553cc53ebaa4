"""Single-file (KernelBench) solutions: `load_inline` built once by the compile tool, then cached.

A KernelBench `model_new.py` builds its kernels at import time with
`torch.utils.cpp_extension.load_inline` (or `load` on files of the workspace). Inside the
harness's worker processes, `install_inline_loader` replaces both functions in the running
process:

- each call is keyed by the sha256 of everything that determines the module (name, sources,
  functions, flags, include paths, `with_cuda`, torch and Python versions, the CUDA arch list);
- a key already in `cache_dir/inline/<key>/` is imported from there, never recompiled;
- otherwise, in the compile job (`build_root` given), torch's own `load_inline` builds it in
  `build_root/<name>`, a directory that persists across compiles of one workspace so that
  torch's ninja rebuilds only what changed (editing the CUDA source does not recompile the C++
  file holding the pybind11 bindings); the module is copied atomically into the cache and
  recorded in `InlineRecorder.built`;
- in verify/profile jobs (no `build_root`) a module that was not compiled is an error, so those
  jobs never pay for a compile.

Compile errors come back as `InlineCompileError` whose message is the readable error list of
`cudagym.sandbox.toolchain.parse_diagnostics`, with line numbers of the user's source strings
(`cpp_sources:12: error: ...`, `cuda_sources:7: error: ...`).
"""

from __future__ import annotations

import hashlib
import importlib.util
import inspect
import json
import os
import re
import shutil
import sys
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any

from cudagym.sandbox.toolchain import parse_diagnostics, relativize, trim_log

INLINE_FORMAT = "cudagym-inline-v1"
MAX_ERROR_LINES = 40
# arguments that do not change the built module
_NOT_KEYED = frozenset({"build_directory", "verbose", "keep_intermediates"})
_HEADER_SUFFIXES = (".h", ".hpp", ".cuh", ".inl")


class InlineCompileError(RuntimeError):
    """A `load_inline`/`load` module failed to compile; the message is the trimmed error list."""


@dataclass
class InlineRecorder:
    """The state of an installed loader: which modules it built and loaded in this process."""

    cache_dir: Path
    build_root: Path | None
    workspace_root: Path
    built: list[tuple[str, str]] = field(default_factory=list)  # (name, key) compiled here
    loaded: list[tuple[str, str]] = field(default_factory=list)  # (name, key) taken from the cache
    _originals: dict[str, Callable[..., Any]] = field(default_factory=dict, repr=False)
    _modules: dict[str, Any] = field(default_factory=dict, repr=False)

    def uninstall(self) -> None:
        """Put torch's own `load_inline` and `load` back."""
        import torch.utils.cpp_extension as cpp

        for attr, fn in self._originals.items():
            setattr(cpp, attr, fn)
        self._originals.clear()

    # -- the replacements --------------------------------------------------------------------
    def load_inline(self, *args: Any, **kwargs: Any) -> Any:
        original = self._originals["load_inline"]
        bound = inspect.signature(original).bind(*args, **kwargs)
        bound.apply_defaults()
        a = dict(bound.arguments)
        keyed = {k: _normalize(v) for k, v in a.items() if k not in _NOT_KEYED}
        with_cuda = bool(a.get("with_cuda") or a.get("cuda_sources"))
        key = _key("load_inline", keyed, with_cuda)

        def line_offsets() -> dict[str, tuple[str, int]]:
            implicit = not a.get("no_implicit_headers", False)
            return {"main.cpp": ("cpp_sources", 1 if implicit else 0),
                    "cuda.cu": ("cuda_sources", 3 if implicit else 0)}

        return self._get(original, a, key, line_offsets)

    def load(self, *args: Any, **kwargs: Any) -> Any:
        original = self._originals["load"]
        bound = inspect.signature(original).bind(*args, **kwargs)
        bound.apply_defaults()
        a = dict(bound.arguments)
        sources = [a["sources"]] if isinstance(a["sources"], str) else list(a["sources"])
        paths = [Path(s).resolve() for s in sources]
        if not all(self.workspace_root in p.parents for p in paths):
            return original(*args, **kwargs)  # not the candidate's files: torch's own behaviour
        keyed = {k: _normalize(v) for k, v in a.items() if k not in _NOT_KEYED and k != "sources"}
        keyed["sources"] = [(p.relative_to(self.workspace_root).as_posix(), p.read_bytes().hex()) for p in paths]
        keyed["headers"] = sorted(
            (h.relative_to(self.workspace_root).as_posix(), h.read_bytes().hex())
            for d in {p.parent for p in paths} for h in d.iterdir() if h.suffix in _HEADER_SUFFIXES
        )
        with_cuda = bool(a.get("with_cuda")) or any(p.suffix in (".cu", ".cuh") for p in paths)
        key = _key("load", keyed, with_cuda)
        a["sources"] = [str(p) for p in paths]
        return self._get(original, a, key, lambda: {})

    # -- cache, build, import ----------------------------------------------------------------
    def _get(self, original: Callable[..., Any], a: dict[str, Any], key: str,
             line_offsets: Callable[[], dict[str, tuple[str, int]]]) -> Any:
        name = a["name"]
        if key in self._modules:
            return self._modules[key]
        entry = self.cache_dir / "inline" / key
        if (entry / "meta.json").is_file():
            result = _import_cached(entry)
            self.loaded.append((name, key))
        elif self.build_root is None:
            raise RuntimeError(f"load_inline module '{name}' was not compiled: run the compile tool first")
        else:
            result = self._build(original, a, key, line_offsets)
            self.built.append((name, key))
        self._modules[key] = result
        return result

    def _build(self, original: Callable[..., Any], a: dict[str, Any], key: str,
               line_offsets: Callable[[], dict[str, tuple[str, int]]]) -> Any:
        assert self.build_root is not None  # noqa: S101 - checked by the caller
        name = a["name"]
        build_dir = self.build_root / name
        build_dir.mkdir(parents=True, exist_ok=True)
        a = {**a, "build_directory": str(build_dir), "verbose": False}
        try:
            result = original(**a)
        except RuntimeError as e:
            if "Error building extension" not in str(e):
                raise
            raise InlineCompileError(_readable_error(name, str(e), build_dir, line_offsets())) from None
        built_file = Path(result.__file__ if isinstance(result, ModuleType) else result)
        module_name = result.__name__ if isinstance(result, ModuleType) else built_file.stem
        _store(self.cache_dir / "inline", key, built_file, {
            "name": name, "module": module_name, "file": built_file.name,
            "python_module": isinstance(result, ModuleType),
        })
        return result


def install_inline_loader(cache_dir: Path, build_root: Path | None = None,
                          workspace_root: Path | None = None) -> InlineRecorder:
    """Replace `torch.utils.cpp_extension.load_inline` and `load` in this process.

    `cache_dir`: the shared build cache (modules go to `cache_dir/inline/<key>/`).
    `build_root`: where the compile job builds (`build_root/<name>`, kept between compiles of
    one workspace); None in verify/profile jobs, where an uncached module is an error.
    `workspace_root` (default: the current directory): `load` is replaced for sources inside it.
    """
    import torch.utils.cpp_extension as cpp

    rec = InlineRecorder(Path(cache_dir).resolve(), Path(build_root).resolve() if build_root else None,
                         Path(workspace_root or os.getcwd()).resolve())
    rec._originals = {"load_inline": cpp.load_inline, "load": cpp.load}
    cpp.load_inline = rec.load_inline
    cpp.load = rec.load
    return rec


# -- helpers -----------------------------------------------------------------------------------


def _normalize(value: Any) -> Any:
    """Arguments as torch reads them: a str and a one-element list are the same; None is empty."""
    if value is None:
        return []
    if isinstance(value, str):
        return [value]
    if isinstance(value, dict):
        return sorted((str(k), _normalize(v)) for k, v in value.items())
    if isinstance(value, (list, tuple)):
        return [_normalize(v) if not isinstance(v, str) else v for v in value]
    if isinstance(value, os.PathLike):
        return [os.fspath(value)]
    return value


def _arch_list(with_cuda: bool) -> str:
    """What torch compiles CUDA code for: TORCH_CUDA_ARCH_LIST, else the visible GPUs."""
    env = os.environ.get("TORCH_CUDA_ARCH_LIST")
    if env is not None or not with_cuda:
        return env or ""
    import torch

    if not torch.cuda.is_available():
        return ""
    return ";".join(sorted({"%d.%d" % torch.cuda.get_device_capability(i) for i in range(torch.cuda.device_count())}))


def _key(kind: str, keyed: dict[str, Any], with_cuda: bool) -> str:
    import torch

    payload = {"format": INLINE_FORMAT, "kind": kind, "args": keyed, "torch": torch.__version__,
               "python": sys.version, "arch": _arch_list(with_cuda)}
    return hashlib.sha256(json.dumps(payload, sort_keys=True, default=repr).encode()).hexdigest()


def _store(root: Path, key: str, built_file: Path, meta: dict[str, Any]) -> None:
    """Copy the built library into `root/<key>/` atomically (staging dir + rename)."""
    final = root / key
    if (final / "meta.json").is_file():
        return
    staging = root / f".tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    staging.mkdir(parents=True)
    shutil.copy2(built_file, staging / built_file.name)
    (staging / "meta.json").write_text(json.dumps(meta))
    try:
        os.rename(staging, final)
    except OSError:  # built concurrently by another job: keep theirs
        shutil.rmtree(staging, ignore_errors=True)


def _import_cached(entry: Path) -> Any:
    meta = json.loads((entry / "meta.json").read_text())
    path = entry / meta["file"]
    if not meta.get("python_module", True):
        import torch

        torch.ops.load_library(str(path))
        return str(path)
    spec = importlib.util.spec_from_file_location(meta["module"], path)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot import cached module {meta['module']} from {path}")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    sys.modules[meta["module"]] = module
    return module


_SOURCE_LINE = re.compile(r"^(main\.cpp|cuda\.cu):(\d+):")


def _readable_error(name: str, message: str, build_dir: Path,
                    offsets: dict[str, tuple[str, int]]) -> str:
    """torch's 'Error building extension' message as readable lines of the user's sources."""
    import torch

    out = relativize(message, {str(build_dir) + "/": "", str(build_dir): ".",
                               os.path.dirname(torch.__file__): "<torch>"})
    errors = []
    for err in parse_diagnostics(out, MAX_ERROR_LINES):
        m = _SOURCE_LINE.match(err)
        if m and m.group(1) in offsets:
            label, shift = offsets[m.group(1)]
            err = f"{label}:{max(1, int(m.group(2)) - shift)}:{err[m.end():]}"
        errors.append(err)
    if not errors:
        tail = trim_log(out).splitlines()[-MAX_ERROR_LINES // 2:]
        errors = tail or ["the build failed without output"]
    return f"load_inline module '{name}' failed to compile:\n" + "\n".join(errors)
