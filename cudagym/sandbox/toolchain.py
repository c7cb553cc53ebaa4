"""Compiling a workspace's kernels into one artifact directory.

`Toolchain(cache_dir, config).build(workspace, target)` compiles every source under `kernels/`
into an object, links the objects, and returns a `CompileResult` whose `artifact_dir` holds
either `libkernels.so` (sources with `extern "C"` launchers, called through ctypes) or the torch
extension `kernel_ext<EXT_SUFFIX>` (when a `kernels/*_binding.cpp` exists). See
`cudagym.runtime` for how a candidate reaches them.

Flags (one place: `_CompilePlan`):

- C++ (``.cpp .cc .c``): ``g++ -O3 -std=c++17 -fPIC -fopenmp -march=native -Ikernels``;
- CUDA (``.cu``, CUDA target only): ``nvcc -O3 -std=c++17 -Xcompiler -fPIC -arch=<arch>
  -ccbin <g++> -Ikernels``; the arch is `config.cuda_arch`, else the GPU's (``sm_XY``, with the
  ``a`` suffix from Hopper on: ``sm_90a``), else ``sm_90a``;
- ``*_binding.cpp`` add what `torch.utils.cpp_extension` gives its own JIT builds: its include
  paths (plus CUDA's on the CUDA target), Python's include dir,
  ``-DTORCH_EXTENSION_NAME=kernel_ext -DTORCH_API_INCLUDE_EXTENSION_H``, the
  ``_GLIBCXX_USE_CXX11_ABI`` torch was built with, and the pybind11 ABI flags where that torch
  still defines them; the other sources of such a workspace get the include paths only;
- link: ``g++ -shared -fopenmp`` (+ ``-lcudart`` with CUDA objects); with a binding, torch's
  libraries (``-lc10 -ltorch -ltorch_cpu -ltorch_python``, + ``-lc10_cuda -ltorch_cuda``) and
  rpaths to torch's and CUDA's library directories.

Why a content-addressed cache instead of ninja (which `load_inline` uses): ninja decides what to
rebuild from file mtimes inside one build directory. Every episode has its own workspace, and RL
rollouts write the same files again and again (a rewrite with identical content gets a new
mtime), so ninja would recompile sources that did not change and could share nothing between
workspaces. Here objects live in the two-level cache of `cudagym.sandbox.deps` under
`objects/`: the first key hashes what is known before compiling (compiler identity, flags, the
source's path and bytes, torch's version for sources built against it), and each variant under
it holds an object with the manifest of the files the compiler reported reading (`-MD -MF`,
plus GNU as's `--MD` for `.incbin`), each with its sha256. A lookup takes the variant whose
files match the workspace's, so an unchanged source is compiled once per cache, whichever
workspace or episode it appears in; an edited header recompiles only the sources that include
it; and a source whose included file differs (a `table.inc` of other values) gets an object of
its own. System headers (the compiler's own directories and the `-isystem` torch/CUDA/Python
directories, which `ToolchainConfig`, not the candidate, controls) are covered by the compiler
identity and torch's version. A linked artifact is named by the hash of its objects' full keys
(first key and variant) and the link flags. Compilers run with the workspace as working
directory and workspace-relative paths, so flags and diagnostics are the same for every
workspace. Objects and artifacts are written under a temporary name and renamed into place,
never overwritten, so concurrent builds of the same key are safe.

Builds read only what they declare. A build never compiles in the workspace, which a job that
ran candidate code may have written: it copies `kernels/` into a private directory under the
cache (`src/`, written by nothing else) and compiles there. The copy leaves out what a compiler
would read without reporting it: precompiled headers (`*.gch`/`*.pch`, directories of them, and
files that begin with GCC's or clang's PCH magic), and everything that is not a regular file
(symlinks, FIFOs); it is bounded (`max_source_mb`, `max_source_files`). The first key covers the
names of every file in the copy, because a file's mere existence can change a build without
being read (`__has_include`, a header created in a directory searched before the one that was
read); the manifest covers the contents of what was read. So the compiler can open only the
copy's files (names in the key, contents in the manifest) and trusted roots (the compiler
identity and torch's version).

Bounded: every file a compiler or the linker writes (object, library, temporaries) is limited
to `max_output_mb` (RLIMIT_FSIZE, through `prlimit`), and a build that hits it fails with an
error that says so; what one build adds to the cache (its new objects and its library) is
limited to `max_build_output_mb`: objects are stored only once every compile of the build is
done and their sum is within it (compiles not yet started are skipped once it is passed), and
a library that takes the sum past it is not stored, nor are the objects this build stored; the
whole cache (objects, artifacts and `load_inline` modules) is kept under `max_cache_mb` by
evicting the least recently used entries (`CacheBound`), sparing those used in the last
`evict_grace_s` (a job may be loading them) only while that keeps the cache within
`max_cache_mb + max_build_output_mb`. Entries are immutable: written
under a temporary name and renamed into place, files read-only, the digests of their outputs
recorded and checked when they are used.

Compilers run with a scrubbed environment (PATH, HOME and TMPDIR in the build's private
directory, LANG/LC_ALL=C), in their own process group (killed on `config.timeout_s`), and
inside ``unshare --net`` where that works, so a compile cannot reach the network.
"""

from __future__ import annotations

import asyncio
import hashlib
import os
import re
import shutil
import signal
import stat
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
from cudagym.sandbox.deps import (Roots, UnrecordedDependency, VariantStore, outputs_intact, parse_depfile,
                                  record, seal_outputs, system_roots)
from cudagym.runtime import EXTENSION_NAME, LIBRARY_NAME
from cudagym.sandbox.workspace import Workspace
from cudagym.tasks.model import Target

CACHE_FORMAT = "cudagym-build-v4"  # bump to invalidate every cached object and artifact
BINDING_SUFFIX = "_binding.cpp"
MAX_LOG_LINES = 200


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


# -- diagnostics -----------------------------------------------------------------------------

_GCC_DIAG = re.compile(
    r"^(?P<file>[^\s:][^:]*?):(?P<line>\d+)(?::\d+)?: (?P<sev>fatal error|error|warning|note): (?P<msg>.*)$"
)
_NVCC_DIAG = re.compile(
    r"^(?P<file>[^\s(][^(]*?)\((?P<line>\d+)\): (?P<sev>catastrophic error|error|warning|remark)"
    r"(?: #[\w-]+)?: (?P<msg>.*)$"
)
_TOOL_ERROR = re.compile(
    r"^(?:\S*/)?(?P<tool>g\+\+|gcc|c\+\+|cc1plus|nvcc|ptxas|ld|collect2|cicc)(?:\s+(?:fatal|error))?\s*:"
    r"\s*(?:(?:fatal )?error:\s*)?(?P<msg>.*)$"
)
_QUOTES = str.maketrans("\u2018\u2019", "''")  # gcc's UTF-8 quotes, where the locale asks for them
_ERROR_WORD = re.compile(r"\b(error|fatal)\b", re.IGNORECASE)
_LINK_ERROR = re.compile(r"(undefined reference to .*|multiple definition of .*|cannot find -l\S+)")
_NOISE = re.compile(
    r"(In instantiation of|required from|required by substitution|In file included from|"
    r"^\s+from |In function |In member function |At global scope:|In lambda function|"
    r"^compilation terminated|Detected \d+ compilation errors?|errors? detected in the compilation)"
)


def relativize(text: str, replacements: dict[str, str]) -> str:
    """Replace each absolute path prefix in `text` by its short name (longest prefix first)."""
    for prefix in sorted(replacements, key=len, reverse=True):
        if prefix:
            text = text.replace(prefix, replacements[prefix])
    return text


def parse_diagnostics(output: str, max_lines: int) -> list[str]:
    """Readable error lines (`file:line: error: message`) from gcc / nvcc / linker output.

    Warnings, notes and template-instantiation chains are dropped; duplicates are collapsed.
    `output` should already be relativized.
    """
    errors: list[str] = []
    for raw in output.splitlines():
        line = raw.rstrip()
        if not line or _NOISE.search(line):
            continue
        m = _GCC_DIAG.match(line) or _NVCC_DIAG.match(line)
        if m:
            sev = m["sev"]
            if sev in ("warning", "note", "remark"):
                continue
            sev = "error" if sev == "catastrophic error" else sev
            entry = f"{m['file']}:{m['line']}: {sev}: {m['msg'].strip().translate(_QUOTES)}"
        elif (lm := _LINK_ERROR.search(line)) and ("ld" in line or ".o" in line or "in function" in line):
            entry = f"link: error: {lm.group(1).strip()}"
        elif (tm := _TOOL_ERROR.match(line)) and _ERROR_WORD.search(line):
            msg = tm["msg"].strip()
            if not msg or msg.startswith("ld returned"):
                continue
            entry = f"{tm['tool']}: error: {msg}"
        else:
            continue
        if entry not in errors:
            errors.append(entry)
        if len(errors) >= max_lines:
            break
    return errors


def trim_log(output: str, max_lines: int = MAX_LOG_LINES) -> str:
    """The compiler output without instantiation noise, at most `max_lines` lines."""
    lines = [ln.rstrip() for ln in output.splitlines() if ln.strip() and not _NOISE.search(ln)]
    if len(lines) > max_lines:
        lines = lines[:max_lines] + [f"... ({len(lines) - max_lines} more lines)"]
    return "\n".join(lines)


# -- running compilers -----------------------------------------------------------------------


@dataclass
class _Run:
    returncode: int
    output: str
    timed_out: bool = False


def _run(argv: list[str], cwd: Path, env: dict[str, str], timeout_s: float) -> _Run:
    """Run `argv` in its own process group; kill the whole group on timeout."""
    proc = subprocess.Popen(
        argv, cwd=cwd, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT, start_new_session=True,
    )
    try:
        out, _ = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        out, _ = proc.communicate()
        return _Run(-signal.SIGKILL, out.decode(errors="replace"), timed_out=True)
    return _Run(proc.returncode, out.decode(errors="replace"))


def _sha256(*parts: bytes | str) -> str:
    h = hashlib.sha256()
    for p in parts:
        b = p.encode() if isinstance(p, str) else p
        h.update(len(b).to_bytes(8, "little"))
        h.update(b)
    return h.hexdigest()


# -- what a build may read: a private copy of the declared sources ---------------------------

PCH_SUFFIXES = (".gch", ".pch")
PCH_MAGIC = (b"gpch", b"CPCH")  # GCC's and clang's precompiled headers begin with these
SKIPPED_DIRS = ("__pycache__",)  # Python's bytecode, which an import may write meanwhile


@dataclass
class SourceCopy:
    """The files of a workspace that a build may read, copied to `root` (same relative paths).

    `listing` hashes the names of every file copied (see the module docstring: existence matters);
    `left_out` names what was not copied and why; `error` is set when the copy is over its bounds."""

    root: Path
    listing: str = ""
    files: list[str] = field(default_factory=list)
    left_out: list[str] = field(default_factory=list)
    error: str | None = None


def copy_sources(workspace: Path, root: Path, dirs: tuple[str, ...] = ("kernels",), files: tuple[str, ...] = (),
                 *, max_bytes: int, max_files: int) -> SourceCopy:
    """Copy `workspace`'s `dirs` (recursively) and `files` to a fresh `root`, leaving out
    precompiled headers and anything that is not a regular file; read-only copies. Never follows
    a symlink and never opens a FIFO or a device."""
    out = SourceCopy(root)
    root.mkdir(parents=True)
    total = 0
    for rel in _candidates(workspace, dirs, files, out.left_out):
        if len(out.files) >= max_files:
            out.error = f"kernels/ holds more than {max_files} files; a build reads at most {max_files}"
            return out
        why, data = _read_source(workspace / rel, max_bytes - total)
        if why == "missing":
            continue
        if why:
            if why.startswith("over"):
                out.error = f"{rel}: the files under kernels/ hold more than {max_bytes >> 20} MiB; a build " \
                            f"reads at most that much"
                return out
            out.left_out.append(f"{rel} ({why})")
            continue
        dest = root / rel
        dest.parent.mkdir(parents=True, exist_ok=True)
        dest.write_bytes(data)
        dest.chmod(0o444)
        total += len(data)
        out.files.append(rel)
    out.listing = _sha256(*sorted(out.files))
    return out


def source_listing(workspace: Path, dirs: tuple[str, ...] = ("kernels",), files: tuple[str, ...] = ()) -> str:
    """`copy_sources(...).listing` without copying (bounds aside): the names it would copy."""
    names = []
    for rel in _candidates(workspace, dirs, files, []):
        why, _ = _read_source(workspace / rel, len(max(PCH_MAGIC, key=len)), head=True)
        if why is None:
            names.append(rel)
    return _sha256(*sorted(names))


def _candidates(workspace: Path, dirs: tuple[str, ...], files: tuple[str, ...], left_out: list[str]) -> list[str]:
    """`files` and the files under `dirs` (not under symlinked, `__pycache__` or `.gch` directories,
    which go to `left_out`), relative to `workspace`, sorted."""
    wanted: list[str] = list(files)
    for d in dirs:
        top = workspace / d
        if top.is_symlink() or not top.is_dir():
            continue
        for cur, subdirs, names in os.walk(top, followlinks=False):
            rel_dir = Path(cur).relative_to(workspace).as_posix()
            subdirs.sort()
            for sd in list(subdirs):
                path = Path(cur) / sd
                if sd in SKIPPED_DIRS:
                    subdirs.remove(sd)
                elif path.is_symlink() or sd.endswith(PCH_SUFFIXES):
                    subdirs.remove(sd)
                    left_out.append(f"{rel_dir}/{sd}/ ({'a symlink' if path.is_symlink() else 'precompiled headers'})")
            wanted.extend(f"{rel_dir}/{n}" for n in sorted(names))
    return wanted


def _read_source(path: Path, room: int, head: bool = False) -> tuple[str | None, bytes]:
    """(why it is left out, or None; its bytes) for one file of a source copy (`head`: only its
    first `room` bytes are wanted)."""
    if path.name.endswith(PCH_SUFFIXES):
        return "a precompiled header", b""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        return "missing", b""
    except OSError:
        return "not a regular file", b""
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            return "not a regular file", b""
        if st.st_size > room and not head:
            return "over", b""
        with os.fdopen(os.dup(fd), "rb") as fh:
            data = fh.read(room + 1)
    finally:
        os.close(fd)
    if len(data) > room and not head:
        return "over", b""
    if data.startswith(PCH_MAGIC):
        return "a precompiled header", b""
    return None, data


# -- the cache's bound --------------------------------------------------------------------------


class CacheBound:
    """Keeps a build cache's entries (objects/<key>/<variant>, artifacts/<key>,
    inline/<key>/<variant>) under `max_bytes` by evicting the least recently used (an entry's
    directory mtime, set when it is stored or used: `touch`). Entries used in the last `grace_s`
    are kept while that leaves the cache within `max_bytes + slack_bytes` (`slack_bytes`: what
    one build may add); past that the least recently used go whatever their age, except those
    `enforce(keep=...)` names (the build's own library). So the grace period can keep the cache
    over its bound by at most `slack_bytes` plus what `keep` holds. A scan of the cache is skipped
    while this process's running total (the last scan plus what it stored since,
    `enforce(added)`) is under the bound, for at most `rescan_s` (other processes store too)."""

    LAYOUT = (("objects", 2), ("artifacts", 1), ("inline", 2))  # (subdirectory, depth of an entry)

    def __init__(self, root: Path, max_bytes: int, grace_s: float, rescan_s: float = 60.0,
                 slack_bytes: int = 256 << 20):
        self.root = Path(root)
        self.max_bytes = max_bytes
        self.grace_s = grace_s
        self.slack_bytes = slack_bytes
        self.rescan_s = rescan_s
        self._lock = threading.Lock()
        self._total: int | None = None  # bytes at the last scan, plus what was stored since
        self._scanned = 0.0

    @staticmethod
    def touch(entry: Path) -> None:
        try:
            os.utime(entry)
        except OSError:  # a read-only view of the cache (a candidate's job): nothing to record
            pass

    def entries(self) -> list[tuple[float, int, Path]]:
        """(last use, bytes, path) of every entry."""
        out = []
        for sub, depth in self.LAYOUT:
            level = [self.root / sub]
            for _ in range(depth):
                level = [c for d in level if d.is_dir() for c in d.iterdir() if not c.name.startswith(".")]
            for e in level:
                try:
                    size = sum(f.stat().st_size for f in e.rglob("*") if f.is_file())
                    out.append((e.stat().st_mtime, size, e))
                except OSError:
                    continue
        return out

    def total_bytes(self) -> int:
        return sum(size for _, size, _ in self.entries())

    @staticmethod
    def size_of(*entries: Path | None) -> int:
        return sum(f.stat().st_size for e in entries if e is not None and e.is_dir() for f in e.rglob("*")
                   if f.is_file())

    def enforce(self, added: int | None = None, keep: tuple[Path | None, ...] = ()) -> list[Path]:
        """Evict least recently used entries until the cache is under its bound; the evicted.
        `added`: the bytes this process just stored, when known; `keep`: entries never evicted
        now (see the class docstring)."""
        with self._lock:
            now = time.time()
            if (added is not None and self._total is not None and self._total + added <= self.max_bytes
                    and now - self._scanned < self.rescan_s):
                self._total += added
                return []
            entries = sorted(self.entries(), key=lambda e: e[0])
            total = sum(size for _, size, _ in entries)
            kept = {Path(k) for k in keep if k is not None}
            evicted: list[Path] = []
            # first past entries out of their grace period; then, while the cache is over its
            # bound by more than one build's output, the graced ones too
            for limit, graced in ((self.max_bytes, False), (self.max_bytes + self.slack_bytes, True)):
                for used, size, path in entries:
                    if total <= limit:
                        break
                    if path in kept or path in evicted or (not graced and now - used < self.grace_s):
                        continue
                    _remove_tree(path)
                    evicted.append(path)
                    total -= size
                    if path.parent.name not in ("objects", "artifacts", "inline"):
                        try:
                            path.parent.rmdir()  # a key left without variants
                        except OSError:
                            pass
            self._total, self._scanned = total, now
            return evicted


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:
        return True
    return True


def _remove_tree(path: Path) -> None:
    """Remove a cache entry (its files are read-only; its directories are not)."""
    tmp = path.with_name(f".evict-{uuid.uuid4().hex[:12]}")
    try:
        os.rename(path, tmp)  # gone from lookups at once
    except OSError:
        return
    shutil.rmtree(tmp, ignore_errors=True)


# -- the toolchain ---------------------------------------------------------------------------


class _OutputBudget:
    """What one build's new objects hold, against `max_build_output_mb` (thread-safe)."""

    def __init__(self, limit: int):
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

    def __init__(self, cache_dir: Path, config: ToolchainConfig | None = None):
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
            note = "not copied for the build (a build reads only regular source files): " + ", ".join(copy.left_out[:20])
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
                            c.variant = self._objects.store(c.key, manifest,
                                                            lambda d, obj=obj: os.replace(obj, d / OBJECT_FILE),
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
                _remove_tree(entry)
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
            key = _sha256(CACHE_FORMAT, ident, "\0".join(argv), rel, src, torch_version if torch_inc else "", listing)
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
                f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}"]
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
            run = _run(self._wrap([*c.argv, *self._dependency_flags(c, scratch), "-c", c.rel, "-o", str(obj)]),
                       ws.root, env, self.config.timeout_s)
            repl = self._replacements(ws)
            repl[str(obj)] = f"{c.rel}.o"
            out = relativize(run.output, repl)
            if run.timed_out:
                return False, trim_log(out), [f"{c.rel}: error: compile timed out after {self.config.timeout_s:g} s"], None
            if run.returncode != 0 or not obj.is_file():
                if _over_output_limit(run):
                    return False, trim_log(out), [f"{c.rel}: error: {self._output_limit_message()}"], None
                errs = parse_diagnostics(out, self.config.max_error_lines) or _fallback_error(c.rel, out, run)
                return False, trim_log(out), errs, None
            if not budget.add(obj.stat().st_size):
                return False, trim_log(out), [], None  # the build fails for its total (see `_build`)

            def listed(name: str) -> list[str]:
                f = scratch / name
                return parse_depfile(f.read_text(errors="replace")) if f.is_file() else []

            try:
                manifest = record(listed("cpp.d"), cwd=ws.root, workspace=ws.root, trusted=plan.trusted,
                                  exclude=Roots([str(scratch), str(ws.build_dir / "tmp")]), assembler=listed("as.d"))
            except UnrecordedDependency as e:
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
        key = _sha256(CACHE_FORMAT, self._identity(self.config.cxx, native=True), "\0".join(plan.link_argv),
                      "\0".join(plan.link_libs), plan.output_name, *(c.object_key for c in plan.compiles))
        final = self.cache_dir / "artifacts" / key
        if (final / plan.output_name).is_file():
            if outputs_intact(final):
                CacheBound.touch(final)
                return final, False, "", []
            _remove_tree(final)  # changed since it was stored: built again
        staging = self.cache_dir / "artifacts" / f".tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        staging.mkdir(parents=True)
        objects = [str(c.object_path) for c in plan.compiles]
        argv = [*plan.link_argv, "-o", str(staging / plan.output_name), *objects, *plan.link_libs]
        run = _run(self._wrap(argv), ws.root, env, self.config.timeout_s)
        repl = self._replacements(ws)
        repl.update({str(c.object_path): f"{c.rel}.o" for c in plan.compiles})
        repl[str(staging)] = "<artifact>"
        out = relativize(run.output, repl)
        if run.timed_out or run.returncode != 0 or not (staging / plan.output_name).is_file():
            shutil.rmtree(staging, ignore_errors=True)
            if run.timed_out:
                return None, True, trim_log(out), [f"link: error: timed out after {self.config.timeout_s:g} s"]
            if _over_output_limit(run):
                return None, True, trim_log(out), [f"link: error: {self._output_limit_message()}"]
            errs = parse_diagnostics(out, self.config.max_error_lines) or _fallback_error("link", out, run)
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


_OUTPUT_LIMIT = re.compile(r"File size limit exceeded|File too large|file too large|signal 25\b|SIGXFSZ")


def _over_output_limit(run: _Run) -> bool:
    """Whether a failed compiler or linker run hit RLIMIT_FSIZE (SIGXFSZ, or EFBIG on a write)."""
    return run.returncode in (-signal.SIGXFSZ, 128 + signal.SIGXFSZ) or bool(_OUTPUT_LIMIT.search(run.output))


def _fallback_error(rel: str, output: str, run: _Run) -> list[str]:
    """When no diagnostic could be parsed: the last lines of the output, or the exit status."""
    tail = [ln.strip() for ln in output.splitlines() if ln.strip()][-3:]
    if tail:
        return [f"{rel}: error: {ln}" for ln in tail]
    return [f"{rel}: error: the compiler exited with status {run.returncode}"]


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
