"""The compile tool (`cudagym.sandbox.toolchain`): `Toolchain` and its config, which plan a
workspace's compiles, look them up in and store them to the object cache, and link the artifact.
"""

from __future__ import annotations

import asyncio
import functools
import os
import re
import shutil
import subprocess
import sysconfig
import tempfile
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from pydantic import BaseModel, Field

from cudagym.errors import ToolchainError
from cudagym.core.verdict import CompileResult
from cudagym.sandbox.deps import (Roots, UnrecordedDependencyError, VariantStore, outputs_intact, parse_depfile,
                                  record, seal_outputs, system_roots)
from cudagym.runtime import EXTENSION_NAME, LIBRARY_NAME
from cudagym.sandbox.toolchain.cache import CacheBound, remove_entry, sha256_of
from cudagym.sandbox.toolchain.compilers import (fallback_error, over_output_limit, parse_diagnostics, relativize,
                                                 run_tool, trim_log)
from cudagym.sandbox.toolchain.sources import SourceCopy, copy_sources
from cudagym.sandbox.workspace import Workspace
from cudagym.tasks.model import Target

CACHE_FORMAT = "cudagym-build-v4"  # bump to invalidate every cached object and artifact
BINDING_SUFFIX = "_binding.cpp"


class ToolchainConfig(BaseModel):
    """Compilers, flags and limits of the compile tool."""

    cxx: str = "g++"
    nvcc: str = "nvcc"
    cuda_arch: str | None = None  # e.g. "sm_90a"; None: detected from the GPU (sm_90a without one)
    timeout_s: float = 180.0  # per compiler call
    max_jobs: int = 4  # sources compiled in parallel
    extra_cflags: list[str] = []
    extra_cuda_cflags: list[str] = []
    max_error_lines: int = 40
    cxx_std: str = "c++17"
    isolate_network: bool = True  # run compilers under `unshare --net` where it works
    max_output_mb: int = Field(default=256, ge=1)  # per file a compiler or the linker writes
    max_build_output_mb: int = Field(default=256, ge=1)  # one build's new objects + library, all together
    max_source_mb: int = Field(default=64, ge=1)  # kernels/ as copied for one build, all files
    max_source_files: int = Field(default=1024, ge=1)
    max_cache_mb: int = Field(default=8192, ge=1)  # objects + artifacts + inline modules; LRU past it
    evict_grace_s: float = Field(default=300.0, ge=0)  # entries used this recently are kept (see CacheBound)


def _place_object(obj: Path, directory: Path) -> None:
    """Move a compiled object into its new cache variant's directory (`VariantStore.store`'s fill)."""
    os.replace(obj, directory / OBJECT_FILE)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:
        return True
    return True


# -- the toolchain ---------------------------------------------------------------------------


class _OutputBudget:
    """What one build's new objects hold, against `max_build_output_mb` (thread-safe)."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.used = 0
        self.over = False
        self._lock = threading.Lock()

    def add(self, size: int) -> bool:
        """Count an object of `size` bytes; False once the build is over its limit."""
        with self._lock:
            self.used += size
            self.over = self.over or self.used > self.limit
            return not self.over


OBJECT_FILE = "object.o"  # the output of a variant under objects/<key>/


@dataclass
class _Compile:
    """One source to compile: `argv + [dependency flags] + ['-c', rel, '-o', out]`, run in the
    workspace root. `key` is its first-level cache key; `variant`, once looked up or built,
    the cache directory of its object."""

    rel: str
    argv: list[str]
    key: str
    variant: Path | None = None

    @property
    def object_path(self) -> Path:
        assert self.variant is not None  # noqa: S101 - looked up or built before use
        return self.variant / OBJECT_FILE

    @property
    def object_key(self) -> str:
        assert self.variant is not None  # noqa: S101
        return f"{self.key}/{self.variant.name}"


@dataclass
class _Plan:
    compiles: list[_Compile]
    link_argv: list[str]  # linker + flags; objects and `-o` are added
    link_libs: list[str]  # after the objects
    output_name: str
    trusted: Roots = field(default_factory=lambda: Roots(()))  # left out of dependency manifests
    errors: list[str] = field(default_factory=list)


class Toolchain:
    """Builds workspaces through a content-addressed object and artifact cache at `cache_dir`.

    One `Toolchain` may build many workspaces, from many threads; compiler identities and
    probes are computed once per instance. `build` never raises for the candidate's mistakes
    (they come back as `CompileResult.errors`); it raises `ToolchainError` when a compiler it
    needs cannot be run at all.
    """

    def __init__(self, cache_dir: Path, config: ToolchainConfig | None = None) -> None:
        self.cache_dir = Path(cache_dir).resolve()
        self.config = config or ToolchainConfig()
        for sub in ("objects", "artifacts", "src"):
            (self.cache_dir / sub).mkdir(parents=True, exist_ok=True)
        for stale in (self.cache_dir / "src").iterdir():  # copies of builds whose process died
            pid = stale.name.split("-", 1)[0]
            if pid.isdigit() and not _alive(int(pid)):
                shutil.rmtree(stale, ignore_errors=True)
        self._lock = threading.Lock()
        self._identities: dict[str, str] = {}
        self._paths: dict[str, str] = {}
        self._unshare: bool | None = None
        self._cuda_home: str | None = None
        self._arch: str | None = None
        self._roots: dict[bool, Roots] = {}
        self._objects = VariantStore(self.cache_dir / "objects")
        self.bound = CacheBound(self.cache_dir, self.config.max_cache_mb << 20, self.config.evict_grace_s,
                                slack_bytes=self.config.max_build_output_mb << 20)

    # -- public ------------------------------------------------------------------------------
    def build(self, workspace: Workspace, target: Target) -> CompileResult:
        """Compile and link `workspace`'s kernels for `target` from a private copy of them; see
        the module docstring."""
        start = time.perf_counter()
        target = Target(target)
        if not workspace.kernel_sources():
            return CompileResult(ok=True, seconds=time.perf_counter() - start, cached=True)
        cfg = self.config
        copy = copy_sources(workspace.root, self.cache_dir / "src" / f"{os.getpid()}-{uuid.uuid4().hex[:12]}",
                            max_bytes=cfg.max_source_mb << 20, max_files=cfg.max_source_files)
        try:
            if copy.error:
                return CompileResult(ok=False, seconds=time.perf_counter() - start, errors=[copy.error], log=copy.error)
            stored: list[Path] = []
            result = self._build(Workspace(copy.root), target, copy, start, stored)
            artifact = Path(result.artifact_dir) if result.artifact_dir else None
        finally:
            shutil.rmtree(copy.root, ignore_errors=True)
        if copy.left_out:
            note = ("not copied for the build (a build reads only regular source files): "
                    + ", ".join(copy.left_out[:20]))
            result = result.model_copy(update={"log": "\n".join(x for x in (note, result.log) if x)})
        if stored:
            self.bound.enforce(CacheBound.size_of(*stored), keep=(artifact,))
        return result

    def _build(self, workspace: Workspace, target: Target, copy: SourceCopy, start: float,
               stored: list[Path]) -> CompileResult:
        """`build` in the copy `workspace` (see `copy_sources`); the cache entries it stored go to `stored`."""
        sources = [workspace.root / r for r in copy.files if Path(r).suffix in (".cu", ".cpp", ".cc", ".c")]
        if not sources:
            return CompileResult(ok=True, seconds=time.perf_counter() - start, cached=True)
        plan = self._plan(workspace, target, sources, copy.listing)
        if plan.errors:
            return CompileResult(ok=False, seconds=time.perf_counter() - start, errors=plan.errors,
                                 log="\n".join(plan.errors))

        tmp = workspace.build_dir / "tmp"
        tmp.mkdir(parents=True, exist_ok=True)
        env = self._env(tmp)
        digests: dict[str, str | None] = {}  # each file hashed once per build
        for c in plan.compiles:
            c.variant = self._objects.find(c.key, workspace.root, digests)
        pending = [c for c in plan.compiles if c.variant is None]
        reused = [c.rel for c in plan.compiles if c not in pending]
        logs: dict[str, str] = {}
        errors: list[str] = []
        budget = _OutputBudget(self.config.max_build_output_mb << 20)
        created: list[Path] = []  # objects this build put in the cache
        if pending:
            with ThreadPoolExecutor(max_workers=max(1, self.config.max_jobs)) as pool:
                runs = list(pool.map(lambda c: self._compile(c, plan, workspace, env, budget), pending))
            try:
                for c, (ok, log, errs, built) in zip(pending, runs, strict=True):
                    if log:
                        logs[c.rel] = log
                    errors.extend(errs)
                if budget.over:  # nothing of this build is stored
                    errors.insert(0, f"kernels: error: {self._build_limit_message(budget.used)}")
                else:
                    for c, (_, _, _, built) in zip(pending, runs, strict=True):
                        if built is not None:
                            obj, manifest = built
                            c.variant = self._objects.store(c.key, manifest, functools.partial(_place_object, obj),
                                                            created=created)
            finally:
                for _, _, _, built in runs:
                    if built is not None:
                        shutil.rmtree(built[0].parent, ignore_errors=True)
        compiled = [c.rel for c in pending]
        stored.extend(created)
        log = "\n".join(logs[r] for r in sorted(logs))
        if errors:
            return CompileResult(ok=False, seconds=time.perf_counter() - start, compiled=compiled,
                                 reused=reused, errors=errors[: self.config.max_error_lines], log=log)

        artifact, linked, link_log, link_errors = self._link(plan, workspace, env, budget.used)
        if any("max_build_output_mb" in e or "max_output_mb" in e for e in link_errors):
            for entry in created:  # its output over a limit: nothing of the build stays
                remove_entry(entry)
                stored.remove(entry)
        if linked and artifact is not None:
            stored.append(artifact)
        log = "\n".join(x for x in (log, link_log) if x)
        return CompileResult(
            ok=not link_errors,
            seconds=time.perf_counter() - start,
            cached=not compiled and not linked and not link_errors,
            artifact_dir=str(artifact) if artifact else None,
            compiled=compiled,
            reused=reused,
            errors=link_errors[: self.config.max_error_lines],
            log=log,
        )

    async def abuild(self, workspace: Workspace, target: Target) -> CompileResult:
        """`build` in a worker thread, for trainers running many episodes concurrently."""
        return await asyncio.to_thread(self.build, workspace, target)

    @property
    def cuda_arch(self) -> str:
        """The `-arch` of CUDA compiles: configured, else the GPU's, else `sm_90a`."""
        if self.config.cuda_arch:
            return self.config.cuda_arch
        if self._arch is None:
            self._arch = detect_cuda_arch() or "sm_90a"
        return self._arch

    # -- planning ----------------------------------------------------------------------------
    def _plan(self, ws: Workspace, target: Target, sources: list[Path], listing: str) -> _Plan:
        cfg = self.config
        rels = [p.relative_to(ws.root).as_posix() for p in sources]
        cuda_rels = [r for r in rels if r.endswith(".cu")]
        if target == Target.CPU and cuda_rels:
            return _Plan([], [], [], "", errors=[
                f"{r}: error: .cu sources need the CUDA target; on the CPU target write C++ "
                f"(.cpp) kernels" for r in cuda_rels
            ])
        with_cuda = target == Target.CUDA
        has_binding = any(r.endswith(BINDING_SUFFIX) for r in rels)

        cxx = self._resolve(cfg.cxx)
        cxx_id = self._identity(cfg.cxx, native=True)
        cxx_flags = ["-O3", f"-std={cfg.cxx_std}", "-fPIC", "-fopenmp", "-march=native", "-Ikernels",
                     *cfg.extra_cflags]
        torch_inc: list[str] = []
        binding_defs: list[str] = []
        torch_version = ""
        if has_binding:
            torch_inc, binding_defs, torch_version = self._torch_compile_flags(with_cuda)

        compiles: list[_Compile] = []
        for path, rel in zip(sources, rels, strict=True):
            src = path.read_bytes()
            if rel.endswith(".cu"):
                nvcc = self._resolve(cfg.nvcc)
                argv = [nvcc, "-O3", f"-std={cfg.cxx_std}", "-Xcompiler", "-fPIC", f"-arch={self.cuda_arch}",
                        "-ccbin", cxx, "-Ikernels", *torch_inc, *cfg.extra_cuda_cflags]
                ident = self._identity(cfg.nvcc) + cxx_id
            else:
                extra = binding_defs if rel.endswith(BINDING_SUFFIX) else []
                argv = [cxx, *cxx_flags, *torch_inc, *extra]
                ident = cxx_id
            key = sha256_of(CACHE_FORMAT, ident, "\0".join(argv), rel, src, torch_version if torch_inc else "", listing)
            compiles.append(_Compile(rel, argv, key))

        link_argv = [cxx, "-shared", "-fopenmp"]
        libs: list[str] = []
        if has_binding:
            import torch.utils.cpp_extension as cpp

            lib = cpp.TORCH_LIB_PATH
            libs += [f"-L{lib}", "-lc10", "-ltorch", "-ltorch_cpu", "-ltorch_python"]
            if with_cuda:
                libs += ["-lc10_cuda", "-ltorch_cuda"]
            libs.append(f"-Wl,-rpath,{lib}")
            output = EXTENSION_NAME + (sysconfig.get_config_var("EXT_SUFFIX") or ".so")
        else:
            output = LIBRARY_NAME
        if with_cuda and (cuda_rels or has_binding):
            cuda_lib = self._cuda_lib_dir()
            libs += [f"-L{cuda_lib}", "-lcudart", f"-Wl,-rpath,{cuda_lib}"]
        return _Plan(compiles, link_argv, libs, output, trusted=self._trusted_roots(with_cuda))

    def _torch_compile_flags(self, with_cuda: bool) -> tuple[list[str], list[str], str]:
        """(include flags, binding defines, torch version), as torch's own JIT builds use them."""
        import warnings

        import torch
        import torch.utils.cpp_extension as cpp

        dirs = list(cpp.include_paths("cpu"))
        if with_cuda:
            dirs.append(os.path.join(self._cuda_home_dir(), "include"))
        py_inc = sysconfig.get_path("include", scheme="posix_prefix")
        if py_inc:
            dirs.append(py_inc)
        inc = [f for d in dirs for f in ("-isystem", d)]
        defs = [f"-DTORCH_EXTENSION_NAME={EXTENSION_NAME}", "-DTORCH_API_INCLUDE_EXTENSION_H",
                f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}"]  # noqa: SLF001 - torch's ABI flag
        pybind = getattr(cpp, "_get_pybind11_abi_build_flags", None)
        if pybind is not None:  # empty (and deprecated) from torch 2.10 on: pybind11 handles its ABI
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                defs += list(pybind())
        return inc, defs, torch.__version__

    # -- compiling and linking ---------------------------------------------------------------
    def _compile(self, c: _Compile, plan: _Plan, ws: Workspace, env: dict[str, str],
                 budget: _OutputBudget) -> tuple[bool, str, list[str], tuple[Path, dict[str, str]] | None]:
        """Compile `c` into a scratch directory; (ok, log, errors, (object, manifest) to store).
        The caller stores the object and removes its scratch directory. Not started once the
        build's outputs are over `budget`."""
        if budget.over:
            return False, "", [], None
        scratch = self.cache_dir / "objects" / f".tmp-{os.getpid()}-{uuid.uuid4().hex[:12]}"
        scratch.mkdir(parents=True)
        keep = False
        try:
            obj = scratch / OBJECT_FILE
            run = run_tool(self._wrap([*c.argv, *self._dependency_flags(c, scratch), "-c", c.rel, "-o", str(obj)]),
                       ws.root, env, self.config.timeout_s)
            repl = self._replacements(ws)
            repl[str(obj)] = f"{c.rel}.o"
            out = relativize(run.output, repl)
            if run.timed_out:
                why = f"{c.rel}: error: compile timed out after {self.config.timeout_s:g} s"
                return False, trim_log(out), [why], None
            if run.returncode != 0 or not obj.is_file():
                if over_output_limit(run):
                    return False, trim_log(out), [f"{c.rel}: error: {self._output_limit_message()}"], None
                errs = parse_diagnostics(out, self.config.max_error_lines) or fallback_error(c.rel, out, run)
                return False, trim_log(out), errs, None
            if not budget.add(obj.stat().st_size):
                return False, trim_log(out), [], None  # the build fails for its total (see `_build`)

            def listed(name: str) -> list[str]:
                f = scratch / name
                return parse_depfile(f.read_text(errors="replace")) if f.is_file() else []

            try:
                manifest = record(listed("cpp.d"), cwd=ws.root, workspace=ws.root, trusted=plan.trusted,
                                  exclude=Roots([str(scratch), str(ws.build_dir / "tmp")]), assembler=listed("as.d"))
            except UnrecordedDependencyError as e:
                return False, trim_log(out), [f"{c.rel}: error: {relativize(p, self._replacements(ws))}"
                                              for p in e.problems], None
            keep = True
            return True, trim_log(out), [], (obj, manifest)
        finally:
            if not keep:
                shutil.rmtree(scratch, ignore_errors=True)

    def _dependency_flags(self, c: _Compile, scratch: Path) -> list[str]:
        """Write every file the compile reads into `scratch/*.d`: the preprocessor's `-MD` list (not
        `-MMD`: see `cudagym.sandbox.deps`) and, with GNU as, the assembler's (`.incbin`)."""
        flags = ["-MD", "-MF", str(scratch / "cpp.d"), "-MT", "obj"]
        if self._gnu_as():
            as_deps = f"--MD,{scratch / 'as.d'}"
            # nvcc splits -Xcompiler values at commas; a backslash keeps one
            flags += ["-Xcompiler", "-Wa\\," + as_deps.replace(",", "\\,")] if c.rel.endswith(".cu") \
                else [f"-Wa,{as_deps}"]
        return flags

    def _link(self, plan: _Plan, ws: Workspace, env: dict[str, str],
              new_bytes: int = 0) -> tuple[Path | None, bool, str, list[str]]:
        """Link the plan's objects into `artifacts/<key>/`; returns (dir, linked now, log, errors).
        `new_bytes`: what this build's new objects hold (with the library, within
        `max_build_output_mb`)."""
        key = sha256_of(CACHE_FORMAT, self._identity(self.config.cxx, native=True), "\0".join(plan.link_argv),
                      "\0".join(plan.link_libs), plan.output_name, *(c.object_key for c in plan.compiles))
        final = self.cache_dir / "artifacts" / key
        if (final / plan.output_name).is_file():
            if outputs_intact(final):
                CacheBound.touch(final)
                return final, False, "", []
            remove_entry(final)  # changed since it was stored: built again
        staging = self.cache_dir / "artifacts" / f".tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        staging.mkdir(parents=True)
        objects = [str(c.object_path) for c in plan.compiles]
        argv = [*plan.link_argv, "-o", str(staging / plan.output_name), *objects, *plan.link_libs]
        run = run_tool(self._wrap(argv), ws.root, env, self.config.timeout_s)
        repl = self._replacements(ws)
        repl.update({str(c.object_path): f"{c.rel}.o" for c in plan.compiles})
        repl[str(staging)] = "<artifact>"
        out = relativize(run.output, repl)
        if run.timed_out or run.returncode != 0 or not (staging / plan.output_name).is_file():
            shutil.rmtree(staging, ignore_errors=True)
            if run.timed_out:
                return None, True, trim_log(out), [f"link: error: timed out after {self.config.timeout_s:g} s"]
            if over_output_limit(run):
                return None, True, trim_log(out), [f"link: error: {self._output_limit_message()}"]
            errs = parse_diagnostics(out, self.config.max_error_lines) or fallback_error("link", out, run)
            return None, True, trim_log(out), errs
        total = new_bytes + CacheBound.size_of(staging)
        if total > self.config.max_build_output_mb << 20:
            shutil.rmtree(staging, ignore_errors=True)
            return None, True, trim_log(out), [f"link: error: {self._build_limit_message(total)}"]
        seal_outputs(staging)
        try:
            os.rename(staging, final)
        except OSError:  # another build linked the same key first: use theirs
            shutil.rmtree(staging, ignore_errors=True)
        return final, True, trim_log(out), []

    # -- environment and probes --------------------------------------------------------------
    def _env(self, tmp: Path) -> dict[str, str]:
        return {"PATH": os.environ.get("PATH", "/usr/local/bin:/usr/bin:/bin"), "HOME": str(tmp),
                "TMPDIR": str(tmp), "LANG": "C", "LC_ALL": "C"}

    def _wrap(self, argv: list[str]) -> list[str]:
        """`argv` with its output files bounded (`max_output_mb`) and, where it works, no network."""
        prlimit = shutil.which("prlimit")
        if prlimit is None:  # pragma: no cover - util-linux ships it beside unshare
            raise ToolchainError("prlimit (util-linux) is needed to bound what a compiler writes")
        argv = [prlimit, f"--fsize={self.config.max_output_mb << 20}", "--", *argv]
        return ["unshare", "--net", *argv] if self._network_isolation() else argv

    def _output_limit_message(self) -> str:
        return (f"the build's output is over the limit of {self.config.max_output_mb} MiB per file "
                f"(ToolchainConfig.max_output_mb); a large initialized array or table belongs in memory "
                f"allocated at run time")

    def _build_limit_message(self, total: int) -> str:
        return (f"the build's output is over the limit of {self.config.max_build_output_mb} MiB for one build "
                f"(ToolchainConfig.max_build_output_mb): its objects and library hold {total / (1 << 20):.0f} MiB "
                f"or more; nothing of it is kept. A large initialized array or table belongs in memory allocated "
                f"at run time")

    def _network_isolation(self) -> bool:
        if not self.config.isolate_network:
            return False
        with self._lock:
            if self._unshare is None:
                try:
                    r = subprocess.run(["unshare", "--net", "true"], capture_output=True, timeout=10)
                    self._unshare = r.returncode == 0
                except (OSError, subprocess.TimeoutExpired):
                    self._unshare = False
            return self._unshare

    def _gnu_as(self) -> bool:
        """Whether the C++ compiler is GCC, whose assembler (GNU as) writes `--MD` dependencies."""
        return "Free Software Foundation" in self._identity(self.config.cxx, native=True)

    def _trusted_roots(self, with_cuda: bool) -> Roots:
        """System roots left out of manifests: the compiler's, torch's and Python's include
        directories, /usr/include, /usr/lib/gcc, and on the CUDA target CUDA's installation."""
        with self._lock:
            if with_cuda in self._roots:
                return self._roots[with_cuda]
        roots = system_roots(self._resolve(self.config.cxx), self._cuda_home_dir() if with_cuda else None)
        with self._lock:
            self._roots[with_cuda] = roots
        return roots

    def _resolve(self, compiler: str) -> str:
        with self._lock:
            if compiler not in self._paths:
                found = shutil.which(compiler)
                if found is None:
                    raise ToolchainError(f"compiler {compiler!r} was not found on PATH; install it or set "
                                         f"ToolchainConfig.{'nvcc' if 'nvcc' in compiler else 'cxx'}")
                self._paths[compiler] = os.path.realpath(found)
            return self._paths[compiler]

    def _identity(self, compiler: str, native: bool = False) -> str:
        """Path and `--version` of `compiler` (+ what `-march=native` means on this host)."""
        path = self._resolve(compiler)
        tag = f"{compiler}|{native}"
        with self._lock:
            if tag in self._identities:
                return self._identities[tag]
        try:
            ident = path + "\n" + subprocess.run([path, "--version"], capture_output=True, text=True,
                                                 timeout=60).stdout
            if native:
                # the cc1 command line shows the concrete -march/-mtune/feature flags of this CPU
                probe = subprocess.run([path, "-march=native", "-E", "-v", "-x", "c++", "/dev/null"],
                                       capture_output=True, text=True, timeout=60)
                ident += "\n".join(ln for ln in probe.stderr.splitlines() if "cc1" in ln and "-march=" in ln)
        except (OSError, subprocess.TimeoutExpired) as e:
            raise ToolchainError(f"cannot run compiler {path}: {e}") from e
        with self._lock:
            self._identities[tag] = ident
        return ident

    def _cuda_home_dir(self) -> str:
        """CUDA_HOME, else the installation the configured nvcc belongs to (nvcc may be a wrapper)."""
        if self._cuda_home is None:
            home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH")
            if not home:
                nvcc = self._resolve(self.config.nvcc)
                with tempfile.TemporaryDirectory() as d:
                    probe = Path(d) / "probe.cu"
                    probe.touch()
                    r = subprocess.run([nvcc, "--dryrun", "-c", str(probe), "-o", str(Path(d) / "p.o")],
                                       capture_output=True, text=True, timeout=60)
                m = re.search(r"^#\$ TOP=(.+)$", r.stdout + r.stderr, re.MULTILINE)
                home = os.path.normpath(m.group(1)) if m else os.path.dirname(os.path.dirname(nvcc))
            self._cuda_home = home
        return self._cuda_home

    def _cuda_lib_dir(self) -> str:
        home = self._cuda_home_dir()
        lib64 = os.path.join(home, "lib64")
        return lib64 if os.path.isdir(lib64) else os.path.join(home, "lib")

    def _replacements(self, ws: Workspace) -> dict[str, str]:
        repl = {str(ws.root) + "/": "", str(ws.root): ".", str(self.cache_dir): "<cache>"}
        try:
            import torch

            repl[os.path.dirname(torch.__file__)] = "<torch>"
        except ImportError:  # pragma: no cover - torch is a dependency
            pass
        if self._cuda_home:
            repl[self._cuda_home] = "<cuda>"
        return repl


def detect_cuda_arch() -> str | None:
    """`sm_XY` of GPU 0 (`sm_XYa` from Hopper on, to allow arch-specific features), or None."""
    try:
        import torch

        if not torch.cuda.is_available():
            return None
        major, minor = torch.cuda.get_device_capability()
    except Exception:  # noqa: BLE001 - no usable GPU is not an error here
        return None
    return f"sm_{major}{minor}" + ("a" if major >= 9 else "")
