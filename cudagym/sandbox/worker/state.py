"""The one object that holds a worker process's own state, from its start-up to its one job.

Made by `prewarm.prewarm_host` before any candidate code runs and passed to every job family:
the identity snapshots the integrity checks compare with, what the audit hook and the inert
profiler switches noted, the op counter and kernel watcher with the C functions bound to read
them, the NVML handle, the premapped result memory and the reader of the parent's answers.
A fork server makes it once; each worker forked from it gets its own copy.
"""

from __future__ import annotations

import mmap
import types
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from cudagym.sandbox.worker.telemetry import DeviceTelemetry
from cudagym.sandbox.worker.wire import LineReader

if TYPE_CHECKING:
    import torch

    from cudagym.sandbox.opwatch import OpWatch
    from cudagym.sandbox.origin import KernelWatch


@dataclass(eq=False)
class Snapshot:
    """The harness's code as bound before any candidate code ran: every callable its modules name
    (their own and imported ones) and the set of all their names, their own functions (cached ones
    too) with their code, and the methods of its classes with theirs."""

    names: dict[tuple[types.ModuleType, str], Any]
    functions: dict[tuple[types.ModuleType, str], tuple[Any, Any]]
    methods: dict[tuple[type, str], Any]
    method_code: dict[tuple[type, str], Any]
    # every name each harness module had: a name added later shadows a builtin (`open`) or an
    # import for every function of that module
    keys: dict[types.ModuleType, frozenset[str]] = field(default_factory=dict)
    # every attribute of each harness class, by identity: one added later (a property that shadows
    # an instance's attribute, red team 12's forged `DeviceTimer.last_raw`) or rebound is tamper
    class_attrs: dict[type, dict[str, Any]] = field(default_factory=dict)


@dataclass(eq=False)
class WorkerState:
    """A worker's state (see the module's text). Fields filled at start-up are None until then."""

    snapshot: Snapshot  # the harness's functions, names and methods, as bound before candidate code
    stdin: LineReader = field(default_factory=lambda: LineReader(0))  # the job's line, then the parent's answers
    # -- integrity (`integrity`)
    originals: dict[str, Any] = field(default_factory=dict)  # the watched functions (`integrity.WATCHED`)
    c_entries: list[tuple[int, int, int]] = field(default_factory=list)  # their C functions (`integrity.c_entries`)
    clock_slots: list[tuple[int, int]] = field(default_factory=list)  # the slots those call clocks through
    gc_callbacks: tuple[Any, ...] = ()  # `gc.callbacks` before candidate code (torch's own, if any)
    signal_handlers: dict[int, Any] = field(default_factory=dict)  # Python's signal handlers before candidate code
    # every module loaded, each watched name's owner and each harness class before candidate code:
    # (object, its type, its name, whether it had a module `__getattr__`) (`integrity.reclassed`)
    object_types: list[tuple[Any, type, str, bool]] = field(default_factory=list)
    # the same, as `reclassed` reads them: the objects, their types, the dicts of the modules that had
    # no module `__getattr__`, and the builtins' names and values
    type_check: tuple[tuple[Any, ...], ...] = ((), (), (), (), ())
    import_hooks: tuple[tuple[Any, ...], tuple[Any, ...]] = ((), ())  # `sys.meta_path`, `sys.path_hooks` then
    dispatch: dict[str, tuple[str, ...]] = field(default_factory=dict)  # `dispatch_table()` before candidate code
    pause_attempts: list[str] = field(default_factory=list)  # the inert profiler switches' calls
    hook_attempts: list[str] = field(default_factory=list)  # profile/trace/audit hooks refused
    torch_lookups: list[str] = field(default_factory=list)  # torch's C++ names looked up through ctypes
    # -- the op counter (`cudagym.sandbox.opwatch`), loaded by `prewarm_host`
    opwatch: OpWatch | None = None
    opwatch_changes: Callable[[], int] | None = None  # its C library's count of arms, disarms and resets
    opwatch_callbacks: Callable[[], int] | None = None  # RecordFunction callbacks registered so far (opwatch.cpp)
    callbacks_before: int | None = None  # their number before the candidate's code loaded (`timed.job_timer`)
    # whether a global of the harness's modules changed since before candidate code (`integrity.globals_check`)
    globals_changed: Callable[[], str] = lambda: ""
    candidate_ran: bool = False  # the candidate's code has been loaded: a failure from here on may be its doing
    threads_before: int | None = None  # Python threads beside the main one before that (`integrity.live_helpers`)
    # -- the kernel watcher (`cudagym.sandbox.origin`), loaded by `prewarm_device` (GPU workers)
    kwatch: KernelWatch | None = None
    kwatch_error: str | None = None  # why it could not be loaded
    kprobe: torch.Tensor | None = None  # a harness tensor whose fill is the watcher's probe launch
    # -- telemetry and the result memory
    telemetry: DeviceTelemetry = field(default_factory=DeviceTelemetry)
    premapped: mmap.mmap | None = None  # the start of the result memory (`prewarm.premap_results`)
    # the pipes of a CPU timing job's inputs maker (the parent's seeds, read; its answers, written),
    # handed to the maker as the worker starts and closed here (`maker.fork_early`); then the
    # maker's pid and the socket the worker hands it the job on (`maker.attach`)
    maker_fds: tuple[int, int] | None = None
    maker: tuple[int, int] | None = None
    job_line: bytes = b""  # the job as the parent wrote it
    channel: Any = None  # the job's `Channel`, and its state before candidate code (`integrity.check_channel`)
    channel_parts: dict[str, Any] = field(default_factory=dict)
