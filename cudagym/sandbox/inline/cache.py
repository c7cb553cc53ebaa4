"""The parent's side of `load_inline`/`load` (`cudagym.sandbox.inline`): `InlineBuildCache`, which
prepares a request's build, hands the build job its request, checks the manifest and stores the
module as a variant of its key.
"""

from __future__ import annotations

import inspect
import json
import os
import shutil
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cudagym.sandbox.deps import (Roots, UnrecordedDependencyError, VariantStore, host_path, parse_depfile, record,
                                  system_roots)
from cudagym.sandbox.inline.flags import refusal
from cudagym.sandbox.inline.requests import (COPIED_FILES, INLINE_DIR, KINDS, MAX_SOURCE_BYTES, MAX_SOURCE_FILES,
                                             META_FILE, PATH_ARGS, SOURCE_COPY, InlineCompileError, canonical_args,
                                             compiler_identity, inline_key, with_cuda_of)
from cudagym.sandbox.toolchain import CacheBound, copy_sources, relativize


# -- the parent's side ----------------------------------------------------------------------------


@dataclass(frozen=True)
class InlineBuild:
    """A request the parent checked: canonical arguments, the candidate's call site, the key."""

    kind: str
    args: dict[str, Any]
    site: str
    key: str

    @property
    def name(self) -> str:
        return self.args["name"]


class InlineBuildCache:
    """The trusted side of the inline module cache at `cache_dir/inline` (the evaluator's).

    `prepare` checks and keys a build request from a candidate's job; `job_request` is what a
    build job gets; `store` files the built library with its dependency manifest. Thread-safe.
    """

    def __init__(self, cache_dir: Path, bound: CacheBound | None = None, max_output_bytes: int = 256 << 20) -> None:
        self.root = Path(cache_dir).resolve() / INLINE_DIR
        self.bound = bound  # the build cache's size bound, enforced after each store
        self.max_output_bytes = max_output_bytes  # of one module stored (ToolchainConfig.max_build_output_mb)
        self._variants = VariantStore(self.root)
        self._identity: dict[bool, str] = {}
        self._roots: tuple[Roots, Roots] | None = None

    def prepare(self, request: Any, workspace: Path) -> InlineBuild:
        """The checked form of `request`; InlineCompileError naming what is refused."""
        import torch.utils.cpp_extension as cpp

        if (not isinstance(request, dict) or request.get("kind") not in KINDS
                or not isinstance(request.get("args"), dict)):
            raise InlineCompileError(f"a malformed extension build request: {str(request)[:200]}")
        kind, site = request["kind"], str(request.get("site", "?"))[:300]
        try:
            bound = inspect.signature(getattr(cpp, kind)).bind(**request["args"])
            bound.apply_defaults()
            args = canonical_args(dict(bound.arguments), workspace, workspace)
        except TypeError as e:
            raise InlineCompileError(f"{kind} call ({site}): {e}") from None
        why = refusal(kind, args, *self.trusted_roots())
        if why:
            raise InlineCompileError(f"{kind} module '{args.get('name')}' ({site}): {why}")
        with_cuda = with_cuda_of(kind, args)
        if with_cuda not in self._identity:
            self._identity[with_cuda] = compiler_identity(with_cuda)
        return InlineBuild(kind, args, site, inline_key(kind, args, self._identity[with_cuda], Path(workspace)))

    def cached(self, build: InlineBuild, workspace: Path) -> bool:
        return self._variants.find(build.key, workspace) is not None

    def staging(self) -> Path:
        """A fresh directory for one build job (on the cache's file system, for the final rename)."""
        d = self.root / f".staging-{uuid.uuid4().hex}"
        d.mkdir(parents=True)
        return d

    def job_request(self, build: InlineBuild, workspace: Path, staging: Path | None = None) -> dict[str, Any]:
        """The build job's request: the arguments with absolute paths. With `staging`, paths in
        `workspace` point into a copy of its declared files made there (`SOURCE_COPY`), which is
        all of the workspace the build reads; InlineCompileError when that copy is over its bounds."""
        root = Path(workspace)
        if staging is not None:
            copy = copy_sources(root, staging / SOURCE_COPY, files=COPIED_FILES, max_bytes=MAX_SOURCE_BYTES,
                                max_files=MAX_SOURCE_FILES)
            if copy.error:
                raise InlineCompileError(f"{build.kind} module '{build.name}' ({build.site}): {copy.error}")
            root = copy.root

        def place(v: str) -> str:
            if not os.path.isabs(v):
                return str(root / v)
            ws = str(workspace)
            return str(root) + v[len(ws):] if v == ws or v.startswith(ws + "/") else v

        args = {k: [place(v) for v in vals] if k in PATH_ARGS else vals for k, vals in build.args.items()}
        return {"kind": build.kind, "args": args, "site": build.site, "workspace": str(root)}

    def store(self, build: InlineBuild, staging: Path, build_dir: Path, workspace: Path,
              paths: dict[str, str] | None = None) -> None:
        """File the library a build job left in `build_dir` (inside `staging`) as a variant of
        its key, with the manifest of every untrusted file the build read. `paths` maps where the
        job saw its directories to where they are here (`JobOutcome.paths`: a container's job
        directory); the dependency files name what the compiler opened, as it saw it."""
        import torch.utils.cpp_extension as cpp

        lib = build_dir / f"{build.name}{cpp.LIB_EXT}"
        if not lib.is_file():
            raise InlineCompileError(f"{build.kind} module '{build.name}' ({build.site}): the build left no {lib.name}")
        what = f"{build.kind} module '{build.name}' ({build.site})"
        size = lib.stat().st_size
        if size > self.max_output_bytes:
            raise InlineCompileError(f"{what} failed to compile:\nits library holds {size >> 20} MiB, over the "
                                     f"limit of {self.max_output_bytes >> 20} MiB for one build; a large "
                                     f"initialized array or table belongs in memory allocated at run time")

        def listed(pattern: str) -> list[str]:
            return [host_path(d, paths or {}) for f in sorted(build_dir.glob(pattern))
                    for d in parse_depfile(f.read_text(errors="replace"))]

        copy = staging / SOURCE_COPY
        try:
            if copy.is_dir():  # the build read the copy: recorded relative to it, as the workspace's files
                manifest = record(listed("*.d"), cwd=build_dir, workspace=copy, trusted=self.trusted_roots()[0],
                                  exclude=Roots([str(build_dir), str(staging / "tmp")]), assembler=listed("*.asd"))
            else:
                manifest = record(listed("*.d"), cwd=build_dir, workspace=workspace, trusted=self.trusted_roots()[0],
                                  exclude=Roots([str(staging)]), assembler=listed("*.asd"))
        except UnrecordedDependencyError as e:  # nothing is stored
            repl = {str(copy) + "/": "", str(build_dir) + "/": "", str(workspace) + "/": ""}
            raise InlineCompileError(f"{what} failed to compile:\n" + "\n".join(
                f"error: {relativize(p, repl)}" for p in e.problems)) from None
        meta = {"name": build.name, "file": lib.name, "python_module": bool(build.args.get("is_python_module", True))}

        def fill(d: Path) -> None:
            shutil.copy2(lib, d / lib.name)
            (d / META_FILE).write_text(json.dumps(meta))

        entry = self._variants.store(build.key, manifest, fill)
        if self.bound is not None:
            self.bound.enforce(CacheBound.size_of(entry))

    def trusted_roots(self) -> tuple[Roots, Roots]:
        """(include roots, library roots) of torch's JIT builds on this host."""
        if self._roots is None:
            import sysconfig

            import torch.utils.cpp_extension as cpp

            self._roots = (system_roots(shutil.which("c++") or "c++", cpp.CUDA_HOME),
                           Roots(["/usr/lib", "/usr/lib64", "/lib", "/lib64", "/usr/local/lib", cpp.TORCH_LIB_PATH,
                                  cpp.CUDA_HOME or "", sysconfig.get_config_var("LIBDIR") or ""]))
        return self._roots
