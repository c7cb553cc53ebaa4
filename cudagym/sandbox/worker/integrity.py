"""What a worker checks about its own integrity: that nothing the candidate's code ran replaced
the harness's functions or torch's, hooked the interpreter, registered kernels for torch's ops or
blinded the op counter and the kernel watcher; and the allocator's poisoning.

- identity snapshots (`WATCHED`, `Snapshot`), taken before any candidate code runs and compared
  by `check_tamper` after it ran;
- Python's hooks refused by an audit hook of the worker's own (`audit_hook`), and the profiler's
  pause switches made inert (`install_inert_switches`);
- the dispatcher's table (`dispatch_table`);
- the audit instruments: the dispatch-mode recorder (`OpRecorder`), the op counter's and the
  kernel watcher's liveness (`watch_alive`, `kernels_alive`);
- helpers the candidate must not leave behind (`live_helpers`), and NaN poisoning of memory the
  allocator is about to hand out (`poison_allocator`).
What was seen is kept in the `WorkerState`; the verdicts are the parent's.
"""

from __future__ import annotations

import builtins
import ctypes
import gc
import operator
import os
import re
import random
import secrets
import signal
import sys
import _thread
import time
import types
from collections import Counter
from collections.abc import Callable, Iterable
from itertools import repeat
from typing import TYPE_CHECKING, Any

import torch
import torch.utils._device
from torch.utils._python_dispatch import TorchDispatchMode

from cudagym.sandbox.origin import interpreter_hook
from cudagym.sandbox.timing import foreign_hooks
from cudagym.sandbox.worker.failures import CandidateError
from cudagym.sandbox.worker.state import Snapshot, WorkerState

if TYPE_CHECKING:
    from cudagym.sandbox.origin import KernelWatch

# Switches that would pause the profiler's op recording inside a call (and so hide torch ops
# from the audit). The harness never uses them: in a worker they do nothing but leave a note.
PAUSE_SWITCHES = ("_toggle_collection_dynamic", "_enable_record_function")
_SWITCH_MODULES = (torch._C._autograd, torch.autograd, torch.autograd.profiler)  # noqa: SLF001 - profiler switches


def install_inert_switches(state: WorkerState) -> None:
    """Replace the profiler's pause switches with ones that only note the attempt in `state`."""
    attempts = state.pause_attempts

    def inert(name: str) -> Any:
        def switch(*args: Any, **kwargs: Any) -> None:
            attempts.append(name)
        return switch

    for name in PAUSE_SWITCHES:
        switch = inert(name)
        for mod in _SWITCH_MODULES:
            if hasattr(mod, name):
                setattr(mod, name, switch)


_TORCH_C = torch._C  # noqa: SLF001 - torch's C bindings: some of the functions below are theirs

# The functions whose identity is snapshot before any candidate code runs and checked after.
WATCHED: dict[str, tuple[Any, str]] = {
    **{f"{m.__name__}.{n}": (m, n) for n in PAUSE_SWITCHES for m in _SWITCH_MODULES if hasattr(m, n)},
    "torch.cuda.synchronize": (torch.cuda, "synchronize"),
    "torch.cuda.Event": (torch.cuda, "Event"),
    "torch.cuda.Event.record": (torch.cuda.Event, "record"),
    "torch.cuda.Event.elapsed_time": (torch.cuda.Event, "elapsed_time"),
    "torch.cuda.Event.synchronize": (torch.cuda.Event, "synchronize"),
    "torch.cuda.set_stream": (torch.cuda, "set_stream"),
    "torch.cuda.current_stream": (torch.cuda, "current_stream"),
    "torch.cuda.Stream.wait_stream": (torch.cuda.Stream, "wait_stream"),
    "torch.Tensor.zero_": (torch.Tensor, "zero_"),
    "torch.sum": (torch, "sum"),
    "torch.autograd.profiler.profile.__enter__": (torch.autograd.profiler.profile, "__enter__"),
    "torch.autograd.profiler.profile.__exit__": (torch.autograd.profiler.profile, "__exit__"),
    "torch.autograd._profiler_enabled": (torch.autograd, "_profiler_enabled"),
    "torch.autograd.profiler.record_function.__enter__": (torch.autograd.profiler.record_function, "__enter__"),
    "torch.autograd.profiler.record_function.__exit__": (torch.autograd.profiler.record_function, "__exit__"),
    "time.perf_counter": (time, "perf_counter"),
    "torch.allclose": (torch, "allclose"),
    "torch.Tensor.copy_": (torch.Tensor, "copy_"),
    "torch.Tensor.to": (torch.Tensor, "to"),
    "torch.Tensor.clone": (torch.Tensor, "clone"),
    "torch.Tensor.__new__": (torch.Tensor, "__new__"),
    "torch.nn.Module.__call__": (torch.nn.Module, "__call__"),
    "os.write": (os, "write"),
    "os.read": (os, "read"),
    "os.urandom": (os, "urandom"),
    # the seeds of each timed call's sampled positions and projection weights, and the CPU close's page reads
    "secrets.randbits": (secrets, "randbits"),
    "random._urandom": (random, "_urandom"),
    "torch.Tensor.sum": (torch.Tensor, "sum"),
    # input generation: a hook here would reveal a timed call's inputs before its timer starts
    # (the harness makes them under `with torch.device(...)`, whose mode is torch's DeviceContext)
    "torch.utils._device.DeviceContext.__torch_function__": (
        torch.utils._device.DeviceContext, "__torch_function__"),  # noqa: SLF001 - torch.device(...)'s mode
    # what that mode calls for every factory op (red team 19's d rebound it; a GPU job's inputs only)
    "torch.utils._device._device_constructors": (torch.utils._device, "_device_constructors"),  # noqa: SLF001
    "torch.manual_seed": (torch, "manual_seed"),
    "torch.random.manual_seed": (torch.random, "manual_seed"),
    "torch.randn": (torch, "randn"),
    "torch.rand": (torch, "rand"),
    "torch.randint": (torch, "randint"),
    "torch.Tensor.uniform_": (torch.Tensor, "uniform_"),
    "torch.Tensor.normal_": (torch.Tensor, "normal_"),
    # the timed loop's check that no dispatch or function mode of the candidate's sees its ops
    "torch._C._len_torch_dispatch_stack": (_TORCH_C, "_len_torch_dispatch_stack"),
    "torch._C._len_torch_function_stack": (_TORCH_C, "_len_torch_function_stack"),
    # the dispatcher check's own readers (`dispatch_table`)
    "torch._C._dispatch_dump": (_TORCH_C, "_dispatch_dump"),
    "torch._C._dispatch_get_all_op_names": (_TORCH_C, "_dispatch_get_all_op_names"),
}


# each watched name's owner's type, now (before candidate code): `rebound` reads a name only from
# an owner of the same type (a module's class swapped for a subclass with a property of that name
# runs the candidate's code at the read: red team 17's e and f computed the next output there)
_OWNER_TYPES = {name: type(obj) for name, (obj, _) in WATCHED.items()}


def _bound(obj: Any, attr: str, kind: type) -> Any:
    """What `obj.attr` is bound to, read without running anyone's code (`_REPLACED` if `obj`'s
    type is no longer `kind`): a module's from its dict (a missing name would reach a module
    `__getattr__`), a class's through its unchanged metaclass."""
    if type(obj) is not kind:
        return _REPLACED
    if issubclass(kind, types.ModuleType):
        return vars(obj).get(attr, _REPLACED)
    return getattr(obj, attr, _REPLACED)


_REPLACED = object()


def rebound(originals: dict[str, Any]) -> list[str]:
    """The watched names bound to something else than before candidate code (a few us)."""
    return [name for name, (obj, attr) in WATCHED.items()
            if _bound(obj, attr, _OWNER_TYPES[name]) is not originals[name]]


def object_types(state: WorkerState) -> list[tuple[Any, type, str, bool]]:
    """Every module loaded now, each watched name's owner and each harness class, with its type,
    its name and (modules) whether it has a module `__getattr__`: what `reclassed` holds them to."""
    seen: dict[int, tuple[Any, type, str, bool]] = {}
    for name, mod in list(sys.modules.items()):
        if isinstance(mod, types.ModuleType):
            seen[id(mod)] = (mod, type(mod), name, "__getattr__" in vars(mod))
    for name, (obj, _) in WATCHED.items():
        seen.setdefault(id(obj), (obj, type(obj), name.rsplit(".", 1)[0], False))
    for cls in state.snapshot.class_attrs:
        seen.setdefault(id(cls), (cls, type(cls), cls.__qualname__, False))
    return list(seen.values())


def type_check(objects: list[tuple[Any, type, str, bool]]) -> tuple[tuple[Any, ...], ...]:
    """`object_types` as `reclassed` reads them (with the builtins as they are now)."""
    plain = tuple(vars(o) for o, kind, _, had in objects if issubclass(kind, types.ModuleType) and not had)
    now = dict(vars(builtins))
    return tuple(o for o, *_ in objects), tuple(k for _, k, *_ in objects), plain, tuple(now), tuple(now.values())


# bound now: what `reclassed` runs must not be looked up where the candidate can rebind it
_type, _map, _any, _vars, _is_not, _contains, _repeat = type, map, any, vars, operator.is_not, operator.contains, repeat


def reclassed(state: WorkerState) -> str:
    """Why reading the harness's modules and classes could run the candidate's code, or "": a
    module or class whose type was swapped (a subclass whose properties shadow its names), a
    module given a module-level `__getattr__` (run for a name it lacks), a builtin replaced (the
    harness calls `len`, `isinstance`, ...), an import hook added. Each is how code of the
    candidate's would run inside the harness's steps between calls (the next inputs made, before
    their interval); type comparisons and dict lookups in C (~20 µs)."""
    objs, kinds, plain, names, values = state.type_check
    if _any(_map(_is_not, _map(_type, objs), kinds)) or _any(_map(_contains, plain, _repeat("__getattr__"))):
        for obj, kind, name, had_getattr in state.object_types:
            if _type(obj) is not kind:
                return f"the class of {name} was swapped"
            if not had_getattr and issubclass(kind, types.ModuleType) and "__getattr__" in _vars(obj):
                return f"{name} was given a module __getattr__"
    found = _vars(builtins)
    if _any(_map(_is_not, _map(found.get, names), values)):
        return "a builtin was replaced"
    meta_path, path_hooks = state.import_hooks
    if tuple(sys.meta_path) != meta_path or tuple(sys.path_hooks) != path_hooks:
        return "an import hook was added (sys.meta_path, sys.path_hooks)"
    return ""


def check_reclassed(state: WorkerState, *objects: tuple[Any, type]) -> None:
    """Raise if `reclassed` finds anything, or one of the harness's `objects` is no longer of its
    class (each `(object, class)`), before any other read of the harness's modules."""
    if type(state) is not WorkerState or any(type(o) is not cls for o, cls in objects):
        raise CandidateError("tamper", "the class of one of the harness's objects was swapped by the candidate")
    if why := reclassed(state):
        raise CandidateError("tamper", f"{why} by the candidate: reading it would run the candidate's code inside "
                             "the harness's steps")


def watched_now() -> dict[str, Any]:
    """What each watched name is bound to now."""
    return {name: getattr(obj, attr) for name, (obj, attr) in WATCHED.items()}


# Dispatch keys whose kernels compute (or route to the kernel that does) on the job's devices; the
# dispatcher's dump prints the alias keys among them as "CompositeExplicitAutograd[alias]:"
COMPUTE_KEYS = frozenset(("CPU", "CUDA", "BackendSelect", "CompositeExplicitAutograd", "CompositeImplicitAutograd",
                          "CompositeExplicitAutogradNonFunctional", "Autograd", "AutogradCPU", "AutogradCUDA"))


def _dump_key(line: str) -> str:
    """The dispatch key a line of the dispatcher's dump is about ("" for other lines): alias keys
    print as "Autograd[alias]:", a kernel an override replaced as "... (inactive):"."""
    head, sep, _ = line.partition(":")
    return head.split("[")[0].split(" ")[0] if sep else ""


class InputKernels:
    """The kernels registered, at every dispatch key, for the ops the harness runs to make a
    call's inputs (the task's `get_inputs` under a seed, then the copy into the call's buffers),
    as they were before any candidate code ran. A kernel of the candidate's for one of them
    (`torch.library.Library("aten", "IMPL")`, at any key: an alias key, ADInplaceOrView, ...) would
    see every call's inputs as they are made, before the call's clock starts. `changed()` reads
    those ops' entries again (~10 us each): `Problem.inputs` does before and after every
    generation. The record lives in the candidate's process (docs/protection.md says what that leaves)."""

    def __init__(self, ops: Iterable[str], dump: Callable[[str], str]) -> None:
        self._dump = dump
        self.before = {op: self.kernels(op) for op in sorted(set(ops))}

    def kernels(self, op: str) -> tuple[str, ...]:
        return tuple(line.split(" :: ")[0] for line in self._dump(op).splitlines() if _dump_key(line))

    def changed(self) -> list[str]:
        return [op for op, lines in self.before.items() if self.kernels(op) != lines]

    def check(self) -> None:
        if changed := self.changed():
            raise CandidateError("tamper", f"the candidate registered kernels of its own for {', '.join(changed[:4])}, "
                                 "which the harness runs to make the next call's inputs")


# Python's hooks that run someone's code at the harness's next call or line (profile, trace,
# monitoring callbacks) or at its next audited event: a worker refuses them all, through an audit
# hook of its own installed before any candidate code (`prewarm.prewarm_host`; audit hooks cannot be
# removed, and a later one is refused). A hook that ran at the harness's calls after a timed call's
# close could do the call's work untimed, or rewrite the evidence before it is sent; C code that
# writes the interpreter's thread state directly bypasses this (`timing.foreign_hooks` then sees
# a Python-level one; a C-level one is left: see docs/protection.md).
# torch's C++ functions looked up by name through ctypes (the same audit hook sees `ctypes.dlsym`):
# a call into ATen below the dispatcher, which neither the import audit (no import) nor the op
# counter (no dispatcher) sees; nothing honest looks up torch's mangled C++ names from Python
TORCH_MANGLED = ("_ZN2at", "_ZNK2at", "_ZN3c10", "_ZNK3c10", "_ZN5torch", "_ZNK5torch")
_HOOK_EVENTS = ("sys.setprofile", "sys.settrace", "sys.addaudithook", "sys.monitoring.register_callback")
# the interpreter's frames and their locals, reached through ctypes without `sys._getframe`'s audit
# event (red team 28's a14 walked up to the harness's pending report from `PyEval_GetFrame`). Only
# looked up through ctypes: pybind11's error path imports `PyFrame_GetBack`, so a built object may
_FRAME_ACCESS = re.compile(r"^_?(PyEval_GetFrame\w*|PyThreadState_GetFrame|PyFrame_GetBack|PyFrame_GetLocals"
                           r"|PyFrame_GetGlobals|PyFrame_FastToLocals\w*|PyEval_GetLocals|PyEval_GetGlobals"
                           r"|PyEval_GetFrameLocals|PyEval_GetFrameGlobals|PyThreadState_Get(Unchecked)?"
                           r"|PyGILState_GetThisThreadState|_PyThreadState_UncheckedGet)$")
# another thread's frames and the whole object graph: how code beside the harness finds the next
# call's inputs before its interval opens (red team 14's b read `drive_calls`'s through
# `sys._current_frames` from a thread of its own and ran torch's GELU on them meanwhile)
_SEARCH_EVENTS = ("sys._current_frames", "gc.get_objects", "gc.get_referrers")


def audit_hook(state: WorkerState) -> Callable[[str, tuple], None]:
    """The worker's audit hook: refuses Python's hooks and torch's C++ names looked up through
    ctypes, and notes both in `state` (bound now: the lists, not the attributes)."""
    seen, lookups = state.hook_attempts, state.torch_lookups

    def refuse_hooks(event: str, args: tuple) -> None:
        if event in _HOOK_EVENTS:
            seen.append(event)
            raise RuntimeError(f"{event} is refused in a cudagym worker "
                               "(a hook would run code outside the timed calls)")
        if event in _SEARCH_EVENTS:
            seen.append(event)
            raise RuntimeError(f"{event} is refused in a cudagym worker (it reaches the harness's own objects)")
        if event in ("ctypes.dlsym", "ctypes.dlsym/handle") and args:
            name = args[-1].decode(errors="replace") if isinstance(args[-1], bytes) else args[-1]
            if isinstance(name, str) and (interpreter_hook(name) or _FRAME_ACCESS.match(name)):
                seen.append(f"ctypes lookup of {name}")
                raise PermissionError(f"looking up {name} through ctypes is refused in a cudagym worker "
                                      "(it runs code of the candidate's inside the harness's Python)")
            if isinstance(name, str) and name.startswith(TORCH_MANGLED):
                lookups.append(name)  # noted for the reason; the lookup itself fails, whatever
                # becomes of the note (a Python list in the candidate's process)
                raise PermissionError(f"looking up torch's C++ function {name[:120]} through ctypes is refused "
                                      "in a cudagym worker (torch's compute below the dispatcher)")

    return refuse_hooks


def signal_handlers() -> dict[int, Any]:
    """Python's handler of every signal (`signal.getsignal`; None where none was set from Python)."""
    return {int(s): signal.getsignal(s) for s in signal.valid_signals()}


_GETSIGNAL = signal.getsignal  # as bound when the harness is imported


def foreign_signal_handlers(state: WorkerState) -> str:
    """The signals whose Python handler is not the one the worker had before candidate code ran
    (names joined; "" for none). A handler runs on the harness's thread between any two of its
    instructions (with `signal.setitimer`, every few microseconds): between the next call's
    inputs and its interval, where it could compute the output untimed, or between a call and
    its report."""
    before = state.signal_handlers
    if signal.getsignal is not _GETSIGNAL:  # red team 23's rewrote the pending report when called here
        return "signal.getsignal replaced"
    if not _any(_map(_is_not, _map(_GETSIGNAL, before), before.values())):
        return ""  # the common case, in C
    return ", ".join(signal.Signals(s).name if s in signal.Signals._value2member_map_ else str(s)
                     for s, h in signal_handlers().items() if h is not before.get(s))


def snapshot_originals(state: WorkerState) -> None:
    """Torch rebinds some functions as it loads parts of itself (dynamo rebinds
    torch.manual_seed, for one): the identity snapshot is retaken after each prewarm step, still
    before any candidate code runs; the dispatcher's table with it."""
    state.originals.update(watched_now())
    state.gc_callbacks = tuple(gc.callbacks)
    state.signal_handlers = signal_handlers()
    state.object_types = object_types(state)
    state.type_check = type_check(state.object_types)
    state.import_hooks = (tuple(sys.meta_path), tuple(sys.path_hooks))
    state.dispatch.clear()
    state.dispatch.update(dispatch_table(state.originals))


def dispatch_table(originals: dict[str, Any]) -> dict[str, tuple[str, ...]]:
    """For every op the dispatcher knows, where its kernels at the compute keys were registered
    (~70 ms for ~3600 ops), read with the `originals` of the dispatcher's readers. A candidate
    that registers its own kernel for one of torch's ops (`TORCH_LIBRARY_IMPL(aten, CPU, m)`,
    `torch.library.Library("aten", "IMPL")`) would run inside the harness's own work between calls
    (input generation, refills), where it sees the next call's inputs before the timer starts;
    `check_tamper` compares this table with the one taken before candidate code ran (new ops of
    the candidate's own namespaces are its business)."""
    dump, names = originals["torch._C._dispatch_dump"], originals["torch._C._dispatch_get_all_op_names"]
    return {n: tuple(line.split(" :: ")[0] for line in dump(n).splitlines() if _dump_key(line) in COMPUTE_KEYS)
            for n in names()}


def read_dispatch_table(originals: dict[str, Any]) -> dict[str, tuple[str, ...]]:
    """`dispatch_table` with the garbage collector off and its callbacks set aside, so that no
    candidate code runs inside the read (a gc callback, run by a collection the read's own
    allocations start, could unregister a kernel once it sees this read on the stack)."""
    enabled, saved = gc.isenabled(), list(gc.callbacks)
    gc.disable()
    gc.callbacks.clear()
    try:
        return dispatch_table(originals)
    finally:
        gc.callbacks.extend(saved)
        if enabled:
            gc.enable()


# -- the harness's own code ----------------------------------------------------------------------
def own_functions(mod: types.ModuleType) -> dict[tuple[types.ModuleType, str], tuple[Any, Any]]:
    """The module's functions (cached ones too) and their code."""
    return {(mod, k): (v, getattr(v, "__wrapped__", v).__code__) for k, v in list(vars(mod).items())
            if isinstance(getattr(v, "__wrapped__", v), types.FunctionType) and v.__module__ == mod.__name__}


def take_snapshot(modules: Iterable[types.ModuleType], other_modules: Iterable[types.ModuleType],
                  classes: Iterable[type]) -> Snapshot:
    """The `Snapshot` of the harness's `modules` (their names and own functions), the own
    functions of `other_modules` (the timer's) and the methods of `classes`."""
    modules = list(modules)
    names = {(m, k): v for m in modules for k, v in list(vars(m).items()) if callable(v) and not k.startswith("__")}
    functions = {k: v for m in [*modules, *other_modules] for k, v in own_functions(m).items()}
    methods = {(cls, k): v for cls in classes for k, v in vars(cls).items() if callable(v)}
    code = {key: fn.__code__ for key, fn in methods.items() if isinstance(fn, types.FunctionType)}
    return Snapshot(names, functions, methods, code, {m: frozenset(vars(m)) for m in modules},
                    {cls: dict(vars(cls)) for cls in classes})


def globals_check(modules: Iterable[types.ModuleType]) -> Callable[[], str]:
    """A check of every global of `modules` as bound now (made before any candidate code): the
    name of the first module one of whose globals was rebound, added or removed since, or "".
    Between a timed call and its report (and the next seed) the harness looks up names in these
    modules' globals (the channel's `dumps`, `loads` and frame helpers, the loop's constants, the
    checks' own helpers): a one-shot replacement there, put back as it ran, would run the
    candidate's code after the per-call checks (red team 29's a17 did it through timed.py's
    `MODEL_CALLS_KEY`). Everything it calls is bound in its closure (C functions: identity
    comparisons of a few hundred names, ~10 µs)."""
    modules = tuple(modules)
    found = tuple(vars(m) for m in modules)
    sizes = tuple(len(g) for g in found)
    each = tuple(g for g in found for _ in g)  # one flat pass over every name: ~30 µs for ~700 names
    names = tuple(k for g in found for k in g)
    values = tuple(v for g in found for v in g.values())
    titles = tuple(m.__name__ for m in modules)
    any_, map_, is_not, ne, len_, get = any, map, operator.is_not, operator.ne, len, dict.get

    def changed() -> str:
        if not (any_(map_(is_not, map_(get, each, names), values)) or any_(map_(ne, map_(len_, found), sizes))):
            return ""
        at = 0  # which module (the job is refused either way)
        for g, size, title in zip(found, sizes, titles, strict=True):
            if len_(g) != size or any_(map_(is_not, map_(get, each[at:at + size], names[at:at + size]),
                                            values[at:at + size])):
                return title
            at += size
        return titles[0]

    return changed


def check_classes(state: WorkerState) -> None:
    """Raise if an attribute of a harness class was added, removed or rebound since the snapshot
    (a few µs: each timed call's request checks it before its report leaves)."""
    for cls, attrs in state.snapshot.class_attrs.items():
        now = vars(cls)
        if len(now) != len(attrs) or any(now.get(k, attrs) is not v for k, v in attrs.items()):
            changed = sorted(set(now) ^ set(attrs)) or [k for k, v in attrs.items() if now.get(k, attrs) is not v]
            raise CandidateError("tamper", f"the harness class {cls.__name__} was modified by the candidate "
                                 f"({', '.join(changed[:3])})")


def added_names(snap: Snapshot) -> list[str]:
    """Names added to a harness module since the snapshot, but for its own submodules (an import
    of `package.sub` binds `sub` in the package)."""
    return [f"{m.__name__}.{k}" for m, keys in snap.keys.items() for k, v in list(vars(m).items())
            if k not in keys and not (isinstance(v, types.ModuleType) and v.__name__ == f"{m.__name__}.{k}")]


def check_torch_lookups(state: WorkerState) -> None:
    """Raise if the candidate's Python looked up torch's C++ functions through ctypes (`audit_hook`)."""
    if state.torch_lookups:
        raise CandidateError("audit", "the candidate looked up torch's C++ function "
                             f"{state.torch_lookups[0][:120]} through ctypes: torch's compute below the dispatcher")


def channel_parts(ch: Any) -> dict[str, Any]:
    """What the result channel writes with and reads the parent's answers with (its and its
    reader's fixed attributes, by identity): a candidate that rebinds them could drop or forge
    the frames that mark where forward runs (`Channel.mark`), or the answers."""
    reader = vars(ch).get("_stdin")
    return {**{k: v for k, v in vars(ch).items() if k != "_shm_off"},
            **{f"_stdin.{k}": v for k, v in (vars(reader).items() if reader is not None else ()) if k != "_buf"},
            "<type>": type(ch), "<reader type>": type(reader)}


def check_channel(state: WorkerState) -> None:
    """Raise if the job's channel is not as it was before candidate code (`channel_parts`)."""
    ch = state.channel
    if ch is None:
        return
    now = channel_parts(ch)
    if now.keys() != state.channel_parts.keys() or any(now[k] is not v for k, v in state.channel_parts.items()):
        raise CandidateError("tamper", "the harness's result channel was modified by the candidate")
    # the reader's buffer, rebound by each read, must stay a plain bytearray: red team 30 put a subclass
    # there whose `__contains__` ran at every answer's read (after the worker's resume, before any check)
    if type(vars(vars(ch).get("_stdin")).get("_buf")) is not bytearray:
        raise CandidateError("tamper", "the harness's result channel was modified by the candidate (its reader's "
                             "buffer is not a bytearray)")


def check_tamper(state: WorkerState, dispatcher: bool = True) -> None:
    """Raise if a watched function, a harness function (or its code) or method was replaced, or a
    Python profile, trace or audit hook was set or tried; with `dispatcher`, also if kernels of
    torch's ops were registered (`dispatch_table`, ~70 ms: a job's last check, bound before any
    candidate code ran, always reads it)."""
    if state.hook_attempts:
        raise CandidateError("tamper", f"the candidate tried a call the worker refuses ({state.hook_attempts[0]}: "
                             "a Python hook, or a search of another thread's frames or of the object graph)")
    check_reclassed(state)
    check_torch_lookups(state)
    if hooks := foreign_hooks():
        raise CandidateError("tamper", f"a Python hook the harness did not set is active: {hooks}")
    if handlers := foreign_signal_handlers(state):
        raise CandidateError("tamper", f"a signal handler the harness did not set is active ({handlers}): it would run "
                             "the candidate's code between the harness's steps")
    if callbacks := [cb for cb in list(gc.callbacks) if not any(cb is old for old in state.gc_callbacks)]:
        raise CandidateError("tamper", "a garbage collector callback the harness did not set is active: "
                             f"{callbacks[0]!r:.120} (it would run the candidate's code inside the harness's checks)")
    if state.pause_attempts:
        raise CandidateError("tamper", "the candidate tried to pause the profiler's op recording "
                             f"({state.pause_attempts[0]})")
    originals = state.originals
    if replaced := rebound(originals):
        raise CandidateError("tamper", f"{replaced[0]} was replaced by the candidate")
    check_channel(state)
    before = state.dispatch if dispatcher else None
    if before and (changed := sorted(n for n, k in read_dispatch_table(originals).items()
                                     if n in before and before[n] != k)):
        raise CandidateError("tamper", "the candidate registered kernels of its own for torch's ops with the "
                             f"dispatcher ({', '.join(changed[:4])}): the harness runs torch's ops between calls")
    snap = state.snapshot
    if added := added_names(snap):
        raise CandidateError("tamper", f"the candidate added {', '.join(added[:4])} to the harness's modules "
                             "(a name there shadows a builtin or an import for the harness's own functions)")
    for (mod, name), obj in snap.names.items():
        if vars(mod).get(name) is not obj:
            raise CandidateError("tamper", f"the harness's {name} was replaced by the candidate")
    for (mod, name), (fn, code) in snap.functions.items():
        bound: Any = getattr(mod, name, None)
        if bound is not fn or getattr(fn, "__wrapped__", fn).__code__ is not code:
            raise CandidateError("tamper", f"the harness function {name} was replaced by the candidate")
    for (cls, attr), fn in snap.methods.items():
        if cls.__dict__.get(attr) is not fn or (isinstance(fn, types.FunctionType)
                                                 and fn.__code__ is not snap.method_code[(cls, attr)]):
            raise CandidateError("tamper", f"the harness method {cls.__name__}.{attr} was replaced by the candidate")
    check_classes(state)


# -- the audit's instruments ---------------------------------------------------------------------
class OpRecorder(TorchDispatchMode):
    """Records every ATen op executed at the dispatcher while active."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: Counter[str] = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None) -> Any:  # noqa: ANN001
        self.ops[func._schema.name] += 1  # noqa: SLF001 - the op's schema name
        return func(*args, **(kwargs or {}))


_thread_count = _thread._count  # bound before any candidate code  # noqa: SLF001


def c_entries(functions: list[Any]) -> list[tuple[int, int, int]]:
    """For each built-in function among `functions` (`time.perf_counter`): its object's address,
    its method definition's and the C function that definition points to. Red team 14's a
    rewrote the definition behind `time.perf_counter` from C++ (the same object, so every
    identity check held) and moved each call's end back; `entries_changed` compares."""
    out = []
    for f in functions:
        if isinstance(f, types.BuiltinFunctionType):
            definition = _word(id(f) + 2 * _WORD).value or 0
            out.append((id(f), definition, (_word(definition + _WORD).value or 0) if definition else 0))
        elif isinstance(f, _CFUNC):  # a ctypes function (the native close): the address it calls (-1)
            out.append((ctypes.addressof(f), _word(ctypes.addressof(f)).value or 0, -1))
    return out


def entries_changed(entries: list[tuple[int, int, int]]) -> bool:
    """Whether a definition `c_entries` read, or the address a ctypes function calls (red team 33's
    native open swapped inside its object), has been pointed elsewhere since."""
    return any(_word(obj).value != definition if meth == -1 else
               _word(obj + 2 * _WORD).value != definition or _word(definition + _WORD).value != meth
               for obj, definition, meth in entries)


_word = ctypes.c_void_p.from_address  # bound before any candidate code
_CFUNC: type[Any] = ctypes.CFUNCTYPE(None).__mro__[1]  # ctypes' function pointer base (`_CFuncPtr`)
_WORD = ctypes.sizeof(ctypes.c_void_p)
_CLOCK_CALLS = ("clock_gettime", "clock_gettime64", "__clock_gettime", "__clock_gettime64")


def clock_slots(functions: list[Any]) -> list[tuple[int, int]]:
    """(address, value) of each slot of a global offset table through which the images holding
    `functions`' C code (libpython's `time.perf_counter`) call `clock_gettime`, read once they
    have been called (a lazily bound slot holds the function then). Red team 15 wrote its own
    hook into libpython's slot (plain data, writable) and moved each call's end back; every
    object, definition and C function of `c_entries` stayed as it was. Compared by
    `slots_changed`. An image whose relocations cannot be read is left out."""
    from elftools.elf.elffile import ELFFile
    from elftools.elf.sections import SymbolTableSection

    for f in functions:
        if isinstance(f, types.BuiltinFunctionType) and f.__name__ in ("perf_counter", "monotonic", "time"):
            f()  # binds the slot
    addresses = [meth for _, _, meth in c_entries(functions) if meth]
    images: dict[str, int] = {}  # path: load base
    try:
        with open("/proc/self/maps") as maps:
            rows = [line.split() for line in maps]
    except OSError:
        return []
    for row in rows:
        if len(row) < 6 or not row[5].startswith("/"):
            continue
        start, end = (int(x, 16) for x in row[0].split("-"))
        if any(start <= a < end for a in addresses):
            base = min(int(r[0].split("-")[0], 16) - int(r[2], 16) for r in rows if len(r) >= 6 and r[5] == row[5])
            images[row[5]] = base
    out = []
    for path, base in images.items():
        try:
            with open(path, "rb") as fh:
                elf = ELFFile(fh)
                load = base if elf.header["e_type"] == "ET_DYN" else 0
                for name in (".rela.plt",):  # called through the PLT: its jump slots
                    section = elf.get_section_by_name(name)
                    if section is None or not hasattr(section, "iter_relocations"):
                        continue
                    symbols = elf.get_section(section["sh_link"])
                    if not isinstance(symbols, SymbolTableSection):
                        continue
                    for rel in section.iter_relocations():
                        if rel["r_info_sym"] and symbols.get_symbol(rel["r_info_sym"]).name in _CLOCK_CALLS:
                            slot = load + rel["r_offset"]
                            out.append((slot, _word(slot).value or 0))
        except Exception:  # noqa: BLE001 - not an ELF image pyelftools can read: left out
            continue
    return out


def slots_changed(slots: list[tuple[int, int]]) -> bool:
    """Whether a slot `clock_slots` read holds another address since."""
    return any(_word(slot).value != value for slot, value in slots)


def live_threads() -> int:
    """Python threads of this process beside the main one (those `_thread.start_new_thread`
    started too, which `threading` does not know: red team 14's b)."""
    return _thread_count()


def live_helpers() -> tuple[int, int]:
    """`live_threads`, and this process's child processes (all generations)."""
    import psutil

    return _thread_count(), len(psutil.Process().children(recursive=True))


def check_torch_modes() -> None:
    """Raise if a torch dispatch or function mode is active: it would see the harness's ops."""
    if torch._C._len_torch_dispatch_stack() or torch._C._len_torch_function_stack():  # noqa: SLF001 - mode stacks
        raise CandidateError("tamper", "a torch dispatch or function mode was left active by the candidate")


def poison_allocator(device: torch.device, nbytes: int) -> None:
    """Fill soon-to-be-reused allocator memory with NaN so unwritten outputs cannot pass."""
    n = max(nbytes // 4, 1 << 16)
    buf = torch.empty(n, dtype=torch.float32, device=device)
    buf.fill_(float("nan"))
    del buf


def op_watch(state: WorkerState) -> Any:
    """The process's op counter (`cudagym.sandbox.opwatch`), loaded by `prewarm_host`."""
    if state.opwatch is None:
        raise RuntimeError("the op counter was not loaded (prewarm_host)")
    return state.opwatch


def watch_changes(state: WorkerState) -> int:
    """How many times the op counter was armed, disarmed or reset so far, by its C library's count."""
    if state.opwatch_changes is None:
        raise RuntimeError("the op counter was not loaded (prewarm_host)")
    return state.opwatch_changes()


def watch_alive(state: WorkerState, watch: Any, expected_changes: int) -> None:
    """Raise unless the op counter still counts and its state changed only as the harness changed
    it (`expected_changes`: arms, disarms and resets so far, by the C library's own count)."""
    why = watch.check_alive()
    if not why and watch_changes(state) != expected_changes:
        why = "it was armed, disarmed or reset by the candidate"
    if why:
        raise CandidateError("tamper", f"the harness's op counter was disabled: {why}")


def kernel_watch(state: WorkerState, device: torch.device) -> KernelWatch | None:
    """The process's kernel watcher on a GPU job; None on the CPU or where it is missing (the
    verify result says why, and the parent fails the audit on it)."""
    return state.kwatch if device.type == "cuda" else None


def kernels_alive(state: WorkerState, kwatch: KernelWatch | None) -> None:
    """Raise unless the kernel watcher still sees the harness's probe launch on this thread."""
    if kwatch is None:
        return
    probe = state.kprobe
    why = kwatch.check_alive(lambda: probe.fill_(1.0)) if probe is not None else "its probe tensor is missing"
    if why:
        raise CandidateError("tamper", f"the harness's kernel watcher was disabled: {why}")
