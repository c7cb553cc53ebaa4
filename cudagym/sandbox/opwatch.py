"""An always-on ATen op counter for the harness: one global `at::RecordFunction` callback.

`OpWatch.load(cache_dir)` builds `opwatch.cpp` (once per torch install, compiler and source:
`cache_dir/opwatch/<key>/libopwatch.so`), loads it with ctypes and installs the callback for the
rest of the process. From then on every op that enters the dispatcher on any thread (from
Python, from C++ through `at::`, inside `torch.no_grad()`, from `torch.compile`d code that calls
ATen) runs the callback; while *armed* the callback counts the op by name. The callback is
the same in every call of every job, so a candidate cannot tell warm-up, verify and timed
calls apart by it, and it costs a fraction of a microsecond per op (see
`benchmarks/bench_opwatch.py`), so it may stay armed inside timed intervals.

What it counts, compared with a `TorchDispatchMode` (the harness's `OpRecorder`):
- names are the dispatcher's schema names without the overload (`aten::add`), the form the
  mode's `func._schema.name` gives and `cudagym.core.audit` expects;
- it sees every op that enters the dispatcher, the mode only those that reach the Python key.
  `counts()` leaves out ops that the dispatcher runs as their CompositeImplicitAutograd
  function (`aten::reshape`, `aten::to`, `aten::dropout`: they only call other ops, which are
  counted themselves), so an honest `.float()` of a float tensor is no op here either. It
  still sees more than the mode: ops that kernels call inside themselves (`aten::empty_like`
  allocating with `aten::empty_strided`, `aten::add` of a Python number casting it with
  `aten::_to_copy`) and ops torch runs with the Python key excluded (`torch.tensor(data)`
  builds its tensor with `aten::empty` and `aten::to`); a candidate can exclude that key too,
  so the mode alone is blind where this is not. The CPU profiler, which reads the same RecordFunction
  events, saw all of these as well.

Build in the parent: `build_library(cache_dir)` compiles (tens of seconds, once per key), so an
evaluator calls it before it starts workers, and a worker's `OpWatch.load` only finds and loads.

What it cannot see: work done without the dispatcher: a candidate's own kernels (the point),
C++ that calls ATen's kernels directly, and the kernels inductor generates for `torch.compile`d
code (a compiled region shows as `Torch-Compiled Region: 0/0` and `TorchDynamo Cache Lookup`,
which are no ATen ops, plus the ATen ops it still calls, such as `aten::mm`); and ops on a
thread whose C++ switched RecordFunction off. `check_alive()` tells, after a call, whether the
callback is still installed and RecordFunction is on for the calling thread, and whether anyone
but this object armed, disarmed or reset the counter. `callbacks_registered()` counts the
RecordFunction callbacks anyone registered in the process (a candidate's observer of the
harness's ops shows there even once removed).

The library also holds the CPU target's close of a timed call (`cpu_close`, see
`cudagym.sandbox.timing`): native code of the harness's own, with no ATen op and no Python in it,
so that nothing the candidate hooks into either runs between the draw of a call's sample
positions and the read of its values.
"""

from __future__ import annotations

import ctypes
import logging
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import NamedTuple

from cudagym.errors import ToolchainError
from cudagym.sandbox.native import CXX, build_shared

# where a timing job's worker puts its result pipe for the native open and close of CPU calls
# (`CHANNEL_FD` in opwatch.cpp: they write there, wherever it is a pipe)
CHANNEL_FD = 1000

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("opwatch.cpp")

_ALIVE_FAILURES = {
    1: "RecordFunction was switched off on the calling thread (at::enableRecordFunction(false))",
    2: "the op watcher's callback no longer runs (it was removed or disabled)",
    3: "the op watcher's callback was never installed",
}


class OpCount(NamedTuple):
    """One op overload as the callback counted it."""

    name: str  # "aten::add"
    overload: str  # "Tensor"; "" for the default overload
    calls: int  # times the callback saw it (`count` would shadow tuple.count)
    decomposes: bool  # run as its CompositeImplicitAutograd function (calls other ops) on CPU/CUDA


def _build_flags() -> tuple[list[str], list[str], str]:
    """(compile flags, link flags, torch's identity) for a plain C++ library against ATen/c10."""
    import torch
    import torch.utils.cpp_extension as cpp

    compile_flags = ["-O2", "-fPIC", "-shared", "-std=c++17",
                     f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}",  # noqa: SLF001 - torch's ABI
                     *(f for d in cpp.include_paths() for f in ("-isystem", d))]
    lib = cpp.TORCH_LIB_PATH
    # bound at load and read-only after (full RELRO): no slot of the library's own is plain writable data
    link_flags = [f"-L{lib}", "-lc10", "-ltorch_cpu", f"-Wl,-rpath,{lib}", "-Wl,-z,now", "-Wl,-z,relro"]
    return compile_flags, link_flags, f"{torch.__version__}\n{lib}"


def build_library(cache_dir: Path, source: Path = SOURCE, cxx: str = CXX) -> Path:
    """`cache_dir/opwatch/<key>/lib<source stem>.so`, built from the C++ file `source` if absent.

    The library is plain C++ against ATen/c10, linked to torch's `libc10`/`libtorch_cpu` with
    an rpath. The key hashes torch's version and library directory, the compiler's identity,
    the flags and the source (`build_shared`). Where CUDA's headers are, the kernel watcher
    (`cudagym.sandbox.origin`) is built beside it, and where GPUs are visible, the timer's gate
    kernels' images for their architectures (`cudagym.sandbox.timing.gate.store_gate_images`),
    so that a sandbox that builds this before its workers start has all three.
    """
    compile_flags, link_flags, torch_id = _build_flags()
    built = build_shared(cache_dir, source, compile_flags, link_flags, torch_id, cxx)
    if source == SOURCE:  # the harness's other native pieces, beside it, where CUDA is
        from cudagym.sandbox.origin import build_library as build_origin, cuda_include_dirs

        try:
            cuda_include_dirs()
        except ToolchainError:
            pass  # no CUDA here: no GPU worker will look for it
        else:
            build_origin(cache_dir)
        _store_gate_images(cache_dir)
    return built


def _store_gate_images(cache_dir: Path) -> None:
    """The gate kernels' images for the visible GPUs (none without GPUs); where NVRTC cannot make
    them here, each worker compiles its own, as before (slower, as correct)."""
    from cudagym.sandbox.gpu import gpu_capabilities

    capabilities = gpu_capabilities()
    if not capabilities:
        return
    from cudagym.sandbox.timing.gate import store_gate_images

    try:
        store_gate_images(cache_dir, capabilities)
    except (OSError, RuntimeError) as e:
        log.warning("the timer's gate kernels could not be compiled ahead (%s); each GPU worker compiles them", e)


class OpWatch:
    """The loaded counter. Its C state is per process; hold one `OpWatch` per process.

    Bind what the harness needs from it before any candidate code runs: the candidate shares
    the process and could rebind Python attributes (not the C library's state, which
    `check_alive` watches).
    """

    def __init__(self, library: Path) -> None:
        """Loads `library` (from `build_library`) and installs its callback; see `load`."""
        lib = ctypes.CDLL(str(library), mode=ctypes.RTLD_LOCAL)
        for name, restype, argtypes in (
            ("opwatch_install", ctypes.c_int, []),
            ("opwatch_arm", None, []),
            ("opwatch_disarm", None, []),
            ("opwatch_reset", None, []),
            ("opwatch_state_changes", ctypes.c_uint64, []),
            ("opwatch_dump", ctypes.c_size_t, [ctypes.c_char_p, ctypes.c_size_t]),
            ("opwatch_alive", ctypes.c_int, []),
            ("opwatch_callbacks_registered", ctypes.c_uint64, []),
            ("cudagym_cpu_open", ctypes.c_int64, []),
            ("cudagym_cpu_close", ctypes.c_int,
             [ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_char_p, ctypes.c_int64]),
            ("cudagym_guard_channel", ctypes.c_int, [ctypes.c_void_p, ctypes.c_int]),
            ("cudagym_cpu_flush", ctypes.c_int64, [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64]),
            ("cudagym_cpu_project", ctypes.c_int,
             [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint64, ctypes.c_void_p]),
        ):
            fn = getattr(lib, name)
            fn.restype, fn.argtypes = restype, argtypes
        if lib.opwatch_install() != 0:
            raise ToolchainError("torch refused to register the op watcher's RecordFunction callback")
        self.library = library
        self.lib = lib  # its functions, typed above (the worker binds two before any candidate code)
        # the CPU target's close of a timed call (`cudagym.sandbox.timing.DeviceTimer.call`): plain
        # native code of the harness's, not the op counter's; here because this is the harness's library
        self.cpu_close = lib.cudagym_cpu_close
        self.cpu_open = lib.cudagym_cpu_open  # its start (`DeviceTimer.call`: the clock, sent on the channel)
        self._guard_channel = lib.cudagym_guard_channel
        self.cpu_flush = lib.cudagym_cpu_flush  # and its cache flush before each call (`DeviceTimer.flush`)
        self.cpu_project = lib.cudagym_cpu_project  # a reference output's projections (`reference_projection`)
        self._state_changes = lib.opwatch_state_changes()

    def guard_channel(self, fds: Sequence[int]) -> int:
        """Keep the descriptors `fds` (the channel's) where they are for the rest of this process and
        all it starts (`cudagym_guard_channel`: a seccomp filter refusing to replace or close them);
        0, or -errno where no filter could be installed."""
        return int(self._guard_channel((ctypes.c_int * len(fds))(*fds), len(fds)))

    @classmethod
    def load(cls, cache_dir: Path) -> OpWatch:
        """Build (if needed) and load the library from `cache_dir`, and install the callback.

        The callback starts disarmed. Installing is idempotent: a second load in one process
        shares the first one's callback and counts.
        """
        return cls(build_library(cache_dir))

    def arm(self) -> None:
        """Count ops from now on (on every thread)."""
        self.lib.opwatch_arm()
        self._state_changes += 1

    def disarm(self) -> None:
        """Stop counting; the counts stay until `reset`."""
        self.lib.opwatch_disarm()
        self._state_changes += 1

    def reset(self) -> None:
        """Zero every count."""
        self.lib.opwatch_reset()
        self._state_changes += 1

    def ops(self) -> list[OpCount]:
        """Every op overload counted since the last reset, in the order first seen."""
        cap = 1 << 14
        while True:
            buf = ctypes.create_string_buffer(cap)
            need = self.lib.opwatch_dump(buf, cap)
            if need < cap:
                break
            cap = need + 1024  # ops counted on other threads meanwhile may have made it longer
        out = []
        for line in buf.value.decode().splitlines():
            name, overload, count, decomposes = line.split("\t")
            out.append(OpCount(name, overload, int(count), decomposes == "1"))
        return out

    def counts(self) -> Counter[str]:
        """Ops run since the last reset, by name (`aten::add`), the form the op audit reads.

        Ops that decompose into other ops are left out (see the module docstring).
        """
        out: Counter[str] = Counter()
        for op in self.ops():
            if not op.decomposes:
                out[op.name] += op.calls
        return out

    def callbacks_registered(self) -> int:
        """RecordFunction callbacks (global or thread-local) registered in this process so far by
        anyone but this method, this library's own included (see opwatch.cpp); removed or
        disabled ones too."""
        return int(self.lib.opwatch_callbacks_registered())

    def check_alive(self) -> str | None:
        """None while the watcher works on the calling thread; else the reason it does not.

        Call it on the thread that ran the candidate, after the call: it runs one ATen op of
        its own (not counted) and checks that the callback saw it, that RecordFunction is on
        for this thread, and that nobody but this object armed, disarmed or reset the counter.
        """
        code = self.lib.opwatch_alive()
        if code in _ALIVE_FAILURES:
            return _ALIVE_FAILURES[code]
        if self.lib.opwatch_state_changes() != self._state_changes:
            return "the op watcher was armed, disarmed or reset by code other than the harness"
        return None
