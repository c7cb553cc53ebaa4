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
from dataclasses import dataclass
from itertools import islice
from pathlib import Path

from cudagym.sandbox.origin import image_digest, image_extent

# Environment variable -> the directory under the job's scratch that it names.
JIT_CACHES = {"TORCHINDUCTOR_CACHE_DIR": "inductor", "TRITON_CACHE_DIR": "triton", "CUPY_CACHE_DIR": "cupy"}
# Set beside them: CuPy then saves each kernel's source beside its cubin (read by `cupy_kernels`).
JIT_ENV = {"CUPY_CACHE_SAVE_CUDA_SOURCE": "1"}
BUILD_DIR = ".build"  # the workspace's build tree and scratch: the harness's, never candidate source

# Bounds on what the parent reads of a cache the candidate's process wrote.
MAX_KERNELS = 4096
MAX_FILE_BYTES = 64 << 20
MAX_SOURCE_FILES = 1024  # workspace files searched for a CuPy kernel's source text


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


def triton_kernels(cache: Path) -> list[TritonKernel]:
    """The compiled kernels of a Triton cache directory (`TRITON_CACHE_DIR`), as its files state
    them; entries without metadata, IR or a readable cubin are left out. Nothing is judged here."""
    out: list[TritonKernel] = []
    try:
        with os.scandir(cache) as it:
            groups = sorted(e.path for e in islice(it, MAX_KERNELS) if e.is_dir(follow_symlinks=False))
    except OSError:
        return out
    for path in groups:
        group = Path(path)
        try:
            with os.scandir(group) as it:
                metas = sorted(Path(e.path) for e in islice(it, 64)
                               if e.name.endswith(".json") and not e.name.startswith("__grp__"))
        except OSError:
            continue
        for meta_path in metas[:8]:
            raw = _read(meta_path, 1 << 20)
            try:
                meta = json.loads(raw) if raw else None
            except ValueError:
                meta = None
            name = meta.get("name") if isinstance(meta, dict) else None
            if not isinstance(name, str) or not name or "/" in name:
                continue
            cubin = _read(group / f"{name}.cubin")
            digest = image_digest(cubin) if cubin else None
            if not digest:
                continue
            where = None
            for suffix in (".ttir", ".ttgir"):
                ir = _read(group / f"{name}{suffix}", 16 << 20)
                if ir and (where := entry_location(ir.decode(errors="replace"), name)):
                    break
            source, line = where or ("", 0)
            out.append(TritonKernel(name=name, digest=digest, source=source, line=line, entry=group))
    return out


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


def defines_jit_function(source: bytes, line: int, name: str) -> bool:
    """Whether Python `source` defines a function `name` at line `line` (its `def`) under a
    decorator that names `jit` (`@triton.jit`, `@jit`): parsed, never run."""
    try:
        tree = ast.parse(source)
    except (SyntaxError, ValueError):
        return False
    return any(isinstance(node, ast.FunctionDef) and node.name == name and node.lineno == line
               and any("jit" in ast.unparse(d) for d in node.decorator_list) for node in ast.walk(tree))


def own_triton_kernels(workspace: Path, cache: Path | None = None) -> list[TritonKernel]:
    """The kernels of the job's Triton cache (by default `workspace_scratch(workspace)/triton`)
    compiled from the candidate's own source: the IR's entry function is a JIT function of that
    name, defined at the line the IR gives, in a file inside the workspace and outside `.build/`."""
    cache = cache if cache is not None else workspace_scratch(workspace) / JIT_CACHES["TRITON_CACHE_DIR"]
    out = []
    for k in triton_kernels(cache):
        if not is_candidate_source(k.source, workspace):
            continue
        text = _read(Path(os.path.realpath(os.path.join(workspace, k.source))), 16 << 20)
        if text is not None and defines_jit_function(text, k.line, k.name):
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


def cupy_kernels(cache: Path) -> list[CupyKernel]:
    """The compiled modules of a CuPy cache directory (`CUPY_CACHE_DIR`), as its files state them;
    files whose hash does not match or whose cubin has no readable extent are left out. Nothing is
    judged here."""
    out: list[CupyKernel] = []
    try:
        with os.scandir(cache) as it:
            names = sorted(e.name for e in islice(it, 4 * MAX_KERNELS) if e.name.endswith(".cubin"))
    except OSError:
        return out
    for name in names[:MAX_KERNELS]:
        data = _read(cache / name)
        cubin = _cupy_cubin(data) if data else None
        digest = image_digest(_loaded_cupy_image(cubin)) if cubin else None
        if not digest:
            continue
        source = _read(cache / f"{name}.cu", 16 << 20)
        out.append(CupyKernel(digest=digest, source=source.decode(errors="replace") if source else "",
                              entry=cache / name))
    return out


def _normalized(text: str) -> str:
    return textwrap.dedent(text).strip()


def workspace_texts(workspace: Path) -> set[str]:
    """The texts a CuPy kernel's source may be found as in the candidate's files (inside the
    workspace, outside `.build/`, no link followed): each Python file's string literals (parsed,
    never run) and each file's whole text, normalized (dedented, stripped)."""
    texts: set[str] = set()
    root = Path(os.path.realpath(workspace))
    files: list[Path] = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if not (Path(dirpath) == root and d == BUILD_DIR))
        files += [Path(dirpath) / f for f in sorted(filenames)]
        if len(files) >= MAX_SOURCE_FILES:
            break
    for path in files[:MAX_SOURCE_FILES]:
        raw = _read(path, 4 << 20)
        if raw is None or not is_candidate_source(str(path), root):
            continue
        text = raw.decode(errors="replace")
        texts.add(_normalized(text))
        if path.suffix == ".py":
            try:
                tree = ast.parse(raw)
            except (SyntaxError, ValueError):
                continue
            texts.update(_normalized(n.value) for n in ast.walk(tree)
                         if isinstance(n, ast.Constant) and isinstance(n.value, str) and n.value.strip())
    texts.discard("")
    return texts


def own_cupy_kernels(workspace: Path, cache: Path | None = None) -> list[CupyKernel]:
    """The modules of the job's CuPy cache (by default `workspace_scratch(workspace)/cupy`)
    compiled from the candidate's own source: the source CuPy saved is a string literal or a file
    of the workspace, outside `.build/` (`workspace_texts`)."""
    cache = cache if cache is not None else workspace_scratch(workspace) / JIT_CACHES["CUPY_CACHE_DIR"]
    kernels = [k for k in cupy_kernels(cache) if k.source.strip()]
    if not kernels:
        return []
    texts = workspace_texts(workspace)
    return [k for k in kernels if _normalized(k.source) in texts]


def own_jit_images(workspace: Path) -> frozenset[str]:
    """The digests of the in-memory images that count as the candidate's own kernels in
    permissive mode (`Origins.own_images`): its own Triton kernels' and CuPy modules' cubins."""
    return frozenset([k.digest for k in own_triton_kernels(workspace)]
                     + [k.digest for k in own_cupy_kernels(workspace)])
