"""Where a CPU worker's time went, sampled by the kernel from outside the candidate's process.

On the GPU every kernel the candidate's forward launches is recorded with its origin (CUPTI). The
CPU target has no kernel records, and the dispatcher audit does not see torch's compute reached
below the dispatcher: through a function pointer read from libtorch's symbol table and called
with ctypes (red team 6's b5), nothing the candidate's process can observe itself. So the local
sandbox asks the kernel to sample the worker: `perf_event_open` on each of its threads
(inherited by the threads and processes they start), task-clock every `period_us` of CPU time,
the user-space instruction pointer, thread and CLOCK_MONOTONIC time of each sample, written to a
ring buffer that this process reads. The candidate can neither see nor change the samples.

`attribute` then counts the samples taken while forward ran (`windows_from_marks`: from a mark
the worker writes on its pipe right before each forward call, stamped with its clock and checked
against this process's, to verify's mark once the call returned, checked the same way, or the
timed loop's next request, stamped with this process's clock) by where the instruction pointer
was (`_History`: the mapping its address had then): the candidate's own builds, the system (interpreter, C library,
OpenMP runtime), torch's glue (dispatch, allocation, the copies and fills strict mode allows),
or foreign compute (any other code of torch's or of another library: `foreign`, by symbol).
`cudagym.rewards.checks.Audit` holds strict mode to it.

Between a timed job's calls, the candidate's own code on any thread and anything on a thread its
code started (after the worker's `LOADING_MARK`) is its work outside the timed intervals
(`CpuOrigin.between`). What it does not see: torch's compute on the harness's threads outside
forward's windows (the harness makes the next inputs there; other checks cover a thread left
running and outputs complete at return), and code between samples (a sample every 250 µs of
CPU time: foreign compute shorter than that per trial may pass unsampled, and gains as little).
A thread that starts and ends inside one call with less CPU time than a period is never sampled
(red team 7's a4c ran torch's GELU in 128 such threads per call): its CPU time, counted by the
kernel at its exit, is `unseen_ns`, which strict mode counts as foreign.
"""

from __future__ import annotations

import bisect
import ctypes
import importlib.util
import fcntl
import mmap
import os
import re
import secrets
import struct
import threading
from collections import Counter
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Any

import numpy as np

from cudagym.sandbox.worker.wire import HARNESS_STEPS_S, LOADING_MARK

_PERF_EVENT_OPEN = {"x86_64": 298, "aarch64": 241}
_TYPE_SOFTWARE, _SW_TASK_CLOCK = 1, 1
_SAMPLE_IP, _SAMPLE_TID, _SAMPLE_TIME, _SAMPLE_CPU = 1 << 0, 1 << 1, 1 << 2, 1 << 7
# perf_event_attr flag bits: inherit, exclude_kernel, exclude_hv, mmap (each executable mapping
# made, mprotect's too), inherit_stat (a thread's count when it exits), task (its start and exit),
# sample_id_all (every record's time), mmap2 (with the file's offset), use_clockid
_INHERIT, _EXCLUDE_KERNEL, _EXCLUDE_HV, _MMAP, _INHERIT_STAT, _TASK = 1 << 1, 1 << 5, 1 << 6, 1 << 8, 1 << 11, 1 << 13
_SAMPLE_ID_ALL, _MMAP2, _USE_CLOCKID = 1 << 18, 1 << 23, 1 << 25
_CLOCK_MONOTONIC = 1
_RECORD_LOST, _RECORD_EXIT, _RECORD_FORK, _RECORD_READ, _RECORD_SAMPLE, _RECORD_MMAP2 = 2, 4, 7, 8, 9, 10
_IOC_SET_OUTPUT = 0x2405  # PERF_EVENT_IOC_SET_OUTPUT
_ATTR_SIZE = 128  # PERF_ATTR_SIZE_VER7
_PAGE = mmap.PAGESIZE
_DATA_PAGES = 32  # 128 KiB of samples (32 bytes each) per CPU: 4,000, drained every 50 ms


@dataclass
class Samples:
    """What the sampler collected: (pid, tid, time ns, ip, CPU) per sample; samples the kernel
    lost (the ring buffer was full); each thread started meanwhile, its start and exit (ns) and
    the CPU time it ran (ns, summed over CPUs, known once it exited); the CPU time each sample
    stands for on each CPU (`cpu_period_ns`: the periods differ by CPU, and are measured at the
    close); why sampling could not start, if it could not."""

    period_ns: int
    taken: list[tuple[int, int, int, int, int]] = field(default_factory=list)
    cpu_period_ns: dict[int, int] = field(default_factory=dict)
    alive_ns: dict[int, int] = field(default_factory=dict)  # the CPU time of threads alive at the end (`thread_cpu_ns`)
    lost: int = 0
    started: dict[int, int] = field(default_factory=dict)
    exited: dict[int, int] = field(default_factory=dict)
    ran_ns: Counter[int] = field(default_factory=Counter)
    mapped: list[tuple[int, int, Mapping]] = field(default_factory=list)  # (time ns, pid, mapping) made meanwhile
    error: str = ""


class _Event:
    def __init__(self, fd: int, buf: mmap.mmap) -> None:
        self.fd, self.buf = fd, buf


class CpuSampler:
    """Task-clock samples of every thread of the processes `pids` (and of what they start).
    `drain` moves what the kernel wrote to `samples`; call it often enough that the ring buffers
    do not fill (the local sandbox: every 50 ms, and once before the worker is killed)."""

    def __init__(self, pids: list[int], period_us: float = 250.0) -> None:
        self.samples = Samples(period_ns=int(period_us * 1000))
        self._events: list[_Event] = []  # one per CPU, with its ring buffer
        self._fds: list[int] = []  # the other threads' events, writing into those
        self._cpu_of: dict[int, int] = {}  # each event's CPU, by its descriptor
        self._lock = threading.Lock()
        number = _PERF_EVENT_OPEN.get(os.uname().machine)
        if number is None:
            self.samples.error = f"CPU sampling is not supported on {os.uname().machine}"
            return
        libc = ctypes.CDLL(None, use_errno=True)
        rng = secrets.SystemRandom()
        tids = []
        for pid in pids:
            try:
                tids += [int(t) for t in os.listdir(f"/proc/{pid}/task")]
            except OSError:
                continue  # gone meanwhile
        try:
            cpus = sorted(set().union(*(os.sched_getaffinity(pid) for pid in pids)))
        except OSError:
            cpus = list(range(os.cpu_count() or 1))
        # an inherited event's ring buffer is per CPU (the kernel maps none of a per-task one):
        # one buffer per CPU, every thread's event on that CPU writing into it. Each CPU's period
        # is drawn at random within +-40% of `period_us` (a thread inherits its creator's): code
        # that knew the period could keep foreign work between the points where samples fall
        # (red team 8's a3 ran torch's code mid-period and its own around each sample)
        for cpu in cpus:
            period = int(self.samples.period_ns * rng.uniform(0.6, 1.4))
            self.samples.cpu_period_ns[cpu] = period
            attr = bytearray(_ATTR_SIZE)
            struct.pack_into("IIQQQ", attr, 0, _TYPE_SOFTWARE, _ATTR_SIZE, _SW_TASK_CLOCK, period,
                             _SAMPLE_IP | _SAMPLE_TID | _SAMPLE_TIME | _SAMPLE_CPU)
            struct.pack_into("Q", attr, 40, _INHERIT | _EXCLUDE_KERNEL | _EXCLUDE_HV | _MMAP | _INHERIT_STAT | _TASK
                             | _SAMPLE_ID_ALL | _MMAP2 | _USE_CLOCKID)
            struct.pack_into("i", attr, 92, _CLOCK_MONOTONIC)
            raw = ctypes.create_string_buffer(bytes(attr), _ATTR_SIZE)
            leader: _Event | None = None
            for tid in tids:
                fd = libc.syscall(number, raw, tid, cpu, -1, 8)  # PERF_FLAG_FD_CLOEXEC
                if fd < 0:
                    err = ctypes.get_errno()
                    if err == 3:  # ESRCH: the thread exited meanwhile
                        continue
                    self.samples.error = (f"perf_event_open refused ({os.strerror(err)}; kernel.perf_event_paranoid "
                                          f"is {_paranoid()})")
                    self.close()
                    return
                self._cpu_of[fd] = cpu
                try:
                    if leader is None:
                        leader = _Event(fd, mmap.mmap(fd, (1 + _DATA_PAGES) * _PAGE, mmap.MAP_SHARED,
                                                      mmap.PROT_READ | mmap.PROT_WRITE))
                        self._events.append(leader)
                        continue
                    fcntl.ioctl(fd, _IOC_SET_OUTPUT, leader.fd)
                    self._fds.append(fd)
                except OSError as e:
                    os.close(fd)
                    self.samples.error = f"the sampler's ring buffer could not be set up: {e}"
                    self.close()
                    return

    def fill(self) -> float:
        """The share of the fullest ring buffer that holds samples not drained yet."""
        fullest = 0
        for ev in self._events:
            head, tail = struct.unpack_from("QQ", ev.buf, 1024)
            fullest = max(fullest, head - tail)
        return fullest / (_DATA_PAGES * _PAGE)

    def drain(self) -> None:
        """Move the samples written so far out of the ring buffers."""
        with self._lock:
            for ev in self._events:
                self._drain_one(ev.buf)

    def _drain_one(self, buf: mmap.mmap) -> None:
        head, = struct.unpack_from("Q", buf, 1024)
        tail, = struct.unpack_from("Q", buf, 1032)
        size = _DATA_PAGES * _PAGE
        if head == tail:
            return
        start, end = tail % size, head % size
        data = buf[_PAGE + start:_PAGE + end] if start < end else buf[_PAGE + start:] + buf[_PAGE:_PAGE + end]
        at = 0
        taken = self.samples.taken
        while at + 8 <= len(data):
            kind, _misc, length = struct.unpack_from("IHH", data, at)
            if length < 8:
                break
            if kind == _RECORD_SAMPLE and length >= 40:
                ip, pid, tid, when, cpu = struct.unpack_from("QIIQI", data, at + 8)
                taken.append((pid, tid, when, ip, cpu))
            elif kind == _RECORD_LOST and length >= 24:
                self.samples.lost += struct.unpack_from("Q", data, at + 16)[0]
            elif kind in (_RECORD_FORK, _RECORD_EXIT) and length >= 32:
                _pid, _ppid, tid, _ptid, when = struct.unpack_from("IIIIQ", data, at + 8)
                (self.samples.started if kind == _RECORD_FORK else self.samples.exited)[tid] = when
            elif kind == _RECORD_READ and length >= 24:
                _pid, tid, value = struct.unpack_from("IIQ", data, at + 8)
                self.samples.ran_ns[tid] += value
            elif kind == _RECORD_MMAP2 and length >= 88:
                pid, _tid, addr, size, pgoff = struct.unpack_from("IIQQQ", data, at + 8)
                name = data[at + 72:at + length - 24].split(b"\0", 1)[0].decode(errors="replace")
                # sample_id_all: pid, tid, time, CPU
                when, = struct.unpack_from("Q", data, at + length - 16)
                self.samples.mapped.append((when, pid, Mapping(addr, addr + size, pgoff, name)))
            at += length
        struct.pack_into("Q", buf, 1032, head)

    def close(self) -> Samples:
        """Stop sampling; the samples (drained a last time), with `period_ns` the CPU time each
        stands for, as measured: every event's count (its threads', exited ones' included) over
        the samples; and `cpu_period_ns` likewise for each CPU's own (where its samples are too
        few to measure: its period as asked, scaled as the whole). A kernel whose timers are
        coarse samples less often than asked (this project's CI hosts: every ~1.1 ms for 250 µs
        asked)."""
        self.drain()
        with self._lock:
            counts: Counter[int] = Counter()
            for fd in [ev.fd for ev in self._events] + self._fds:
                try:
                    counts[self._cpu_of.get(fd, -1)] += struct.unpack("Q", os.read(fd, 8))[0]
                except (OSError, struct.error):
                    counts.clear()
                    break
            total = sum(counts.values())
            taken = self.samples.taken
            if total and len(taken) >= 20:
                self.samples.period_ns = max(self.samples.period_ns, total // len(taken))
                asked = self.samples.cpu_period_ns
                per_cpu = Counter(s[4] for s in taken)
                scale = max(1.0, total / max(sum(asked.get(c, self.samples.period_ns) * n
                                                 for c, n in per_cpu.items()), 1))
                self.samples.cpu_period_ns = {
                    c: (max(p, counts[c] // per_cpu[c]) if per_cpu[c] >= 20 else round(p * scale))
                    for c, p in asked.items()}
            for ev in self._events:
                ev.buf.close()
                os.close(ev.fd)
            for fd in self._fds:
                os.close(fd)
            self._events, self._fds = [], []
        return self.samples


def thread_cpu_ns(pids: list[int]) -> dict[int, int]:
    """The CPU time (ns) each thread of `pids` has run so far, by thread id (the kernel's
    accounting: `/proc/PID/task/TID/schedstat`); threads that cannot be read are left out."""
    out: dict[int, int] = {}
    for pid in pids:
        try:
            tids = os.listdir(f"/proc/{pid}/task")
        except OSError:
            continue
        for tid in tids:
            if (stat := _schedstat(f"/proc/{pid}/task/{tid}/schedstat")) is not None:
                out[int(tid)] = stat[0]
    return out


def run_queue_ns(paths: list[str]) -> int:
    """The time (ns) the threads whose `/proc/.../schedstat` files are `paths` have waited, runnable,
    for a CPU (the kernel's run-queue delay); a thread that is gone counts nothing."""
    return sum(stat[1] for path in paths if (stat := _schedstat(path)) is not None)


def _schedstat(path: str) -> tuple[int, int] | None:
    """A thread's `schedstat`: the CPU time it ran and the time it waited for a CPU (ns), or None
    if it cannot be read (gone)."""
    try:
        ran, waited = Path(path).read_text().split()[:2]
        return int(ran), int(waited)
    except (OSError, ValueError):
        return None


def _paranoid() -> str:
    try:
        return Path("/proc/sys/kernel/perf_event_paranoid").read_text().strip()
    except OSError:
        return "unknown"


# -- the worker's memory map, and symbols ---------------------------------------------------------
@dataclass(frozen=True)
class Mapping:
    start: int
    end: int
    offset: int
    path: str


def read_maps(pids: list[int]) -> dict[int, list[Mapping]]:
    """The executable mappings of each process, by pid (sorted by address), from its `smaps`: a
    file mapping with pages of its own (`Anonymous` above 0: copied on write, code written over
    a library's pages at run time; red team 8's a4 wrote torch's code over a private mapping of
    libc) is named `<code written at run time over PATH>`. (`Private_Dirty` is no such sign: a
    library built moments ago still has dirty pages in the page cache.) A process whose map
    cannot be read is left out."""
    out: dict[int, list[Mapping]] = {}
    for pid in pids:
        try:
            with open(f"/proc/{pid}/smaps", encoding="utf-8", errors="replace") as f:
                lines = f.readlines()
        except OSError:
            continue
        spans: list[Mapping] = []
        current: list[Any] | None = None  # [lo, hi, offset, path, written]
        for line in lines + ["0-0 ---p 0 0:0 0\n"]:  # a last header closes the last mapping
            head = line.split(maxsplit=5)
            if len(head) >= 5 and "-" in head[0] and not head[0].endswith(":"):
                if current is not None:
                    lo, hi, offset, path, written = current
                    if written and path.startswith("/"):
                        path = f"<code written at run time over {path}>"
                    spans.append(Mapping(lo, hi, offset, path))
                current = None
                if "x" in head[1]:
                    lo, hi = (int(x, 16) for x in head[0].split("-"))
                    current = [lo, hi, int(head[2], 16), head[5].strip() if len(head) == 6 else "", False]
            elif current is not None and head[:1] == ["Anonymous:"] and len(head) >= 2 and head[1] != "0":
                current[4] = True
        out[pid] = sorted(spans, key=lambda m: m.start)
    return out


class SymbolTable:
    """A shared object's function symbols (`.symtab`, else `.dynsym`), sorted by address, and the
    file-offset to address shift of its loadable segments."""

    def __init__(self, path: str) -> None:
        from elftools.elf.elffile import ELFFile

        self.values = np.zeros(0, np.uint64)
        self.sizes = np.zeros(0, np.uint64)
        self.names = np.zeros(0, np.uint32)
        self._strtab = b""
        self.loads: list[tuple[int, int, int]] = []  # (file offset, size, vaddr)
        with open(path, "rb") as f:
            elf = ELFFile(f)
            self.loads = [(s["p_offset"], s["p_filesz"], s["p_vaddr"]) for s in elf.iter_segments()
                          if s["p_type"] == "PT_LOAD"]
            table = elf.get_section_by_name(".symtab") or elf.get_section_by_name(".dynsym")
            if table is None or not elf.elfclass == 64 or not elf.little_endian:
                return
            strings = elf.get_section(table["sh_link"])
            dtype = np.dtype([("name", "<u4"), ("info", "u1"), ("other", "u1"), ("shndx", "<u2"),
                              ("value", "<u8"), ("size", "<u8")])
            f.seek(table["sh_offset"])
            syms = np.frombuffer(f.read(table["sh_size"]), dtype=dtype)
            f.seek(strings["sh_offset"])
            self._strtab = f.read(strings["sh_size"])
        funcs = syms[((syms["info"] & 0xF) == 2) & (syms["value"] > 0)]  # STT_FUNC, defined
        order = np.argsort(funcs["value"], kind="stable")
        self.values, self.sizes, self.names = funcs["value"][order], funcs["size"][order], funcs["name"][order]

    def address(self, file_offset: int) -> int | None:
        for off, size, vaddr in self.loads:
            if off <= file_offset < off + size:
                return file_offset - off + vaddr
        return None

    def name_at(self, address: int) -> str | None:
        """The function containing `address` (None: none known there)."""
        i = int(np.searchsorted(self.values, np.uint64(address), side="right")) - 1
        if i < 0:
            return None
        value, size = int(self.values[i]), int(self.sizes[i])
        if size and address >= value + size:
            return None
        start = int(self.names[i])
        return self._strtab[start:self._strtab.find(b"\0", start)].decode(errors="replace")


@lru_cache(maxsize=64)
def _symbols(path: str, mtime_ns: int, size: int) -> SymbolTable | None:
    try:
        return SymbolTable(path)
    except Exception:  # noqa: BLE001 - not an ELF image, or one pyelftools cannot read
        return None


def symbols(path: str) -> SymbolTable | None:
    """`path`'s symbol table, read once per file version."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    return _symbols(path, st.st_mtime_ns, st.st_size)


@lru_cache(maxsize=4096)
def demangle(name: str) -> str:
    """A C++ symbol as its source names it (libstdc++'s demangler), shortened; else as given."""
    try:
        lib = ctypes.CDLL("libstdc++.so.6")
        fn = lib.__cxa_demangle  # noqa: SLF001 - the demangler's C name
        fn.restype, fn.argtypes = ctypes.c_void_p, [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_void_p,
                                                    ctypes.POINTER(ctypes.c_int)]
        status = ctypes.c_int()
        out = fn(name.encode(), None, None, ctypes.byref(status))
        if not out or status.value != 0:
            return name
        text = ctypes.string_at(out).decode(errors="replace")
        ctypes.CDLL(None).free(ctypes.c_void_p(out))
    except OSError:
        return name
    return text if len(text) <= 160 else text[:157] + "..."


# -- attribution ----------------------------------------------------------------------------------
OWN, SYSTEM, GLUE, FOREIGN, UNMAPPED = "own", "system", "glue", "foreign", "unmapped"
CPU_KEY = "kernel\tcpu\t"  # `CpuOrigin.as_counts`: beside the kernel records (`is_record_key`)

# the interpreter, the C/C++ and OpenMP runtimes, the loader: what any forward runs on
_SYSTEM = re.compile(r"/(python3?[\d.]*|libpython[\d.]+\.so[.\d]*|ld-linux[^/]*|libc\.so[.\d]*|libm\.so[.\d]*"
                     r"|libstdc\+\+\.so[.\d]*|libgcc_s\.so[.\d]*|libpthread\.so[.\d]*|libdl\.so[.\d]*"
                     r"|librt\.so[.\d]*|libgomp[-\w.]*\.so[.\d]*|libiomp5\.so|libz\.so[.\d]*)$")
# torch's libraries that do no compute of their own: allocation, dispatch keys, the Python bindings
_TORCH_GLUE_LIBRARY = re.compile(r"/torch/lib/(libc10|libtorch_python|libtorch_global_deps|libshm)\.so$")
# torch's functions that strict mode's allowed copies and fills run (`STRICT_ALLOWED`: clone,
# contiguous, copy_, fill_, zeros, ...): their loops are named after the kernel that makes them
# (`direct_copy_kernel`, `fill_kernel`); any other function of torch's libraries is torch's compute
# (its dispatch and allocation take a few µs per call: `foreign_allowance` leaves room for them)
_TORCH_COPY_FILL_SYMBOL = re.compile(r"copy(?!sign)|fill|memset|memcpy|memmove")
# torch's profiler and RecordFunction bookkeeping (the harness's profiler runs in verify's forward, the
# op counter's callback in every call): no compute of anyone's
_TORCH_PROFILER_SYMBOL = re.compile(r"profiler|libkineto|RecordFunction")
# the dispatcher's plumbing in libtorch_cpu (mangled names): the ops' entry stubs (`at::_ops::*::call`),
# the kernel wrappers, c10's dispatcher and tensor metadata, autograd's metadata, the global context,
# stride arithmetic, the PLT stubs (named after `_init`): no compute of anyone's, which runs in the
# kernels they reach (and in `c10::function_ref` callbacks: TensorIterator's loops, left foreign)
_TORCH_PLUMBING_SYMBOL = re.compile(r"^_ZN2at4_ops|wrap_kernel_functor_unboxed|"
                                    r"^_ZNK?3c10(4impl|10Dispatcher|10TensorImpl|11StorageImpl)|AutogradMeta|"
                                    r"globalContext|computeStride|^_init$")


@dataclass
class CpuOrigin:
    """The samples taken while forward ran, by origin; `foreign` by library and function."""

    forward: int = 0
    by_origin: Counter[str] = field(default_factory=Counter)
    foreign: Counter[str] = field(default_factory=Counter)
    period_ns: int = 0
    lost: int = 0
    windows: int = 0
    unseen_ns: int = 0  # CPU time of threads started and ended inside forward, too short to be sampled
    unseen_threads: int = 0
    error: str = ""
    tamper: str = ""  # the windows' marks contradict the sandbox's clock
    # per window, in the calls' order: (samples, foreign ones) (not in `as_counts`: `windows_record`)
    per_window: list[list[int]] = field(default_factory=list)
    # per span of `attribute`'s bounds: the CPU time each thread was sampled for (ns, by thread id), and its samples
    thread_ns: list[Counter[int]] = field(default_factory=list)
    thread_n: list[Counter[int]] = field(default_factory=list)
    cpus: int = 0  # the CPUs sampled (the worker's)
    # per span of `attribute`'s bounds: the first and the last time (ns) a thread of the worker was
    # sampled in code that is the candidate's work (own, foreign or unmapped; not the interpreter's,
    # the system's, torch's glue or the harness's): `work_spread_ns`
    work_edges: list[list[int]] = field(default_factory=list)
    # a timed job's samples between its calls (from the first call's start to the last's end) of
    # the candidate's work (`attribute`'s `loaded`), and where they fell
    between: int = 0
    between_code: Counter[str] = field(default_factory=Counter)
    # a timed job's samples of torch's (or any library's) compute on the harness's own threads
    # between its calls, and those in functions its samples before the candidate loaded never
    # fell in (`_harness_step`): the harness's steps between calls (the next inputs, the flush)
    # are the same code it ran then, its worker having taken them the same way before the mark
    between_foreign: int = 0
    between_unknown: Counter[str] = field(default_factory=Counter)
    unknown_total: int = 0  # `between_unknown`'s sum (that Counter travels with its most common only)
    steps_foreign: int = 0  # the samples of anyone's compute in the `HARNESS_STEPS_S` before that mark

    def least_wall_ns(self) -> list[int]:
        """Per span of `attribute`'s bounds, the least wall time its samples leave room for (ns): no thread runs for
        longer than the window lasts, and the worker's threads together run at most `cpus` times
        as long. A window of one sampled thread: that thread's sampled time (a thread that did
        the work alone, or each call's work on a thread of its own); of several: the larger of
        the busiest thread's sampled time less one sample (a thread sampled once may have run a
        moment only: with many threads each sampled once, their most would read far above the
        window) and all threads' sampled time over `cpus` (an unbiased sum)."""
        out = []
        for ns, n in zip(self.thread_ns, self.thread_n, strict=True):
            if len(ns) <= 1:
                out.append(sum(ns.values()))
                continue
            busiest = max(v - v // n[t] if n[t] else v for t, v in ns.items())
            out.append(max(busiest, sum(ns.values()) // max(self.cpus, 1)))
        return out

    def work_spread_ns(self) -> list[int]:
        """Per span of `attribute`'s bounds, the wall time between its first and its last sample of
        the candidate's work (0 with fewer than two). Samples are stamped by the kernel on the
        parent's clock: the work lasted at least this long, whatever the worker reports, and
        however long its threads waited for a CPU (a loaded machine stretches the call and this
        alike, where it shrinks the CPU time that `least_wall_ns` counts)."""
        return [last - first if first >= 0 else 0 for first, last in self.work_edges]

    def as_counts(self) -> dict[str, int]:
        """As counts keyed under `CPU_KEY` (they travel with the timed calls' op counts)."""
        out = {CPU_KEY + k: v for k, v in (("forward", self.forward), ("period_ns", self.period_ns),
                                           ("lost", self.lost), ("windows", self.windows),
                                           ("unseen_ns", self.unseen_ns), ("unseen_threads", self.unseen_threads),
                                           ("between", self.between), ("between_foreign", self.between_foreign),
                                           ("between_unknown", self.unknown_total),
                                           ("steps_foreign", self.steps_foreign))}
        out.update({CPU_KEY + "between\t" + k: v for k, v in self.between_code.most_common(8)})
        out.update({CPU_KEY + "unknown\t" + k: v for k, v in self.between_unknown.most_common(8)})
        out.update({CPU_KEY + "origin\t" + k: v for k, v in self.by_origin.items()})
        out.update({CPU_KEY + "foreign\t" + k: v for k, v in self.foreign.most_common(24)})
        if self.error:
            out[CPU_KEY + "error\t" + self.error] = 1
        if self.tamper:
            out[CPU_KEY + "tamper\t" + self.tamper] = 1
        return out

    @classmethod
    def from_counts(cls, counts: dict[str, Any]) -> CpuOrigin | None:
        """What `as_counts` wrote (None: no samples were taken)."""
        mine = {str(k)[len(CPU_KEY):]: int(v) for k, v in counts.items() if str(k).startswith(CPU_KEY)}
        if not mine:
            return None
        origin = cls(forward=mine.get("forward", 0), period_ns=mine.get("period_ns", 0), lost=mine.get("lost", 0),
                     windows=mine.get("windows", 0), unseen_ns=mine.get("unseen_ns", 0),
                     unseen_threads=mine.get("unseen_threads", 0), between=mine.get("between", 0),
                     between_foreign=mine.get("between_foreign", 0))
        origin.unknown_total, origin.steps_foreign = mine.get("between_unknown", 0), mine.get("steps_foreign", 0)
        for k, v in mine.items():
            kind, _, rest = k.partition("\t")
            if kind == "origin":
                origin.by_origin[rest] = v
            elif kind == "foreign":
                origin.foreign[rest] = v
            elif kind == "between" and rest:
                origin.between_code[rest] = v
            elif kind == "unknown" and rest:
                origin.between_unknown[rest] = v
            elif kind == "error":
                origin.error = rest
            elif kind == "tamper":
                origin.tamper = rest
        return origin


def classify(path: str, address_in_file: int, own_roots: list[str]) -> tuple[str, str]:
    """(origin, label) of an instruction at `address_in_file` (a file offset) of `path`."""
    if path in ("[vdso]", "[vsyscall]"):
        return SYSTEM, path
    if not path or path.startswith("["):  # anonymous memory, the heap, a stack made executable
        return UNMAPPED, f"<executable {path or 'anonymous memory'}>"
    if path.startswith("<"):  # `read_maps`: code written over a file's pages
        return UNMAPPED, path
    real = path.removesuffix(" (deleted)")
    if any(real.startswith(r) for r in own_roots):
        return OWN, real
    if _SYSTEM.search(real) or "/lib-dynload/" in real or real.startswith(("/usr/lib/", "/lib/", "/lib64/")) \
            and "python3" not in real:
        return SYSTEM, real
    if _TORCH_GLUE_LIBRARY.search(real):
        return GLUE, real
    table = symbols(real)
    name = None
    if table is not None:
        address = table.address(address_in_file)
        name = table.name_at(address) if address is not None else None
    if name and "/torch/lib/" in real and (_TORCH_COPY_FILL_SYMBOL.search(name) or _TORCH_PROFILER_SYMBOL.search(name)
                                           or _TORCH_PLUMBING_SYMBOL.search(name)):
        return GLUE, real
    return FOREIGN, f"{Path(real).name}: {demangle(name) if name else f'+{address_in_file:#x}'}"


def _overlaps(a: Mapping, b: Mapping) -> bool:
    return a.start < b.end and b.start < a.end


class _History:
    """The executable mappings of one process over the job: as they were before it (`before`),
    those made meanwhile (`made`: the sampler's mmap records, mprotect's too, by time) and as they
    were at its end (`after`, with what was written over files' pages). `live` names the mapping
    an address had at a time, and whether its code can be judged by its file: not if, at any time
    in the job, another mapping was put over it, it was put over other code, or (made meanwhile)
    it is not there, unwritten, at the end. Red team 9's decoy put a clean mapping of libc over
    torch's kernel after its last call, where the end-of-job map alone named libc."""

    def __init__(self, before: list[Mapping], made: list[tuple[int, Mapping]], after: list[Mapping]) -> None:
        self.before, self.made = before, sorted(made, key=lambda e: e[0])
        self.after = {(m.start, m.end, m.path.removeprefix("<code written at run time over ").removesuffix(">")):
                      m.path.startswith("<") for m in after}

    def live(self, ip: int, when: int) -> tuple[Mapping | None, str]:
        """(the mapping at `ip` at `when`, why its code cannot be judged by its file or "")."""
        covering = [(t, m) for t, m in self.made if m.start <= ip < m.end]
        current = next(((t, m) for t, m in reversed(covering) if t <= when), None)
        if current is None:
            m = next((m for m in self.before if m.start <= ip < m.end), None)
            if m is None:
                return None, ""
            if covering:
                return m, f"<code replaced during the job: {m.path or 'anonymous memory'}>"
            if self.after.get((m.start, m.end, m.path)):
                return m, f"<code written at run time over {m.path}>"
            return m, ""
        t, m = current
        later = [u for u, n in covering if u > t and _overlaps(n, m)]
        image = (m.path, m.start - m.offset)  # the file, and where it is loaded
        earlier = [n for n in self.before if _overlaps(n, m) and (n.path, n.start - n.offset) != image]
        earlier += [n for u, n in self.made if u < t and _overlaps(n, m) and (n.path, n.start - n.offset) != image]
        if later or earlier:
            return m, f"<code mapped over other code during the job: {m.path or 'anonymous memory'}>"
        written = self.after.get((m.start, m.end, m.path))
        if written is None:
            return m, f"<code mapped during the job and gone by its end: {m.path or 'anonymous memory'}>"
        if written:
            return m, f"<code written at run time over {m.path}>"
        return m, ""


class _Spans:
    """Sorted, disjoint time spans (seconds in, ns kept): which one holds a time."""

    def __init__(self, windows: list[tuple[float, float]]) -> None:
        self.spans = sorted((int(a * 1e9), int(b * 1e9)) for a, b in windows)
        self.starts = [a for a, _ in self.spans]

    def __len__(self) -> int:
        return len(self.spans)

    def of(self, when: int) -> int:
        i = bisect.bisect_right(self.starts, when) - 1
        return i if i >= 0 and when <= self.spans[i][1] else -1


# An OpenMP runtime schedules and waits (its threads spin a while after each parallel region,
# through the harness's steps between calls); the call's work runs in the functions it calls,
# which are the candidate's. Its distributed builds carry no symbols to tell the two apart. Only
# the system's and torch's copies: a build of the candidate's may take the name too (red team
# 15's `load_inline(name="libgomp_fast")` dropped its whole kernel out of the bound).
_OPENMP_RUNTIME = re.compile(r"/libgomp[^/]*\.so[.\d]*$")


_SYSTEM_LIBRARIES = ("/usr/lib/", "/usr/lib64/", "/lib/", "/lib64/")


@lru_cache(maxsize=1)
def _torch_lib() -> str:
    spec = importlib.util.find_spec("torch")
    if spec is None or spec.origin is None:
        return "/nonexistent"
    return os.path.join(os.path.dirname(os.path.realpath(spec.origin)), "lib")


def _openmp_runtime(path: str) -> bool:
    """Whether `path` is an OpenMP runtime of the system's or of torch's (`_OPENMP_RUNTIME`)."""
    return bool(_OPENMP_RUNTIME.search(path)) and (path.startswith(_SYSTEM_LIBRARIES)
                                                   or os.path.dirname(path) == _torch_lib())


def attribute(samples: Samples, maps: dict[int, list[Mapping]], windows: list[tuple[float, float]],
              own_roots: list[str], harness_roots: list[str] = (),  # type: ignore[assignment]
              before: dict[int, list[Mapping]] | None = None,
              bounds: list[tuple[float, float]] | None = None, loaded: float | None = None) -> CpuOrigin:
    """The samples inside `windows` (seconds of CLOCK_MONOTONIC), by origin (`classify`), each
    by the mapping its address had when it was taken (`_History`: `before`, the worker's map
    read before the job; the sampler's records of mappings made meanwhile; `maps`, read at the
    end); `harness_roots`: where the harness's own libraries lie (the op counter's callback runs
    in forward), counted with the system. Without `before` (tests), `maps` stands for it.
    `bounds`: spans that hold each call whatever the worker's clock said (the parent's own
    times), in which each thread's sampled CPU time is counted (`thread_ns`), the OpenMP
    runtime's and the harness's libraries left out (its close reads every page of the outputs
    inside the interval, and is not in the reported time): `least_wall_ns`. `loaded`: when the
    candidate's code began to load (`candidate_loaded_at`), for a timed job: what the candidate's
    code ran between its calls (`between`)."""
    loaded_ns = round(loaded * 1e9) if loaded is not None else None
    origin = CpuOrigin(period_ns=samples.period_ns, lost=samples.lost, windows=len(windows), error=samples.error)
    spans = _Spans(windows)
    window_of = spans.of
    loop = (spans.spans[0][0], spans.spans[-1][1]) if len(spans) else (0, -1)
    held = _Spans(bounds or [])

    sampled: Counter[int] = Counter()
    steps: Counter[str] = Counter()  # the functions of anyone's compute sampled before the candidate loaded
    unknown: Counter[str] = Counter()  # and between the calls, on the harness's threads, by function
    origin.per_window = [[0, 0] for _ in range(len(spans))]
    roots = [os.path.realpath(r) + "/" for r in own_roots if r]
    harness = tuple(os.path.realpath(r) + "/" for r in harness_roots if r)
    base = before if before is not None else maps
    histories = {pid: _History(base.get(pid, maps.get(pid, [])), [(t, m) for t, p, m in samples.mapped if p == pid],
                               maps.get(pid, [])) for pid in {s[0] for s in samples.taken}}
    origin.thread_ns, origin.thread_n = [Counter() for _ in range(len(held))], [Counter() for _ in range(len(held))]
    origin.work_edges = [[-1, -1] for _ in range(len(held))]
    origin.cpus = len(samples.cpu_period_ns)
    for pid, tid, when, ip, cpu in samples.taken:
        sampled[tid] += 1
        if (b := held.of(when)) >= 0:
            live, doubt = histories[pid].live(ip, when)
            path = live.path.removesuffix(" (deleted)") if live is not None else ""
            own = any(path.startswith(r) for r in roots)
            if live is None or doubt or own or not (_openmp_runtime(path) or path.startswith(harness)):
                origin.thread_ns[b][tid] += samples.cpu_period_ns.get(cpu, samples.period_ns)
                origin.thread_n[b][tid] += 1
                if live is None or doubt or own or classify(live.path, ip - live.start + live.offset, roots)[0] in (
                        FOREIGN, UNMAPPED):
                    edges, ns = origin.work_edges[b], when
                    edges[0] = ns if edges[0] < 0 else min(edges[0], ns)
                    edges[1] = max(edges[1], ns)
        if (w := window_of(when)) < 0:
            if loaded_ns is not None and when < loaded_ns:
                _harness_step(steps, histories[pid].live(ip, when), ip, roots,
                              when >= loaded_ns - HARNESS_STEPS_S * 1e9)
            elif loaded_ns is not None and loop[0] <= when <= loop[1]:
                _between(origin, histories[pid].live(ip, when), ip, roots, harness,
                         tid in samples.started and samples.started[tid] >= loaded_ns, unknown)
            continue
        origin.forward += 1
        origin.per_window[w][0] += 1
        mapping, doubt = histories[pid].live(ip, when)
        if mapping is None:
            kind, label = UNMAPPED, "<code no longer mapped at the job's end>"
        elif doubt:
            kind, label = UNMAPPED, doubt
        elif harness and mapping.path.startswith(harness) and not any(mapping.path.startswith(r) for r in roots):
            kind, label = SYSTEM, mapping.path
        else:
            kind, label = classify(mapping.path, ip - mapping.start + mapping.offset, roots)
        origin.by_origin[kind] += 1
        if kind in (FOREIGN, UNMAPPED):
            origin.foreign[label] += 1
            origin.per_window[w][1] += 1
    origin.between_unknown = Counter({k: v for k, v in unknown.items() if not steps[k]})
    origin.steps_foreign = steps[""]
    origin.unknown_total = sum(origin.between_unknown.values())
    # A thread started inside a bounded call and never sampled (a thread's event starts a whole
    # period after the thread does): its whole CPU time (the kernel's count at its exit, or read at
    # the job's end) is counted in that call, exactly (a fresh thread per call, each running less
    # than a period, would otherwise do the calls' work unseen)
    for tid, began in samples.started.items():
        if sampled[tid] or (b := held.of(began)) < 0:
            continue
        ran = samples.ran_ns.get(tid, 0) if tid in samples.exited else samples.alive_ns.get(tid, 0)
        if ran > 0:
            origin.thread_ns[b][tid] = ran
            origin.thread_n[b][tid] = 0  # exact, not sampled
    # A thread's event starts a whole period after the thread does: one that runs less never
    # yields a sample. Threads started during the job that ended before it, where their start or
    # their end fell inside a forward call (red team 8's a2 started them in one call and ended them
    # in the next): their CPU time (the kernel's count at their exit) beyond what their samples
    # stand for is unseen code.
    for tid, began in samples.started.items():
        ended = samples.exited.get(tid)
        if ended is None or (window_of(began) < 0 and window_of(ended) < 0):
            continue
        unseen = samples.ran_ns.get(tid, 0) if not sampled[tid] else 0  # never sampled: its code unknown
        if unseen > 0:
            origin.unseen_ns += unseen
            origin.unseen_threads += 1
    return origin


# torch's functions that compute over a tensor's elements (TensorIterator's loop bodies, the
# vectorized math, BLAS/oneDNN, the reductions): the rest of torch's libraries between the calls
# is the dispatcher's plumbing, its schema prints and parses (the harness's `InputKernels` reads),
# too brief a part of the harness's steps to be sampled before the candidate loads as often as
# between a hundred calls. Another library's functions all count.
_TORCH_LIBRARY = re.compile(r"^lib(torch|c10)")
_COMPUTE_LOOP = re.compile(r"Vectorized|vectorized|Sleef|callback_fn<|kernel|Kernel|::vec::|gemm|dnnl|mkl|blas|"
                           r"reduc|[Ll]oop")


def _harness_step(steps: Counter[str], live: tuple[Mapping | None, str], ip: int, roots: list[str],
                  timed: bool) -> None:
    """Note the function of a sample taken before the candidate loaded, where it is anyone's
    compute (`FOREIGN`): the harness's own (its calibration, the inputs it made); `timed`: within
    the `HARNESS_STEPS_S` before the mark, the steps between calls it takes there (counted in
    `steps[""]`)."""
    mapping, doubt = live
    if mapping is not None and not doubt:
        kind, label = classify(mapping.path, ip - mapping.start + mapping.offset, roots)
        if kind == FOREIGN:
            steps[label] += 1
            steps[""] += timed


def _between(origin: CpuOrigin, live: tuple[Mapping | None, str], ip: int, roots: list[str], harness: tuple[str, ...],
             late: bool, unknown: Counter[str]) -> None:
    """Count a sample taken between a timed job's calls, where it is the candidate's work: its
    own code (or code no file holds) on any thread, and anything on a thread its code started
    (`late`), but the OpenMP runtime's waits and the harness's own libraries. The harness's
    steps between calls (the next inputs, the evidence, its checks) run on the threads it had
    before the candidate loaded, in the interpreter, the system's libraries and torch's: there,
    torch's compute (any library's) is counted by function in `unknown`, and `attribute` keeps
    the functions the harness's own steps before the candidate loaded never fell in (torch's
    GELU run on the next inputs from a read of the harness's the candidate hijacked)."""
    mapping, doubt = live
    if mapping is None or doubt:
        kind, label = UNMAPPED, doubt or "<code no longer mapped at the job's end>"
    else:
        path = mapping.path.removesuffix(" (deleted)")
        own = any(path.startswith(r) for r in roots)
        if not own and (_openmp_runtime(path) or (harness and path.startswith(harness))):
            return
        kind, label = classify(mapping.path, ip - mapping.start + mapping.offset, roots)
    if kind in (OWN, UNMAPPED) or late:
        origin.between += 1
        origin.between_code[label + (" (on a thread it started)" if late else "")] += 1
    elif kind == FOREIGN:
        origin.between_foreign += 1
        library, _, function = label.partition(": ")
        if not _TORCH_LIBRARY.search(library) or _COMPUTE_LOOP.search(function):
            unknown[label] += 1


# A forward mark's own time may precede its arrival by this much (the pipe, this process's reader thread)
MARK_DELAY_S = 1.0


def _stamp(at: Any, arrived: float) -> float | None:
    """A mark's own time as a window may use it: None where it cannot be the harness's clock (not
    a number, or after the mark's arrival here: the worker's clock is this process's); its
    arrival where it is over `MARK_DELAY_S` before it. A mark that waited that long for the
    parent's reader, which an honest one did beside twelve other checks on two cores (the
    fixture of every honest solution at once), or a clock that reads the past, opens the window
    no earlier than the parent had the mark: the worker waits for that before forward runs."""
    if not isinstance(at, (int, float)) or float(at) > arrived:
        return None
    return float(at) if arrived - MARK_DELAY_S <= float(at) else arrived


def call_bounds(marks: list[tuple[str, Any, float]]) -> list[tuple[float, float]]:
    """The timed loop's calls as this process's clock holds them, whatever the worker's clock
    says: each from its forward mark's arrival (the worker waits for it to be read before the
    call starts) to the arrival of its "returned" mark (written once the call's interval is over;
    the worker waits for it to be read before its checks of the call). Only for marks that
    follow the protocol (`windows_from_marks` found nothing wrong)."""
    out: list[tuple[float, float]] = []
    opened: float | None = None
    for what, _at, arrived in marks:
        if what == "forward":
            opened = arrived
        elif what == "returned" and opened is not None:
            out.append((opened, arrived))
            opened = None
    return out


def candidate_loaded_at(marks: list[tuple[str, Any, float]]) -> float | None:
    """When the parent had the worker's `LOADING_MARK` (its arrival, this process's clock), or
    None without one (`windows_from_marks` refuses a second, or one after a forward call)."""
    return next((arrived for what, _at, arrived in marks if what == LOADING_MARK), None)


def windows_from_marks(marks: list[tuple[str, Any, float]], end: str, per_call: str,
                       stop: bool = False) -> tuple[list[tuple[float, float]], str]:
    """Forward's windows from a job's marks (`FrameReader.marks`): each from a "forward" mark to
    the job's `end`. Every time is this process's (CLOCK_MONOTONIC, the worker's clock too). A
    window opens at the earlier of the time the worker read before writing its forward mark and
    the mark's arrival here (the worker waits for the parent to have the mark before forward
    runs, so the arrival is never after forward began). It closes at the "returned" mark, written
    as forward returns (verify) or as a timed call's interval ends (its close and evidence sent),
    at the later of its time and its arrival (a replaced clock can only widen the window; the
    worker waits for the parent to have it, so a parent slow to read does not stretch the window
    over the harness's next steps). `checks.cpu_windows_cover` holds a timed window against the
    call's measured time (red team 11 made every timed window empty with a clock that read the
    forward mark's time again, then hid the harness's end marks and wrote its own: both leave
    windows shorter than the calls).
    The harness writes exactly one forward mark per `per_call` request (verify:
    "request:trial"; the timed loop: "request:call", whose last one is answered `stop`), each
    followed by its `end` before anything else is marked; and at most one `LOADING_MARK` before
    them (`candidate_loaded_at`). Anything else is marks the candidate
    wrote itself (red team 8's a1 closed a window early with a forged end), or a clock it
    replaced (a time after the mark's arrival; one over `MARK_DELAY_S` before it is not used: `_stamp`): why the
    marks cannot be the harness's, else ""."""
    windows: list[tuple[float, float]] = []
    opened: float | None = None
    forwards = calls = 0
    loading = False
    for what, at, arrived in marks:
        calls += what == per_call
        if what == "forward":
            forwards += 1
            if opened is not None:
                return windows, "a forward call was marked as started twice"
            if (start := _stamp(at, arrived)) is None:
                return windows, (f"a forward call's start was marked at {at!r}, after the evaluator received the "
                                 f"mark ({arrived:.6f}): the worker's clock was replaced")
            opened = min(start, arrived)
        elif opened is not None:
            if what != end:
                return windows, f"a forward call was ended by {what!r}, not by {end!r}"
            if (stop_at := _stamp(at, arrived)) is None or stop_at < opened:
                return windows, (f"a forward call's end was marked at {at!r}, not between its start and the "
                                 f"evaluator's receipt of the mark ({arrived:.6f}): the worker's clock was replaced")
            windows.append((opened, max(stop_at, arrived)))
            opened = None
        elif what == LOADING_MARK:
            if forwards or loading:
                return windows, f"{what!r} was marked {'twice' if loading else 'after a forward call'}"
            loading = True
        elif not what.startswith("request:"):
            return windows, f"{what!r} was marked with no forward call running"
    if opened is not None:
        return windows, "a forward call was marked as started and never ended"
    if forwards != calls - stop:
        return windows, f"{forwards} forward calls were marked for {calls - stop} calls"
    return windows, ""
