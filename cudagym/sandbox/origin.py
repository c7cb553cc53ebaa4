"""Where the candidate's work runs: the kernels its calls launch, by module, and what its built
objects import. Two lines of the audit, beside the dispatcher's op counter (`opwatch`):

**Kernel origin (GPU, in the worker).** `KernelWatch` loads `origin.cpp`, which subscribes to
CUPTI's *callback* API for the launch entry points (runtime and driver, CUDA 13's
`__cudaLaunchKernel` included), graph launches, and module/library loads. It records, while
armed, every kernel a call launches as (how, kernel name, origin file) with launches and threads
(grid x block). The origin is the file the kernel's module image was loaded from (read from the
image's address when the module or library is loaded), never the kernel's name, so a candidate
cannot pass torch's kernel off as its own by naming its own kernel like it; nor the launching host
stub's file: a launch by stub is named by the module of the function it launched, so a kernel of
torch's fatbin registered under a stub of the candidate's library counts as torch's; a CUDA graph's
kernel nodes are read when it is instantiated and recorded at each replay. An image counts as a
file's only where it lies in that file's read-only, never-written bytes (a PT_LOAD segment without
PF_W, and no page of it written: /proc/self/pagemap), where nvcc puts every fatbin: a copy in a
library's .bss or .data, or bytes written over its fatbin after an mprotect, are not the library's.
Any other image is "<memory:DIGEST>" (`image_digest`: SHA-256 of its bytes, their extent from its
header), so an image loaded from memory can be matched to a JIT cache's file after the job:
permissive mode counts the candidate's own Triton kernels that way (`cudagym.sandbox.jit`); strict
mode counts no image loaded from memory. The check costs a loader walk and a pagemap read per
module load (fatbins are not read); only images loaded from memory are hashed. Callbacks run on
the host at launch, not on the device, so kernels run exactly as untraced (CUPTI's *activity*
tracing, which the profiler uses, slowed some kernels 5-12%); the harness arms it in every call
of every phase (verify trials, warm-up, timed calls) alike. Records go to the parent with each
request; the rules (`cudagym.core.audit`) are applied there. Cost (H100, `benchmarks/probe_origin.py`):
a kernel's GPU time is unchanged (11.8 us with the watcher, armed or not, 12.0 without); the host
pays ~0.7 us per launch while disarmed and ~1.7 us while armed, inside the launch window.

What it does not see: kernels launched by device-side graph launch or dynamic parallelism (the
parent kernel is recorded), work a kernel does not announce (a persistent kernel of the
candidate's fed by host writes is its own anyway), an image the candidate embedded in its own
build (bytes compiled into its library count as its own), and another file mapped with MAP_FIXED
over a library's fatbin, or its bytes restored between the driver's read and the watcher's check.
A candidate can disable a callback in its process; `check_alive` notices a disabled callback and a
probe launch that was not seen.

**Imports (both targets, in the parent, before anything runs).** `import_audit` reads the
undefined dynamic symbols of the candidate's built objects (`nm -D`): torch's compute entry
points reached below the dispatcher (`at::native::*`, `at::cpu::*`/`at::cuda::*` per-backend
ops, `at::_ops::<compute op>`, TorchScript's runtime) are forbidden in strict mode; cuBLAS and
cuDNN are allowed from the candidate's own C++ (DESIGN.md), and their kernels then count as
allowed too. What is resolved at run time shows only as the lookup itself, so strict mode forbids
run-time lookup (`dlsym`, `dlopen`, `dladdr`, `dl_iterate_phdr`, ...: a kernel library needs none),
and RecordFunction's switches (the op counter would not see torch ops between a switch off and on
within one call). Not seen: ctypes from Python into torch's libraries, and addresses found without a
lookup import; on the GPU the kernel records still see their kernels, on the CPU the op counter sees
anything that enters the dispatcher.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import re
import struct
import subprocess
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import NamedTuple

from cudagym.errors import ToolchainError
from cudagym.sandbox.native import build_shared

SOURCE = Path(__file__).with_name("origin.cpp")

_INSTALL_FAILURES = {
    -1: "libcupti could not be opened",
    -2: "libcuda could not be opened",
    -3: "a CUPTI or driver function it needs is missing",
    1039: "another CUPTI subscriber (a profiler or debugger) holds the process",
}
_ALIVE_FAILURES = {
    1: "the kernel watcher was never installed",
    2: "one of the kernel watcher's CUPTI callbacks was disabled",
}


def cuda_include_dirs() -> list[str]:
    """Directories holding `cuda.h` and `cupti.h` (CUDA_HOME's, the usual install, CUPTI's extras)."""
    homes = [os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda", "/usr/local/cuda-13.0",
             "/usr/local/cuda-12"]
    dirs: list[str] = []
    for home in filter(None, homes):
        for sub in ("include", "extras/CUPTI/include", "targets/x86_64-linux/include"):
            d = Path(home) / sub
            if d.is_dir() and str(d) not in dirs:
                dirs.append(str(d))
    if not any((Path(d) / "cupti.h").is_file() for d in dirs) or not any((Path(d) / "cuda.h").is_file() for d in dirs):
        raise ToolchainError("cuda.h and cupti.h were not found (set CUDA_HOME): the kernel watcher needs them")
    return dirs


def build_library(cache_dir: Path) -> Path:
    """`cache_dir/opwatch/<key>/liborigin.so`, built from `origin.cpp` if absent (seconds: CUDA's
    and CUPTI's headers only; libcupti and libcuda are opened at install)."""
    flags = ["-O2", "-fPIC", "-shared", "-std=c++17", *(f for d in cuda_include_dirs() for f in ("-isystem", d))]
    return build_shared(cache_dir, SOURCE, flags, ["-ldl"], "cuda-headers\n" + "\n".join(cuda_include_dirs()))


def cupti_path() -> str:
    """The libcupti this process already holds (torch's profiler loads one), else one beside CUDA."""
    with open("/proc/self/maps") as f:
        for line in f:
            path = line.split()[-1] if line.strip() else ""
            if "/libcupti.so" in path:
                return path
    candidates: list[Path] = []
    try:
        import nvidia  # type: ignore[import-not-found]  # pip's CUDA libraries, torch's own

        for root in getattr(nvidia, "__path__", []):
            candidates += sorted(Path(root).glob("*/lib/libcupti.so*"))
    except ImportError:
        pass
    for home in filter(None, (os.environ.get("CUDA_HOME"), "/usr/local/cuda")):
        for sub in ("lib64", "lib", "extras/CUPTI/lib64", "targets/x86_64-linux/lib"):
            candidates += sorted((Path(home) / sub).glob("libcupti.so*"))
    return str(candidates[0]) if candidates else "libcupti.so"


# -- in-memory images (named by digest) ---------------------------------------------------------
# origin.cpp names a module image that lies in no file's read-only, unwritten bytes
# "<memory:DIGEST>": the first 128 bits of the SHA-256 of its bytes, their extent read from its
# header as `image_extent` reads it (the two must agree: tests compare them).
MEMORY_ORIGIN = "<memory:{digest}>"
_MEMORY = re.compile(r"^<memory:([0-9a-f]{32})>$")
_FATBIN_MAGIC = 0xBA55ED50


def image_extent(image: bytes) -> int | None:
    """The length of the module image at the start of `image`: an ELF's furthest header table,
    section or segment; a fatbin's header size plus its size; else NUL-terminated text (PTX).
    None where the header claims more than `image` holds."""
    if image[:4] == b"\x7fELF":
        if len(image) < 0x40 or image[4] != 2:
            return None
        phoff, shoff = struct.unpack_from("<QQ", image, 0x20)
        phentsize, phnum, shentsize, shnum = struct.unpack_from("<HHHH", image, 0x36)
        end = max(0x40, phoff + phnum * phentsize, shoff + shnum * shentsize)
        if end > len(image):
            return None
        for i in range(shnum):
            sh_type, = struct.unpack_from("<I", image, shoff + i * shentsize + 4)
            offset, size = struct.unpack_from("<QQ", image, shoff + i * shentsize + 0x18)
            if sh_type != 8:  # SHT_NOBITS holds no bytes
                end = max(end, offset + size)
        for i in range(phnum):
            offset, = struct.unpack_from("<Q", image, phoff + i * phentsize + 8)
            filesz, = struct.unpack_from("<Q", image, phoff + i * phentsize + 0x20)
            end = max(end, offset + filesz)
    elif len(image) >= 16 and struct.unpack_from("<I", image)[0] == _FATBIN_MAGIC:
        header, size = struct.unpack_from("<HQ", image, 6)
        end = header + size
    else:
        nul = image.find(b"\0")
        end = nul + 1 if nul >= 0 else len(image) + 1
    return end if end <= len(image) else None


def image_digest(image: bytes) -> str | None:
    """The digest origin.cpp gives the same image loaded from memory (None: no readable extent)."""
    end = image_extent(image)
    return hashlib.sha256(image[:end]).hexdigest()[:32] if end else None


def memory_digest(origin: str) -> str | None:
    """The image digest of a "<memory:DIGEST>" origin; None for any other origin."""
    m = _MEMORY.match(origin)
    return m.group(1) if m else None


class KernelRecord(NamedTuple):
    """Kernels of one name and origin launched while armed."""

    via: str  # "launch" (a kernel launch), "graph" (a kernel node of a replayed graph), "host" (a graph's host node)
    name: str  # as CUPTI or the driver names it (mangled)
    origin: str  # the file its module was loaded from; "<memory:DIGEST>", "<memory>" or "<unknown ...>" otherwise
    launches: int
    threads: int  # sum over launches of grid x block
    time_ns: int = 0  # GPU time, in timing mode only (`KernelWatch.timed`)


# Records travel to the parent inside the op counts of each request (which the parent checks only
# grow): one key per record and quantity.
_KEY = "kernel\t{q}\t{via}\t{origin}\t{name}"


def records_as_counts(records: list[KernelRecord]) -> dict[str, int]:
    out: dict[str, int] = {}
    for r in records:
        out[_KEY.format(q="launches", via=r.via, origin=r.origin, name=r.name)] = r.launches
        out[_KEY.format(q="threads", via=r.via, origin=r.origin, name=r.name)] = r.threads
    return out


def records_from_counts(counts: dict[str, int]) -> list[KernelRecord]:
    """The kernel records among `counts` (what `records_as_counts` wrote), in the parent."""
    acc: dict[tuple[str, str, str], list[int]] = {}
    for key, n in counts.items():
        parts = str(key).split("\t")
        if len(parts) != 5 or parts[0] != "kernel" or parts[1] not in ("launches", "threads"):
            continue
        slot = acc.setdefault((parts[2], parts[4], parts[3]), [0, 0])
        slot[0 if parts[1] == "launches" else 1] = int(n)
    return [KernelRecord(via, name, origin, launches, threads)
            for (via, name, origin), (launches, threads) in acc.items()]


# The timed loop's model calls (probes excluded), counted by the worker beside the op counts.
MODEL_CALLS_KEY = "kernel\tcalls"


def is_record_key(key: str) -> bool:
    return str(key).startswith("kernel\t")


class KernelWatch:
    """The loaded kernel watcher. Its C state is per process; hold one per process, and bind what
    the harness needs before any candidate code runs (as for `OpWatch`)."""

    def __init__(self, library: Path) -> None:
        lib = ctypes.CDLL(str(library), mode=ctypes.RTLD_LOCAL)
        for name, restype, argtypes in (
            ("origin_install", ctypes.c_int, [ctypes.c_char_p]),
            ("origin_arm", None, []),
            ("origin_disarm", None, []),
            ("origin_reset", None, []),
            ("origin_state_changes", ctypes.c_uint64, []),
            ("origin_dump", ctypes.c_size_t, [ctypes.c_char_p, ctypes.c_size_t]),
            ("origin_known", ctypes.c_size_t, [ctypes.c_char_p, ctypes.c_size_t]),
            ("origin_probe_begin", None, []),
            ("origin_probe_end", ctypes.c_uint64, []),
            ("origin_alive", ctypes.c_int, []),
            ("origin_timing_begin", ctypes.c_long, [ctypes.c_long]),
            ("origin_timing_end", ctypes.c_long, []),
        ):
            fn = getattr(lib, name)
            fn.restype, fn.argtypes = restype, argtypes
        code = lib.origin_install(cupti_path().encode())
        if code != 0:
            why = _INSTALL_FAILURES.get(code, f"CUPTI refused it (result {code - 1000})" if code > 1000 else str(code))
            raise ToolchainError(f"the kernel watcher could not be installed: {why}")
        self.library = library
        self._lib = lib
        self._state_changes = lib.origin_state_changes()

    @classmethod
    def load(cls, cache_dir: Path) -> KernelWatch:
        """Build (if needed), load and install. Before the process's first CUDA work, so that the
        load of every module after it is seen (modules loaded before are of unknown origin)."""
        return cls(build_library(cache_dir))

    def arm(self) -> None:
        self._lib.origin_arm()
        self._state_changes += 1

    def disarm(self) -> None:
        self._lib.origin_disarm()
        self._state_changes += 1

    def reset(self) -> None:
        self._lib.origin_reset()
        self._state_changes += 1

    def state_changes(self) -> int:
        """The C library's own count of arms, disarms and resets."""
        return int(self._lib.origin_state_changes())

    def _text(self, fn: object) -> str:
        cap = 1 << 14
        while True:
            buf = ctypes.create_string_buffer(cap)
            need = fn(buf, cap)  # type: ignore[operator]
            if need < cap:
                return buf.value.decode(errors="replace")
            cap = need + 4096

    def records(self) -> list[KernelRecord]:
        """Every (via, kernel, origin) recorded since the last reset."""
        out = []
        for line in self._text(self._lib.origin_dump).splitlines():
            via, name, origin, launches, threads, time_ns = line.split("\t")
            out.append(KernelRecord(via, name, origin, int(launches), int(threads), int(time_ns)))
        return out

    def timed(self, fn: object, max_launches: int = 4096) -> list[KernelRecord]:
        """Records of one armed call of `fn()` with each launch's GPU time (an event pair around
        it on its stream: for the permissive share's measured call, never for a timed call)."""
        self.reset()
        if self._lib.origin_timing_begin(max_launches) < 0:
            raise RuntimeError("the kernel watcher could not create its events")
        self.arm()
        try:
            fn()  # type: ignore[operator]
        finally:
            self.disarm()
            n = self._lib.origin_timing_end()
        if n < 0:
            raise RuntimeError("the kernel watcher could not read its events")
        return self.records()

    def known(self) -> str:
        """Diagnostics: the modules and libraries of known origin, and the graphs read."""
        return self._text(self._lib.origin_known)

    def check_alive(self, launch_probe: object) -> str | None:
        """None while the watcher sees launches on this thread; else why not. `launch_probe()`
        launches one kernel of the harness's (not recorded)."""
        code = self._lib.origin_alive()
        if code in _ALIVE_FAILURES:
            return _ALIVE_FAILURES[code]
        self._lib.origin_probe_begin()
        try:
            launch_probe()  # type: ignore[operator]
        finally:
            hits = self._lib.origin_probe_end()
        if hits == 0:
            return "a kernel launched by the harness did not reach the kernel watcher"
        if self._lib.origin_state_changes() != self._state_changes:
            return "the kernel watcher was armed, disarmed or reset by code other than the harness"
        return None


# -- the import audit (parent) ----------------------------------------------------------------
# at::cuda:: functions that are no torch compute: streams, devices, handles, allocators, guards.
_CUDA_UTILITIES = re.compile(
    r"^at::cuda::(getCurrentCUDAStream|getDefaultCUDAStream|getStreamFromPool|setCurrentCUDAStream|"
    r"getCurrentDeviceProperties|getDeviceProperties|device_count|getNumGPUs|is_available|warp_size|"
    r"getCurrentCUDABlasHandle|getCurrentCUDABlasLtHandle|getCUDABlasLtWorkspace\w*|getChosenWorkspaceSize|"
    r"getCurrentCUDASparseHandle|getCurrentCUDASolverDnHandle|getCUDADeviceAllocator|CUDAStream|CUDAEvent|"
    r"detail|blas|getCurrentCUDABlasHandle|canDeviceAccessPeer|check_\w+|get_\w+_error\w*|memcpy_and_sync|"
    r"stream_synchronize|device_synchronize|CUDAGraph|impl)\b")
_PER_BACKEND = re.compile(r"^at::(cpu|cuda|meta|mps|compositeexplicitautograd|compositeexplicitautogradnonfunctional|"
                          r"compositeimplicitautograd|compositeimplicitautogradnestedtensor)::(\w+)\(")
_OPS = re.compile(r"^at::_ops::(\w+)::(call|redispatch)\(")
_NATIVE = re.compile(r"^at::native::")
_SCRIPT = re.compile(r"^torch::jit::")
# Run-time symbol and library lookup: code found this way never shows among the imports (a mangled
# name built at run time reaches at::cpu::gelu_ through dlsym). A kernel library needs none of it:
# its launchers call their kernels, and the runtime it links finds the driver itself.
_RUNTIME_LOOKUP = re.compile(r"^(dlsym|dlvsym|dlopen|dlmopen|dladdr|dladdr1|dlinfo|dl_iterate_phdr|_dl_find_object|"
                             r"_r_debug|__libc_dlsym|__libc_dlvsym|__libc_dlopen_mode|"
                             r"(c10|at)::DynamicLibrary::\w+)$")
# What switches RecordFunction (the op counter's source) off and on, or removes or disables its
# callbacks: torch ops run between such a switch and its reverse within one call are invisible to
# the op counter, which checks its state only between calls. Annotations (RECORD_FUNCTION:
# RecordFunction's constructor, before, end) stay allowed; a callback the candidate adds is the
# harness's concern (it counts registrations: TAMPER).
_RECORD_FUNCTION_SWITCH = re.compile(
    r"^at::(enableRecordFunction|set_record_function_tls_|removeCallback|disableCallback|reenableCallback|"
    r"clearCallbacks|clearGlobalCallbacks|clearThreadLocalCallbacks|ThreadLocalState::setThreadLocalState|"
    r"RecordFunctionGuard::\w+|DisableRecordFunctionGuard::\w+)\b")
# Libraries the candidate's own C++ may call (DESIGN.md), by symbol prefix and by the file name
# their kernels' modules come from.
ALLOWED_LIBRARIES = {"cublasLt": "libcublasLt", "cublas": "libcublas", "cudnn": "libcudnn"}
_OTHER_LIBRARIES = re.compile(r"^(cufft|cusparse|cusolver|curand|nccl|npp|nvjpeg|cutensor)\w*\b")


@lru_cache(maxsize=1)
def _op_names() -> dict[str, str]:
    """at::_ops struct names and at:: function names -> aten op base name, from torch's dispatcher."""
    import torch

    out: dict[str, str] = {}
    for full in torch._C._dispatch_get_all_op_names():  # noqa: SLF001 - torch's dispatcher registry
        ns, _, rest = full.partition("::")
        if ns != "aten":
            continue
        base, _, overload = rest.partition(".")
        out.setdefault(f"{base}_{overload}" if overload else base, base)
        out.setdefault(base, base)
    return out


def _compute_op(name: str) -> str | None:
    """The aten op a function name stands for (`gelu_out` -> gelu), None when no op or allowed."""
    from cudagym.core.audit import STRICT_ALLOWED

    ops = _op_names()
    for candidate in (name, re.sub(r"_(out|outf)$", "", name)):
        base = ops.get(candidate)
        if base is not None:
            return None if base in STRICT_ALLOWED else base
    return None


def undefined_symbols(path: Path) -> list[str]:
    """The demangled undefined dynamic symbols of a shared object (`nm -DC --undefined-only`)."""
    try:
        r = subprocess.run(["nm", "-DC", "--undefined-only", str(path)], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise ToolchainError(f"cannot read the symbols of {path.name}: {e}") from e
    if r.returncode != 0:
        raise ToolchainError(f"cannot read the symbols of {path.name}: {r.stderr.strip()[:300]}")
    out = []
    for line in r.stdout.splitlines():
        parts = line.split(None, 1)
        if len(parts) == 2 and parts[0] in ("U", "w", "v"):
            out.append(parts[1].strip().split("@")[0])
    return out


# The interpreter's ways to run code at the harness's next instruction, on its thread: a pending
# call, a profile or trace function, a signal handler set below `signal.signal`, an exception thrown
# into a thread, a frame's locals written back, an audit hook. A kernel library needs none of them
# (a torch extension imports none); looked up through ctypes, or imported by a built object, in
# either mode, they are refused.
_INTERPRETER_HOOK = re.compile(r"^_?(Py_AddPendingCall|PyEval_SetProfile\w*|PyEval_SetTrace\w*|PyFrame_LocalsToFast"
                               r"|PyThreadState_SetAsyncExc|PyOS_setsig|PySys_AddAuditHook|PyErr_SetInterrupt\w*"
                               r"|PyUnstable_\w*Watcher\w*|Py\w*_AddWatcher)$")


def interpreter_hook(symbol: str) -> bool:
    """Whether `symbol` is one of the interpreter's ways to run code inside the harness's Python."""
    return bool(_INTERPRETER_HOOK.match(symbol.split("@")[0]))


def forbidden_import(symbol: str) -> str | None:
    """Why strict mode forbids the candidate's objects to import `symbol`; None if allowed."""
    if _RUNTIME_LOOKUP.match(symbol.split("(")[0]):
        return ("run-time symbol lookup, which reaches code (torch's below the dispatcher) that no import shows; "
                "a kernel library has no need for it")
    if _RECORD_FUNCTION_SWITCH.match(symbol):
        return ("switches RecordFunction or its callbacks, which the op counter watches torch ops through; "
                "a kernel library has no need for it")
    if _NATIVE.match(symbol):
        return "torch's native kernel, called below the dispatcher"
    if _SCRIPT.match(symbol):
        return "TorchScript's runtime (runs torch ops)"
    if m := _OPS.match(symbol):
        op = _compute_op(m.group(1))
        return f"the torch compute op aten::{op}" if op else None
    if m := _PER_BACKEND.match(symbol):
        if m.group(1) == "cuda" and _CUDA_UTILITIES.match(symbol):
            return None
        op = _compute_op(m.group(2))
        return f"torch's {m.group(1)} kernel of aten::{op}, called below the dispatcher" if op else None
    if _OTHER_LIBRARIES.match(symbol):
        return "a CUDA library other than cuBLAS and cuDNN"
    return None


@dataclass
class ImportAudit:
    """What the candidate's objects import: the forbidden symbols (with why and which file) and
    the allowed libraries they call (whose kernels then count as allowed in strict mode)."""

    forbidden: list[tuple[str, str, str]]  # (symbol, why, file name)
    libraries: set[str]  # library file-name prefixes: "libcublas", "libcudnn", ...
    hooks: list[tuple[str, str]] = field(default_factory=list)  # (symbol, file name): `interpreter_hook`, either mode

    def reasons(self, limit: int = 6) -> list[str]:
        return [f"{sym} ({why}; imported by {file})" for sym, why, file in self.forbidden[:limit]]


def candidate_objects(roots: list[Path]) -> list[Path]:
    """The shared objects the candidate's build produced under `roots` (files or directories)."""
    out: list[Path] = []
    for root in roots:
        if root.is_file() and ".so" in root.name:
            out.append(root)
        elif root.is_dir():
            out += sorted(p for p in root.rglob("*.so*") if p.is_file())
    return list(dict.fromkeys(out))


def import_audit(objects: list[Path]) -> ImportAudit:
    """Read every object's imports (in the parent: the files are the build's, which no candidate job
    can write). Raises `ToolchainError` if one cannot be read."""
    forbidden: list[tuple[str, str, str]] = []
    libraries: set[str] = set()
    hooks: list[tuple[str, str]] = []
    for obj in objects:
        for sym in undefined_symbols(obj):
            if interpreter_hook(sym):
                hooks.append((sym, obj.name))
            for prefix, lib in ALLOWED_LIBRARIES.items():
                if sym.startswith(prefix):
                    libraries.add(lib)
            if sym.startswith(("at::cuda::getCurrentCUDABlas", "at::cuda::blas::")):
                libraries.update({"libcublas", "libcublasLt"})
            why = forbidden_import(sym)
            if why:
                forbidden.append((sym.split("(")[0], why, obj.name))
    return ImportAudit(forbidden=forbidden, libraries=libraries, hooks=hooks)
