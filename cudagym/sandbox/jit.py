"""The job's JIT caches, and which kernel images loaded from memory are the candidate's own.

Triton, `torch.compile` (inductor, whose GPU kernels Triton compiles) and CuPy compile at run time
in the candidate's process, into caches named by environment variables (`JIT_CACHES`). A worker
points them into what its job may write (`jit_cache_env`); a workspace job's scratch is the
workspace's `.build/tmp/` (`workspace_scratch`), which the parent can read once the job is over.

**Triton kernels as the candidate's own (permissive mode).** Triton loads each compiled kernel's
cubin from memory (`cuModuleLoadData`), so the kernel-origin audit (`origin.cpp`) names it
`<memory:DIGEST>`, the digest of the image's bytes. After the job, `own_jit_images` reads the
job's Triton cache: one directory per compiled kernel holding `<name>.json` (metadata),
`<name>.ttir` (Triton IR) and `<name>.cubin`. A kernel is the candidate's when its IR places its
entry function (`tt.func public @name ... loc("file":line:col)`) at the `def name` of a function
decorated with `jit`, in a file inside the workspace and outside `.build/` (parsed, never run);
its cubin's digest then names an own image, and the records of launches from that image count as
own kernels (`cudagym.core.audit.Origins.own_images`).
`torch.compile`'s kernels stay foreign: the Triton source inductor generates lies in its cache
under `.build/tmp/inductor/`, which is no candidate source, and where inductor loads a cubin by
file name the origin is that file, which is no own root.

What it rests on: the cache is written by the candidate's own process, so the parent reads it as a
claim, checked only for consistency (a digest of what was loaded, a `def` where the IR says). A
candidate that writes an entry for a cubin of torch's generated code, with IR naming a function of
its own, gets that kernel counted as its own; so does one that copies inductor's generated Triton
source into its workspace and launches it from there, which this rule admits by design: source in
the workspace is the candidate's, however it came to be written (as a `load_inline` build compiles
whatever source text the candidate's code hands it). Permissive mode's share rule judges whose code
does the work, not where the policy found the code. Strict mode relies on none of it: it counts no
image loaded from memory as own (JIT output made in the candidate's process cannot be told from a
copy), so a Triton candidate does not pass strict mode. What strict mode would need: the cubins
compiled by a trusted job that runs no candidate code and filed in the build cache, an own root;
Triton specializes a kernel by running the candidate's Python (its globals, constexprs, helper
functions), so such a job is not Triton as its users run it.

**CuPy kernels as the candidate's own (permissive mode).** CuPy compiles a `RawKernel`'s or
`RawModule`'s source string with NVRTC into a cubin that it loads from memory (`<memory:DIGEST>`
too), and files it in its cache as `<key>.cubin`: the SHA-1 of the payload in hex, then the
payload (the cubin, after the mangled names when the module has name expressions). The job's
environment asks CuPy to save the source beside it (`<key>.cubin.cu`, `JIT_ENV`). A kernel is the
candidate's when that source is, up to indentation and surrounding blank lines, a string literal
of a Python file in the workspace outside `.build/` (parsed, never run) or the whole text of such a
file (a `.cu` it reads); its cubin's digest then names an own image, as for Triton. The source has
no location to point at (NVRTC compiles a string), so the text itself is the claim: source
assembled at run time (an f-string, `str.format`, CuPy's `ElementwiseKernel` and
`ReductionKernel`, whose source is CuPy's template around the candidate's snippet, and CuPy's own
routines) matches no file and counts as foreign. The same limits as Triton's hold: the cache is
the candidate's process's claim, and strict mode counts no CuPy kernel.

**What one attribution may cost the parent.** Everything it reads was written by the
candidate's job, so one attribution (`jit_attribution`) is bounded, whatever the job wrote: each
file is read and parsed at most once (memo by real path: a thousand cache entries naming one
source parse it once), a source file over `MAX_SOURCE_BYTES` is not parsed (`ast.parse` holds the
GIL throughout, about 0.3 s a MiB of dense literals, so this bounds the longest pause it causes),
at most `MAX_KERNELS` cache entries are judged, and all reads together stop at
`ATTRIBUTION_BYTES` or `ATTRIBUTION_SECONDS` (checked before each read and parse, so one parse may
run past the time). Once the budget is spent nothing more is read: the entries not yet judged get
no own credit, and `JitImages.unattributed` says why, for the audit's reasons. The parent runs the
attribution off its event loop (in a thread, as the audit that calls it: `Evaluator`).

With the docker backend the job's copy of the workspace, its scratch included, is discarded with
the container: there is no JIT cache to read, and Triton and CuPy kernels count as foreign there.
"""

from __future__ import annotations

import ast
import hashlib
import json
import os
import re
import stat
import struct
import textwrap
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from itertools import islice
from pathlib import Path

from cudagym.sandbox.origin import image_digest, image_extent

# Environment variable -> the directory under the job's scratch that it names.
JIT_CACHES = {"TORCHINDUCTOR_CACHE_DIR": "inductor", "TRITON_CACHE_DIR": "triton", "CUPY_CACHE_DIR": "cupy"}
# Set beside them: CuPy then saves each kernel's source beside its cubin (read by `cupy_kernels`).
JIT_ENV = {"CUPY_CACHE_SAVE_CUDA_SOURCE": "1"}
BUILD_DIR = ".build"  # the workspace's build tree and scratch: the harness's, never candidate source

# Bounds on what the parent reads of a cache the candidate's process wrote (`Reading`).
MAX_KERNELS = 4096  # cache entries judged (Triton's metadata files, CuPy's cubins), per cache
MAX_FILE_BYTES = 64 << 20
MAX_SOURCE_FILES = 1024  # workspace files searched for a CuPy kernel's source text
MAX_SOURCE_BYTES = 1 << 20  # a candidate source file read or parsed; larger ones are not
ATTRIBUTION_BYTES = 64 << 20  # all the files one attribution reads, cache entries and sources together
ATTRIBUTION_SECONDS = 10.0


def workspace_scratch(workspace: str | Path) -> Path:
    """The scratch directory (TMPDIR, JIT caches) of a job that runs in `workspace`."""
    return Path(workspace) / BUILD_DIR / "tmp"


def jit_cache_env(root: str | Path) -> dict[str, str]:
    """The JIT cache variables pointing under `root`, and `JIT_ENV`."""
    return {**{var: os.path.join(root, sub) for var, sub in JIT_CACHES.items()}, **JIT_ENV}


@dataclass(frozen=True)
class TritonKernel:
    """One compiled kernel in a Triton cache: its name, the digest of its cubin as origin.cpp
    names the image loaded from memory, and where its IR places its entry function."""

    name: str
    digest: str
    source: str  # the file the IR names ("" if none could be read)
    line: int
    entry: Path  # the cache directory of this kernel


def _size(path: Path) -> int:
    try:
        return os.lstat(path).st_size
    except OSError:
        return 0


def _read(path: Path, limit: int = MAX_FILE_BYTES) -> bytes | None:
    """A regular file's bytes (no link followed, nothing that could block), None otherwise."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError:
        return None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_size > limit:
            return None
        with os.fdopen(fd, "rb", closefd=False) as f:
            return f.read(limit + 1)[:limit]
    except OSError:
        return None
    finally:
        os.close(fd)


@dataclass(frozen=True)
class ParsedSource:
    """What the rules need of one Python source file, from one parse: its `def`s under a decorator
    that names `jit` as (name, line of the `def`), and its string literals, normalized."""

    jit_defs: frozenset[tuple[str, int]]
    literals: frozenset[str]


@dataclass
class Reading:
    """One attribution's reads of the files the candidate's job wrote: each read (`read`) and
    each Python file parsed (`parsed`) at most once, by real path, within a budget of bytes (all
    reads together) and seconds (`clock`, from the first read). Once spent, nothing more is read
    (both return None) and `spent` says why; `parses` counts the parses done."""

    max_bytes: int = ATTRIBUTION_BYTES
    max_seconds: float = ATTRIBUTION_SECONDS
    clock: Callable[[], float] = time.monotonic
    spent: str = ""
    parses: int = 0
    bytes_read: int = 0
    skipped: list[str] = field(default_factory=list)  # what was left unread within the budget, and why
    _began: float | None = None
    _texts: dict[str, bytes | None] = field(default_factory=dict)
    _parsed: dict[str, ParsedSource | None] = field(default_factory=dict)

    def within(self) -> bool:
        """Whether the budget's time is not yet spent (starting its clock)."""
        now = self.clock()
        if self._began is None:
            self._began = now
        if not self.spent and now - self._began > self.max_seconds:
            self.spent = f"its {self.max_seconds:g} s were spent"
        return not self.spent

    def read(self, path: Path, limit: int = MAX_FILE_BYTES) -> bytes | None:
        """`_read(path, limit)`, once per real path, counted against the budget; None once spent."""
        key = f"{os.path.realpath(path)}\0{limit}"
        if key in self._texts:
            return self._texts[key]
        if not self.within():
            return None
        if min(_size(path), limit) > self.max_bytes - self.bytes_read:
            self.spent = f"its {self.max_bytes >> 20} MiB of files read were spent"
            return None
        data = _read(path, limit)
        self.bytes_read += len(data or b"")
        self._texts[key] = data
        return data

    def parsed(self, path: Path) -> ParsedSource | None:
        """The Python file at `path` parsed (never run), once per real path; None where it cannot
        be read or parsed, is over `MAX_SOURCE_BYTES` (noted in `skipped`) or the budget is spent."""
        real = os.path.realpath(path)
        if real in self._parsed:
            return self._parsed[real]
        raw = self.read(Path(real), MAX_SOURCE_BYTES)
        if raw is None and not self.spent and _size(Path(real)) > MAX_SOURCE_BYTES:
            self.skipped.append(f"{path} (over {MAX_SOURCE_BYTES >> 20} MiB, not parsed)")
        if raw is None or not self.within():
            return None if self.spent else self._parsed.setdefault(real, None)
        self.parses += 1
        try:
            try:
                tree = ast.parse(raw)
            except SystemError:  # CPython 3.11's AST depth check, off when threads parse at once: again
                tree = ast.parse(raw)
        except (SyntaxError, ValueError, MemoryError, RecursionError, SystemError):
            self._parsed[real] = None
            return None
        found = ParsedSource(
            jit_defs=frozenset((n.name, n.lineno) for n in ast.walk(tree) if isinstance(n, ast.FunctionDef)
                               and any("jit" in ast.unparse(d) for d in n.decorator_list)),
            literals=frozenset(_normalized(n.value) for n in ast.walk(tree)
                               if isinstance(n, ast.Constant) and isinstance(n.value, str) and n.value.strip()))
        self._parsed[real] = found
        return found

    def unattributed(self) -> str:
        """Why some of the job's kernels got no own credit without being judged ("" if none)."""
        why = []
        if self.spent:
            why.append(f"the own-kernel attribution stopped once {self.spent} (budget ATTRIBUTION_BYTES, "
                       "ATTRIBUTION_SECONDS of cudagym.sandbox.jit): the JIT cache entries and source files not "
                       "read by then got no own credit")
        if self.skipped:
            why.append("not judged, so not credited: " + "; ".join(self.skipped[:4])
                       + (f" and {len(self.skipped) - 4} more" if len(self.skipped) > 4 else ""))
        return "; ".join(why)


_ALIAS = re.compile(r"^#(loc\d*) = loc\((.*)\)\s*$", re.MULTILINE)
_FILE_LOC = re.compile(r'^"((?:[^"\\]|\\.)*)":(\d+):\d+$')
_NAMED_LOC = re.compile(r'^"(?:[^"\\]|\\.)*"\((.*)\)$')
_CALLSITE = re.compile(r"^callsite\((.*?) at (.*)\)$")


def _unescape(text: str) -> str:
    """An MLIR string's text: MLIR prints quotes, backslashes and bytes outside printable ASCII as
    a backslash and two hex digits."""
    raw = re.sub(rb"\\([0-9A-Fa-f]{2})", lambda m: bytes([int(m.group(1), 16)]), text.encode())
    return raw.decode(errors="replace")


def _resolve(expr: str, aliases: dict[str, str], depth: int = 0) -> tuple[str, int] | None:
    """The (file, line) an MLIR location stands for: an alias followed, a named location's inner
    one, a call site's callee; None for unknown or fused locations."""
    expr = expr.strip()
    if depth > 16:
        return None
    if expr.startswith("#"):
        inner = aliases.get(expr[1:])
        return _resolve(inner, aliases, depth + 1) if inner is not None else None
    if m := _FILE_LOC.match(expr):
        return _unescape(m.group(1)), int(m.group(2))
    if m := _NAMED_LOC.match(expr):
        return _resolve(m.group(1), aliases, depth + 1)
    if m := _CALLSITE.match(expr):
        return _resolve(m.group(1), aliases, depth + 1)
    return None


def entry_location(ir: str, name: str) -> tuple[str, int] | None:
    """Where Triton IR (`.ttir`, `.ttgir`) places the definition of its entry function `name`:
    the location of `tt.func ... @name`, printed after the function's closing brace."""
    start = re.search(rf"^([ \t]*)tt\.func\s+(?:public\s+)?@{re.escape(name)}\(", ir, re.MULTILINE)
    if not start:
        return None
    close = re.compile(rf"^{start.group(1)}\}} loc\((.*)\)\s*$", re.MULTILINE).search(ir, start.end())
    if not close:
        return None
    aliases = {m.group(1): m.group(2) for m in _ALIAS.finditer(ir)}
    return _resolve(close.group(1), aliases)


def triton_kernels(cache: Path, reading: Reading | None = None) -> list[TritonKernel]:
    """The compiled kernels of a Triton cache directory (`TRITON_CACHE_DIR`), as its files state
    them; entries without metadata, IR or a readable cubin are left out, and so are those past
    `MAX_KERNELS` metadata files or `reading`'s budget. Nothing is judged here."""
    reading = reading if reading is not None else Reading()
    entries = _triton_entries(cache, reading)
    out = list(islice(entries, MAX_KERNELS))
    if next(entries, None) is not None:
        reading.skipped.append(f"the Triton cache's entries past the first {MAX_KERNELS}")
    return out


def _triton_entries(cache: Path, reading: Reading) -> Iterator[TritonKernel]:
    try:
        with os.scandir(cache) as it:
            groups = sorted(e.path for e in islice(it, MAX_KERNELS) if e.is_dir(follow_symlinks=False))
    except OSError:
        return
    for path in groups:
        group = Path(path)
        try:
            with os.scandir(group) as it:
                metas = sorted(Path(e.path) for e in islice(it, 64)
                               if e.name.endswith(".json") and not e.name.startswith("__grp__"))
        except OSError:
            continue
        for meta_path in metas[:8]:
            if reading.spent:
                return
            raw = reading.read(meta_path, 1 << 20)
            try:
                meta = json.loads(raw) if raw else None
            except ValueError:
                meta = None
            name = meta.get("name") if isinstance(meta, dict) else None
            if not isinstance(name, str) or not name or "/" in name:
                continue
            cubin = reading.read(group / f"{name}.cubin")
            digest = image_digest(cubin) if cubin else None
            if not digest:
                continue
            where = None
            for suffix in (".ttir", ".ttgir"):
                ir = reading.read(group / f"{name}{suffix}", 16 << 20)
                if ir and (where := entry_location(ir.decode(errors="replace"), name)):
                    break
            source, line = where or ("", 0)
            yield TritonKernel(name=name, digest=digest, source=source, line=line, entry=group)


def is_candidate_source(path: str, workspace: Path) -> bool:
    """Whether `path` (absolute, or relative to the workspace) is a file of the candidate's: inside
    the workspace, not under its `.build/`."""
    if not path:
        return False
    root = os.path.realpath(workspace)
    real = os.path.realpath(os.path.join(root, path))
    if not real.startswith(root.rstrip("/") + "/"):
        return False
    return not real.startswith(os.path.join(root, BUILD_DIR) + "/")


def own_triton_kernels(workspace: Path, cache: Path | None = None,
                       reading: Reading | None = None) -> list[TritonKernel]:
    """The kernels of the job's Triton cache (by default `workspace_scratch(workspace)/triton`)
    compiled from the candidate's own source: the IR's entry function is a JIT function of that
    name, defined at the line the IR gives, in a file inside the workspace and outside `.build/`
    (each such file parsed once, within `reading`'s budget: `Reading.parsed`)."""
    cache = cache if cache is not None else workspace_scratch(workspace) / JIT_CACHES["TRITON_CACHE_DIR"]
    reading = reading if reading is not None else Reading()
    out = []
    for k in triton_kernels(cache, reading):
        if not is_candidate_source(k.source, workspace):
            continue
        found = reading.parsed(Path(os.path.realpath(os.path.join(workspace, k.source))))
        if found is not None and (k.name, k.line) in found.jit_defs:
            out.append(k)
    return out


@dataclass(frozen=True)
class CupyKernel:
    """One compiled module in a CuPy kernel cache: the digest of its cubin as origin.cpp names the
    image loaded from memory, and the source CuPy saved beside it ("" if none)."""

    digest: str
    source: str
    entry: Path  # the cache file


_CUPY_HASH_LENGTH = 40  # CuPy's cache files start with the SHA-1 of their payload, in hex
_CUPY_NAMES_MAGIC = b"\x93CUPYNE\x00"  # a payload that carries the mangled names of name expressions


def _cupy_cubin(data: bytes) -> bytes | None:
    """The cubin of a CuPy cache file's bytes (hash, then payload); None where the hash is not
    the payload's or the payload is cut short."""
    stored, payload = data[:_CUPY_HASH_LENGTH], data[_CUPY_HASH_LENGTH:]
    if len(data) < _CUPY_HASH_LENGTH or stored != hashlib.sha1(payload, usedforsecurity=False).hexdigest().encode():
        return None
    if not payload.startswith(_CUPY_NAMES_MAGIC):
        return payload
    pos = len(_CUPY_NAMES_MAGIC)
    if len(payload) < pos + 4:
        return None
    (count,) = struct.unpack_from("<I", payload, pos)
    pos += 4
    for _ in range(count):
        if len(payload) < pos + 4:
            return None
        (size,) = struct.unpack_from("<I", payload, pos)
        pos += 4 + size
    return payload[pos:] if pos <= len(payload) else None


def _loaded_cupy_image(cubin: bytes) -> bytes:
    """The image the driver loads for a CuPy cache entry's cubin. CuPy 14.2 stores NVRTC's ELF
    without its last byte and loads it from a Python `bytes`, whose terminating NUL the driver
    reads in that byte's place: measured on an H100 and an H200 (NVRTC 13.0), the program header
    table ends one byte past the stored payload, and origin.cpp's digest of the loaded image is
    the payload's plus that NUL. Anything else is the image as stored."""
    if cubin[:4] == b"\x7fELF" and image_extent(cubin) is None and image_extent(cubin + b"\0") == len(cubin) + 1:
        return cubin + b"\0"
    return cubin


def cupy_kernels(cache: Path, reading: Reading | None = None) -> list[CupyKernel]:
    """The compiled modules of a CuPy cache directory (`CUPY_CACHE_DIR`), as its files state them;
    files whose hash does not match or whose cubin has no readable extent are left out, and so are
    those past `reading`'s budget. Nothing is judged here."""
    reading = reading if reading is not None else Reading()
    out: list[CupyKernel] = []
    try:
        with os.scandir(cache) as it:
            names = sorted(e.name for e in islice(it, 4 * MAX_KERNELS) if e.name.endswith(".cubin"))
    except OSError:
        return out
    if len(names) > MAX_KERNELS:
        reading.skipped.append(f"the CuPy cache's entries past the first {MAX_KERNELS}")
    for name in names[:MAX_KERNELS]:
        data = reading.read(cache / name)
        cubin = _cupy_cubin(data) if data else None
        digest = image_digest(_loaded_cupy_image(cubin)) if cubin else None
        if not digest:
            if reading.spent:
                break
            continue
        source = reading.read(cache / f"{name}.cu", 16 << 20)
        out.append(CupyKernel(digest=digest, source=source.decode(errors="replace") if source else "",
                              entry=cache / name))
    return out


def _normalized(text: str) -> str:
    return textwrap.dedent(text).strip()


def _workspace_files(root: Path) -> list[Path]:
    """The workspace's files (`root`, a real path) outside `.build/`, in order, at most `MAX_SOURCE_FILES`."""
    files: list[Path] = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if not (Path(dirpath) == root and d == BUILD_DIR))
        files += [Path(dirpath) / f for f in sorted(filenames)]
        if len(files) >= MAX_SOURCE_FILES:
            break
    return files[:MAX_SOURCE_FILES]


def _file_texts(path: Path, root: Path, reading: Reading) -> set[str]:
    """The texts a CuPy kernel's source may be found as in one candidate file: its whole text,
    and a Python file's string literals (`Reading.parsed`), normalized."""
    raw = reading.read(path, MAX_SOURCE_BYTES) if is_candidate_source(str(path), root) else None
    if raw is None:
        return set()
    texts = {_normalized(raw.decode(errors="replace"))}
    if path.suffix == ".py" and (found := reading.parsed(path)) is not None:
        texts |= found.literals
    texts.discard("")
    return texts


def workspace_texts(workspace: Path, reading: Reading | None = None) -> set[str]:
    """The texts a CuPy kernel's source may be found as in the candidate's files (inside the
    workspace, outside `.build/`, no link followed): each Python file's string literals (parsed,
    never run) and each file's whole text, normalized (dedented, stripped)."""
    reading = reading if reading is not None else Reading()
    root = Path(os.path.realpath(workspace))
    return {t for path in _workspace_files(root) for t in _file_texts(path, root, reading)}


def own_cupy_kernels(workspace: Path, cache: Path | None = None, reading: Reading | None = None) -> list[CupyKernel]:
    """The modules of the job's CuPy cache (by default `workspace_scratch(workspace)/cupy`)
    compiled from the candidate's own source: the source CuPy saved is a string literal or a file
    of the workspace, outside `.build/` (`workspace_texts`). The files are searched in order until
    every module's source is found, or `reading`'s budget is spent."""
    cache = cache if cache is not None else workspace_scratch(workspace) / JIT_CACHES["CUPY_CACHE_DIR"]
    reading = reading if reading is not None else Reading()
    kernels = [k for k in cupy_kernels(cache, reading) if k.source.strip()]
    wanted = {_normalized(k.source) for k in kernels}
    found: set[str] = set()
    root = Path(os.path.realpath(workspace))
    for path in _workspace_files(root) if wanted else []:
        if found >= wanted or reading.spent:
            break
        found |= wanted & _file_texts(path, root, reading)
    return [k for k in kernels if _normalized(k.source) in found]


@dataclass(frozen=True)
class JitImages:
    """What one attribution found (`jit_attribution`): the digests of the candidate's own JIT
    images, and why some of the job's kernels got no own credit unjudged ("" if none: `Reading`)."""

    digests: frozenset[str] = frozenset()
    unattributed: str = ""


def jit_attribution(workspace: Path, reading: Reading | None = None) -> JitImages:
    """The in-memory images that count as the candidate's own kernels in permissive mode
    (`Origins.own_images`): its own Triton kernels' and CuPy modules' cubins, judged within one
    budget (`reading`, by default `ATTRIBUTION_BYTES` and `ATTRIBUTION_SECONDS`). Blocking file
    work: a coroutine runs it in a thread."""
    reading = reading if reading is not None else Reading()
    digests = [k.digest for k in own_triton_kernels(workspace, reading=reading)]
    digests += [k.digest for k in own_cupy_kernels(workspace, reading=reading)]
    return JitImages(frozenset(digests), reading.unattributed())


def own_jit_images(workspace: Path) -> frozenset[str]:
    """`jit_attribution`'s digests."""
    return jit_attribution(workspace).digests
