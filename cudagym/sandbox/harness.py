"""What a worker does with one job: load the reference and the candidate, check, time, report.

Runs inside the sandboxed worker process, next to the candidate's code, so it trusts nothing
the candidate can reach and keeps nothing that decides the reward:
- secrets arrive one step at a time, on request (`Channel.request`): a verify trial's inputs when
  the trial starts, a timed call's when the call starts (`cudagym.sandbox.feed`);
- raw outputs, samples of timed outputs and each call's time go to the parent as soon as they
  exist; the parent compares them with a separate reference-only worker's outputs and computes
  the statistics;
- references to the timing and synchronization functions are captured before any candidate code
  runs, and any replacement is reported as tampering.
"""

from __future__ import annotations

import importlib.util
import json
import math
import mmap
import os
import random
import secrets
import subprocess
import sys
import threading
import time
import traceback
import types
from bisect import bisect_right
from collections import Counter
from pathlib import Path
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from cudagym import runtime
from cudagym.core.audit import STRICT_ALLOWED, forbidden_ops
from cudagym.sandbox.inline import inline_problems
from cudagym.sandbox.opwatch import OpWatch
from cudagym.sandbox.origin import MODEL_CALLS_KEY, KernelWatch, records_as_counts
from cudagym.sandbox.protocol import MAX_IDLE_MS, Job, encode_frame_head
from cudagym.sandbox.timing import (PROJECTIONS, SAMPLE_SIZE, DeviceTimer, Evidence, TimerTampered, drive_calls,
                                    foreign_hooks, gate_kernels, harness_calibration, projection, use_native_close)
from cudagym.sandbox.wire import WIRE_DTYPES

# Switches that would pause the profiler's op recording inside a call (and so hide torch ops
# from the audit). The harness never uses them: in a worker they do nothing but leave a note.
_PAUSE_SWITCHES = ("_toggle_collection_dynamic", "_enable_record_function")
_PAUSE_ATTEMPTS: list[str] = []


def _inert_switch(name: str) -> Any:
    def switch(*args: Any, **kwargs: Any) -> None:
        _PAUSE_ATTEMPTS.append(name)
    return switch


for _name in _PAUSE_SWITCHES:
    _switch = _inert_switch(_name)
    for _mod in (torch._C._autograd, torch.autograd, torch.autograd.profiler):
        if hasattr(_mod, _name):
            setattr(_mod, _name, _switch)

# Identity snapshot, taken at import (before any candidate code runs) and checked after.
_WATCHED: dict[str, tuple[Any, str]] = {
    **{f"{m.__name__}.{n}": (m, n) for n in _PAUSE_SWITCHES
       for m in (torch._C._autograd, torch.autograd, torch.autograd.profiler) if hasattr(m, n)},
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
    "torch.manual_seed": (torch, "manual_seed"),
    "torch.random.manual_seed": (torch.random, "manual_seed"),
    "torch.randn": (torch, "randn"),
    "torch.rand": (torch, "rand"),
    "torch.randint": (torch, "randint"),
    "torch.Tensor.uniform_": (torch.Tensor, "uniform_"),
    "torch.Tensor.normal_": (torch.Tensor, "normal_"),
    # the timed loop's check that no dispatch or function mode of the candidate's sees its ops
    "torch._C._len_torch_dispatch_stack": (torch._C, "_len_torch_dispatch_stack"),
    "torch._C._len_torch_function_stack": (torch._C, "_len_torch_function_stack"),
    # the dispatcher check's own readers (`dispatch_table`)
    "torch._C._dispatch_dump": (torch._C, "_dispatch_dump"),
    "torch._C._dispatch_get_all_op_names": (torch._C, "_dispatch_get_all_op_names"),
}
_ORIGINALS = {name: getattr(obj, attr) for name, (obj, attr) in _WATCHED.items()}
# Dispatch keys whose kernels compute (or route to the kernel that does) on the job's devices
_COMPUTE_KEYS = ("CPU:", "CUDA:", "BackendSelect:", "CompositeExplicitAutograd:", "CompositeImplicitAutograd:",
                 "CompositeExplicitAutogradNonFunctional:", "Autograd:", "AutogradCPU:", "AutogradCUDA:")
_DISPATCH: dict[str, tuple[str, ...]] = {}  # `dispatch_table()` before any candidate code ran

# Python's hooks that run someone's code at the harness's next call or line (profile, trace,
# monitoring callbacks) or at its next audited event: a worker refuses them all, through an audit
# hook of its own installed before any candidate code (`prewarm_host`; audit hooks cannot be
# removed, and a later one is refused). A hook that ran at the harness's calls after a timed call's
# close could do the call's work untimed, or rewrite the evidence before it is sent; C code that
# writes the interpreter's thread state directly bypasses this (`timing.foreign_hooks` then sees
# a Python-level one; a C-level one is left: see docs/protection.md).
_HOOK_ATTEMPTS: list[str] = []
# torch's C++ functions looked up by name through ctypes (the same audit hook sees `ctypes.dlsym`):
# a call into ATen below the dispatcher, which neither the import audit (no import) nor the op
# counter (no dispatcher) sees; nothing honest looks up torch's mangled C++ names from Python
_TORCH_LOOKUPS: list[str] = []
_TORCH_MANGLED = ("_ZN2at", "_ZNK2at", "_ZN3c10", "_ZNK3c10", "_ZN5torch", "_ZNK5torch")


def _refuse_hooks(event: str, args: tuple, _seen: list[str] = _HOOK_ATTEMPTS) -> None:
    if event in ("sys.setprofile", "sys.settrace", "sys.addaudithook", "sys.monitoring.register_callback"):
        _seen.append(event)
        raise RuntimeError(f"{event} is refused in a cudagym worker (a hook would run code outside the timed calls)")
    if event in ("ctypes.dlsym", "ctypes.dlsym/handle") and args:
        name = args[-1].decode(errors="replace") if isinstance(args[-1], bytes) else args[-1]
        if isinstance(name, str) and name.startswith(_TORCH_MANGLED):
            _TORCH_LOOKUPS.append(name)

class CandidateError(Exception):
    """The candidate's own code failed; `kind` is an ErrorKind value."""

    def __init__(self, kind: str, message: str):
        super().__init__(message)
        self.kind = kind


def _failure_kind(e: BaseException) -> str:
    """Sandbox refusals (writes outside the workspace, network) are named as such."""
    import errno

    if _HOOK_ATTEMPTS:  # the refusal of a profile/trace/audit hook (`_refuse_hooks`) surfaced here
        return "tamper"
    if isinstance(e, PermissionError) or (isinstance(e, OSError) and e.errno in (errno.ENETUNREACH, errno.EROFS)):
        return "sandbox_violation"
    if isinstance(e, BlockingIOError) or (isinstance(e, OSError) and e.errno == errno.EAGAIN):
        return "process_limit"
    if isinstance(e, MemoryError) or "can't allocate memory" in str(e):
        return "memory_limit"
    if "CUDA error" in str(e) or "illegal memory access" in str(e) or "device-side assert" in str(e):
        return "crash"  # the kernel broke the CUDA context, even if the error surfaced as an exception
    return "exception"


class OpRecorder(TorchDispatchMode):
    """Records every ATen op executed at the dispatcher while active."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: Counter[str] = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        self.ops[func._schema.name] += 1
        return func(*args, **(kwargs or {}))


class Channel:
    """The result channel to the parent: frames on a pipe, tensor bytes in a shared-memory file.

    The parent hands every worker a sealed memfd of fixed capacity; a tensor is copied (from the
    GPU, directly) into the next free region and its frame names the region. The parent maps
    the file only after the worker is gone, so the bytes it compares can no longer change.
    Without a memfd, tensor bytes travel on the pipe.
    """

    def __init__(self, fd: int, nonce: str, shm_fd: int | None = None):
        self._fd, self._nonce, self._shm = fd, nonce, shm_fd
        self._write = os.write
        self._shm_off = 0
        self._shm_cap = os.fstat(shm_fd).st_size if shm_fd is not None else 0
        self._premapped = _PREMAPPED[0] if _PREMAPPED and shm_fd is not None else None

    def _write_all(self, data: bytes | memoryview) -> None:
        view = memoryview(data)
        while view:
            n = self._write(self._fd, view)
            view = view[n:]

    def send(self, header: dict[str, Any], payload: bytes | memoryview = b"") -> None:
        self._write_all(encode_frame_head(header, len(payload)))
        if len(payload):
            self._write_all(payload)

    def send_tensor(self, role: str, trial: int, index: int, t: torch.Tensor, pipe: bool = False, **extra: Any) -> None:
        """One tensor frame; its bytes in the result memory, or with `pipe` (or without result
        memory) on the pipe: out of the worker's reach once written (the result memory stays
        writable by the worker, host code and kernels alike, until it dies)."""
        c = t.detach()
        header = {"type": "tensor", "role": role, "trial": trial, "index": index,
                  "dtype": str(c.dtype).removeprefix("torch."), "shape": list(c.shape), **extra}
        n = c.numel() * c.element_size()
        if n and self._shm is not None and not pipe:
            off = self._shm_off
            if off + n > self._shm_cap:
                raise CandidateError("output_format", f"the outputs exceed the result limit of {self._shm_cap >> 20} MB")
            if self._premapped is not None and off + n <= len(self._premapped):
                mm, at = self._premapped, off  # populated (and page-locked on a GPU) while a spare
            else:
                mm, at = _map_shared(self._shm, n, off), 0
            dst = torch.frombuffer(mm, dtype=c.dtype, count=c.numel(), offset=at)
            dst.copy_(c.reshape(-1))  # device -> shared pages, one copy
            del dst
            if mm is not self._premapped:
                mm.close()
            self._shm_off = off + -(-n // mmap.ALLOCATIONGRANULARITY) * mmap.ALLOCATIONGRANULARITY
            self.send({**header, "offset": off, "nbytes": n})
            return
        c = c.to("cpu").contiguous()
        raw = memoryview(c.reshape(-1).view(torch.uint8).numpy()).cast("B") if c.numel() else b""
        self.send(header, raw)

    def final(self, body: dict[str, Any]) -> None:
        self.send({"type": "final", "nonce": self._nonce, **body})

    def request(self, what: str, **body: Any) -> dict[str, Any]:
        """Ask the parent for the next step (see `cudagym.sandbox.feed`); its answer."""
        self.send({"type": "request", "what": what, **body})
        line = STDIN.readline()
        try:
            answer = json.loads(line)
        except ValueError:
            answer = None
        if not isinstance(answer, dict):
            raise CandidateError("tamper", "the evaluator's answers on stdin were taken or garbled by the candidate")
        if "refused" in answer:
            raise CandidateError("tamper", f"the evaluator refused a request: {answer['refused']}")
        return answer


class LineReader:
    """Lines from a file descriptor, unbuffered beyond the current line's read (the job line,
    then the parent's answers, arrive on stdin one at a time)."""

    def __init__(self, fd: int):
        self._fd, self._buf = fd, bytearray()
        self._read = os.read

    def readline(self) -> bytes:
        while b"\n" not in self._buf:
            chunk = self._read(self._fd, 1 << 16)
            if not chunk:
                line, self._buf = bytes(self._buf), bytearray()
                return line
            self._buf += chunk
        end = self._buf.index(b"\n") + 1
        line = bytes(self._buf[:end])
        del self._buf[:end]
        return line


STDIN = LineReader(0)


# -- loading ----------------------------------------------------------------------------------
MAX_MESSAGE = 1000  # characters of an exception's own message kept in a verdict


def candidate_traceback(exc: BaseException, roots: list[str]) -> str:
    """The exception with only the frames from the candidate's own files."""
    tb = traceback.extract_tb(exc.__traceback__)
    keep = [f for f in tb if any(f.filename.startswith(r) for r in roots) or f.filename.startswith("<candidate")]
    lines = traceback.format_list(keep)[-12:] if keep else []
    what = "".join(traceback.format_exception_only(type(exc), exc)).strip()
    if len(what) > MAX_MESSAGE:  # the candidate's own message, trimmed (it may hold raw data)
        what = what[:MAX_MESSAGE] + f" ... ({len(what)} characters)"
    return ("Traceback (candidate frames):\n" + "".join(lines) if lines else "") + what


def load_reference(job: Job) -> types.ModuleType:
    mod = types.ModuleType("cudagym_reference")
    mod.__file__ = f"<reference {job.task_id}>"
    exec(compile(job.task_code, mod.__file__, "exec"), mod.__dict__)  # noqa: S102 - the task is trusted
    return mod


def load_candidate(job: Job) -> types.ModuleType:
    ws = job.workspace
    if job.artifact_dir:
        os.environ[runtime.ENV_VAR] = job.artifact_dir
        sys.path.insert(0, job.artifact_dir)
    sys.path.insert(0, ws)
    path = Path(ws) / "model_new.py"
    if not path.is_file():
        raise CandidateError("exception", "model_new.py does not exist: write it first")
    spec = importlib.util.spec_from_file_location("model_new", path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules["model_new"] = mod
    try:
        spec.loader.exec_module(mod)
    except Exception as e:  # noqa: BLE001
        raise CandidateError(_failure_kind(e), "importing model_new.py failed:\n" + candidate_traceback(e, [ws])) from None
    if not isinstance(getattr(mod, "ModelNew", None), type):
        raise CandidateError("exception", "model_new.py must define a class ModelNew(nn.Module)")
    return mod


def check_torch_lookups() -> None:
    """Raise if the candidate's Python looked up torch's C++ functions through ctypes (`_refuse_hooks`)."""
    if _TORCH_LOOKUPS:
        raise CandidateError("audit", "the candidate looked up torch's C++ function "
                             f"{_TORCH_LOOKUPS[0][:120]} through ctypes: torch's compute below the dispatcher")


def check_tamper() -> None:
    """Raise if a watched function, a harness function (or its code) or method was replaced, or a
    Python profile, trace or audit hook was set or tried."""
    if _HOOK_ATTEMPTS:
        raise CandidateError("tamper", f"the candidate tried to set a Python hook ({_HOOK_ATTEMPTS[0]})")
    check_torch_lookups()
    if hooks := foreign_hooks():
        raise CandidateError("tamper", f"a Python hook the harness did not set is active: {hooks}")
    if _PAUSE_ATTEMPTS:
        raise CandidateError("tamper", f"the candidate tried to pause the profiler's op recording ({_PAUSE_ATTEMPTS[0]})")
    for name, (obj, attr) in _WATCHED.items():
        if getattr(obj, attr, None) is not _ORIGINALS[name]:
            raise CandidateError("tamper", f"{name} was replaced by the candidate")
    if _DISPATCH and (changed := sorted(n for n, k in dispatch_table().items() if n in _DISPATCH and _DISPATCH[n] != k)):
        raise CandidateError("tamper", "the candidate registered kernels of its own for torch's ops with the "
                             f"dispatcher ({', '.join(changed[:4])}): the harness runs torch's ops between calls")
    g = globals()
    for name, obj in _HARNESS_NAMES.items():
        if g.get(name) is not obj:
            raise CandidateError("tamper", f"the harness's {name} was replaced by the candidate")
    for (mod, name), (fn, code) in _HARNESS_FUNCS.items():
        if getattr(mod, name, None) is not fn or getattr(fn, "__wrapped__", fn).__code__ is not code:
            raise CandidateError("tamper", f"the harness function {name} was replaced by the candidate")
    for (cls, attr), fn in _HARNESS_METHODS.items():
        if cls.__dict__.get(attr) is not fn or (isinstance(fn, types.FunctionType) and fn.__code__ is not _METHOD_CODE[(cls, attr)]):
            raise CandidateError("tamper", f"the harness method {cls.__name__}.{attr} was replaced by the candidate")


class Problem:
    """Reference and candidate models built from the same init inputs, plus input generation.

    Built as KernelBench builds them: the secret `init_seed`, the init inputs (tensors moved to the
    device), then `Model(*init)` on the default device and moved to the job's device; `ModelNew`
    the same way after the same seed. So the legacy `torch.Tensor(...)` constructor, extra random
    buffers and constants folded into weights in `__init__` behave as under KernelBench.

    ModelNew's parameters are its own same-seed build (`job.params == "seed"`), never overwritten:
    where its state_dict has the reference's keys with other values (folded constants, another
    order of random draws) and that build is wrong, the evaluator tries once more with the
    reference's state_dict loaded (`job.params == "state_dict"`). Either way the candidate must be
    correct on fresh secret inputs with the parameters it runs with, so the second try gains it
    nothing it could not have by building those parameters itself. `params` says which path ran;
    `params_retry` whether a second try could differ.
    """

    def __init__(self, job: Job, with_candidate: bool):
        self.job = job
        self.device = torch.device("cuda:0" if job.device == "cuda" else "cpu")
        if self.device.type == "cuda":
            torch.backends.cuda.matmul.allow_tf32 = False
            torch.backends.cudnn.allow_tf32 = False
        self.ref_mod = load_reference(job)
        self._ref_api = {k: getattr(self.ref_mod, k) for k in ("Model", "get_inputs", "get_init_inputs")}
        self.init_seed = job.init_seed or secrets.randbits(62)
        torch.manual_seed(self.init_seed)
        self._init = [x.to(self.device) if isinstance(x, torch.Tensor) else x for x in self.ref_mod.get_init_inputs()]
        torch.manual_seed(self.init_seed)
        self.ref = self.ref_mod.Model(*self._init).to(self.device)
        self.cand = None
        self.params = ""
        self.params_retry = False
        if with_candidate:
            self.load_candidate()

    def load_candidate(self) -> None:
        """Import model_new.py and build ModelNew (see the class's text)."""
        job = self.job
        cand_mod = load_candidate(job)
        cls = cand_mod.ModelNew
        if issubclass(cls, self.ref_mod.Model) or any(
            c.__name__ == "Model" and c.__module__ in ("model", "cudagym_reference") for c in cls.__mro__
        ):
            raise CandidateError("audit", "ModelNew must not be (a subclass of) the reference Model")
        torch.manual_seed(self.init_seed)
        try:
            self.cand = cls(*self._init)
        except Exception as e:  # noqa: BLE001
            raise CandidateError(_failure_kind(e), "ModelNew(*get_init_inputs()) failed:\n"
                                 + candidate_traceback(e, [job.workspace])) from None
        if not isinstance(self.cand, torch.nn.Module):
            raise CandidateError("exception", f"ModelNew(...) built a {type(self.cand).__name__}, not an nn.Module")
        try:
            self.cand.to(self.device)
        except Exception as e:  # noqa: BLE001
            raise CandidateError(_failure_kind(e), "ModelNew.to(device) failed:\n"
                                 + candidate_traceback(e, [job.workspace])) from None
        self.params = self._settle_parameters()
        check_tamper()

    def _settle_parameters(self) -> str:
        """Compare ModelNew's state_dict with Model's; load Model's on a second try. The description."""
        ref_state = self.ref.state_dict()
        try:
            cand_state = self.cand.state_dict()
            missing, unexpected = sorted(set(ref_state) - set(cand_state)), sorted(set(cand_state) - set(ref_state))
            if missing or unexpected:
                why = "; ".join(part for part in (
                    f"ModelNew lacks {', '.join(missing[:8])}" if missing else "",
                    f"has {', '.join(unexpected[:8])} instead" if unexpected else "") if part)
                return f"ModelNew's own parameters, built after the same seed ({why})"
            differ = [k for k, v in ref_state.items()
                      if not (isinstance(v, torch.Tensor) and isinstance(cand_state[k], torch.Tensor)
                              and v.shape == cand_state[k].shape and torch.equal(v, cand_state[k].to(v.device)))]
            if not differ:
                return "ModelNew's own parameters, built after the same seed: equal to Model's"
            self.params_retry = True
            if self.job.params != "state_dict":
                return ("ModelNew's own parameters, built after the same seed (they differ from Model's in "
                        f"{', '.join(differ[:4])}{' ...' if len(differ) > 4 else ''})")
            self.cand.load_state_dict(ref_state)
        except Exception as e:  # noqa: BLE001 - shapes differ, or ModelNew's state_dict hooks fail
            if self.job.params == "state_dict":
                raise CandidateError(_failure_kind(e), "loading Model's state_dict into ModelNew failed: "
                                     + " ".join(str(e).split())[-300:]) from None
            return f"ModelNew's own parameters, built after the same seed ({' '.join(str(e).split())[-200:]})"
        return ("Model's state_dict loaded into ModelNew (second try: with its own same-seed parameters, which "
                "differ from Model's, it was wrong)")

    def intact(self) -> None:
        """Raise if the candidate rebound the reference's functions or this object's methods."""
        if type(self) is not Problem or any(k in vars(self) for k in ("inputs", "sync", "sync_caller_stream", "intact")):
            raise CandidateError("tamper", "the harness's problem object was modified by the candidate")
        if any(getattr(self.ref_mod, k, None) is not v for k, v in self._ref_api.items()):
            raise CandidateError("tamper", "the reference module's functions were replaced by the candidate")

    def inputs(self, seed: int, scale: float = 1.0) -> list[Any]:
        torch.manual_seed(seed)
        with torch.device(self.device):
            args = list(self.ref_mod.get_inputs())
        out = []
        for a in args:
            if isinstance(a, torch.Tensor):
                a = a.to(self.device)
                if scale != 1.0 and a.is_floating_point():
                    a = a * scale
            out.append(a)
        return out

    def sync(self) -> None:
        if self.device.type == "cuda":
            _ORIGINALS["torch.cuda.synchronize"]()

    def sync_caller_stream(self) -> None:
        """Wait for the caller's stream only: PyTorch semantics for a returned output. Work left
        on a side stream that was not joined is still running, and shows up as wrong or late."""
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise equality (NaNs included) of two tensors of the same dtype."""
    a, b = a.detach().contiguous().reshape(-1), b.detach().contiguous().reshape(-1)
    if a.dtype != b.dtype or a.numel() != b.numel():
        return False
    return bool(torch.equal(a.view(torch.uint8), b.view(torch.uint8)))


def clone_args(args: list[Any]) -> list[Any]:
    return [a.clone() if isinstance(a, torch.Tensor) else a for a in args]


def as_outputs(out: Any, who: str, device: torch.device | None = None) -> list[torch.Tensor]:
    """The output as a list of plain, dense tensors of a dtype the result channel carries (on
    `device`, if given); anything else is an output-format error of `who`, named."""
    items = list(out) if isinstance(out, (tuple, list)) else [out]
    for t in items:
        if type(t) is not torch.Tensor:
            raise CandidateError("output_format", f"{who} returned {type(t).__module__}.{type(t).__qualname__}, "
                                 "not a plain torch.Tensor")
        if t.is_nested or t.is_quantized or t.layout != torch.strided:
            kind = "nested" if t.is_nested else "quantized" if t.is_quantized else str(t.layout)
            raise CandidateError("output_format", f"{who} returned a {kind} tensor; outputs must be dense (strided)")
        if str(t.dtype).removeprefix("torch.") not in WIRE_DTYPES:
            raise CandidateError("output_format", f"{who} returned a tensor of dtype {t.dtype}, which cannot be "
                                 "compared; return the reference's dtype")
        if device is not None and t.device != device:
            raise CandidateError("output_format", f"{who} returned a tensor on {t.device}, expected {device}")
        if t.numel() and t.untyped_storage().data_ptr() == 0:
            raise CandidateError("output_format", f"{who} returned a tensor without real storage")
    return items


def _live_helpers() -> tuple[int, int]:
    import psutil

    return threading.active_count(), len(psutil.Process().children(recursive=True))


def poison_allocator(device: torch.device, nbytes: int) -> None:
    """Fill soon-to-be-reused allocator memory with NaN so unwritten outputs cannot pass."""
    n = max(nbytes // 4, 1 << 16)
    buf = torch.empty(n, dtype=torch.float32, device=device)
    buf.fill_(float("nan"))
    del buf


def _map_shared(fd: int, size: int, offset: int = 0) -> mmap.mmap:
    """A writable, populated (no page faults later) shared mapping of part of the result memory."""
    return mmap.mmap(fd, size, flags=mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0),
                     prot=mmap.PROT_READ | mmap.PROT_WRITE, offset=offset)


_PREMAPPED: list[mmap.mmap] = []  # the start of the result memory, mapped by `premap_results`


def premap_results(shm_fd: int, mb: int) -> None:
    """Map, populate and (on a GPU) page-lock the first `mb` MB of the result memory while idle:
    outputs then go from the device into it at full copy speed, with no page faults."""
    size = min(mb << 20, os.fstat(shm_fd).st_size)
    if size <= 0:
        return
    mm = _map_shared(shm_fd, size)
    if torch.cuda.is_initialized():
        import ctypes

        addr = ctypes.addressof(ctypes.c_char.from_buffer(mm))
        torch.cuda.cudart().cudaHostRegister(addr, size, 0)  # best effort: pageable copies otherwise
    _PREMAPPED.append(mm)


_AUDITING: list[bool] = []  # `_refuse_hooks` installed (once per process)
_OPWATCH_CALLBACKS: list[Any] = []  # RecordFunction callbacks registered so far (opwatch.cpp), bound at prewarm
_CALLBACKS_BEFORE: list[int] = []  # their number before the candidate's code loaded (`job_timer`)
_OPWATCH: list[Any] = []  # the op counter, loaded by `prewarm_host` (built by the parent beforehand)
_OPWATCH_CHANGES: list[Any] = []  # its C library's count of arms, disarms and resets


def profiler_available() -> bool:
    """Whether this process may use the CUDA profiler (not under Nsight Compute, which owns it)."""
    return not os.environ.get("CUDAGYM_UNDER_NCU")


def prewarm_host() -> None:
    """The part of the prewarm that touches no GPU driver, so a fork server can run it once
    for all its workers: psutil, dynamo (via the dispatch mode), the op counter, and the identity
    snapshot of the watched functions.

    Not the profiler (`prewarm_device`): its first session, even a CPU-only one, initializes the
    CUDA driver, and the driver cannot be used in a process forked after that. Not inductor:
    importing it fixes its cache paths (under /tmp) before a baseline job points them into its
    scratch directory, the only place the job may write, and every torch.compile then failed
    with a PermissionError (`tests/test_compile_baseline.py`); it would also add about 1.5 s to
    every worker's start for the baseline jobs' sake, which are cached."""
    import psutil  # noqa: F401
    from torch.profiler import ProfilerActivity, profile  # noqa: F401
    from torch.utils.flop_counter import FlopCounterMode  # noqa: F401

    with OpRecorder():
        torch.ones(2) + 1
    _live_helpers()
    _OPWATCH.append(OpWatch.load(Path(os.environ.get("CUDAGYM_OPWATCH_DIR") or Path.home())))
    _OPWATCH_CHANGES.append(_OPWATCH[0]._lib.opwatch_state_changes)  # bound before any candidate code
    _OPWATCH_CALLBACKS.append(_OPWATCH[0]._lib.opwatch_callbacks_registered)
    use_native_close(_OPWATCH[0].cpu_close)  # the CPU timers' close: native code of the harness's own
    try:  # filelock (inductor's and Triton's caches) adds an audit hook of its own when first imported
        import filelock  # noqa: F401  (on Python >= 3.12): before the refusal, not at a candidate's compile
    except ImportError:
        pass
    if not _AUDITING:
        sys.addaudithook(_refuse_hooks)
        _AUDITING.append(True)
    _snapshot_originals()


def prewarm_device() -> None:
    """The rest of the prewarm, in the worker itself: the profiler's first session (over a
    second on its own; on a GPU, CUPTI's too), the timer's gate kernels (NVRTC) and NVML."""
    from torch.profiler import ProfilerActivity, profile

    if profiler_available() and os.environ.get("CUDAGYM_DEVICE") == "cuda":
        _load_kernel_watch()  # before the profiler's first session, which would take CUPTI
    if profiler_available():  # not under Nsight Compute, which owns CUPTI in this process
        cuda = os.environ.get("CUDAGYM_DEVICE") == "cuda"
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
        with OpRecorder(), profile(activities=activities) as prof:
            torch.ones(2, device="cuda" if cuda else "cpu") + 1
        prof.events()
        if cuda:  # the timer's gate kernels; its overhead is measured by each timing job
            gate_kernels(torch.cuda.current_device())
    if os.environ.get("CUDAGYM_DEVICE") == "cuda":
        _nvml_handle()
    _snapshot_originals()


def _snapshot_originals() -> None:
    """Torch rebinds some functions as it loads parts of itself (dynamo rebinds
    torch.manual_seed, for one): the identity snapshot is retaken after each prewarm step, still
    before any candidate code runs; the dispatcher's table with it."""
    _ORIGINALS.update({name: getattr(obj, attr) for name, (obj, attr) in _WATCHED.items()})
    _DISPATCH.clear()
    _DISPATCH.update(dispatch_table())


def dispatch_table() -> dict[str, tuple[str, ...]]:
    """For every op the dispatcher knows, where its kernels at the compute keys were registered
    (~70 ms for ~3600 ops). A candidate that registers its own kernel for one of torch's ops
    (`TORCH_LIBRARY_IMPL(aten, CPU, m)`, `torch.library.Library("aten", "IMPL")`) would run inside
    the harness's own work between calls (input generation, refills), where it sees the next
    call's inputs before the timer starts; `check_tamper` compares this table with the one taken
    before candidate code ran (new ops of the candidate's own namespaces are its business)."""
    dump, names = _ORIGINALS["torch._C._dispatch_dump"], _ORIGINALS["torch._C._dispatch_get_all_op_names"]
    return {n: tuple(line.split(" :: ")[0] for line in dump(n).splitlines() if line.startswith(_COMPUTE_KEYS))
            for n in names()}


class Phases:
    """Seconds per phase of a job, sent with the result (diagnostics: where a check's time goes)."""

    def __init__(self) -> None:
        self._clock = _ORIGINALS["time.perf_counter"]
        self._t = self._clock()
        self.times: dict[str, float] = {}
        self.extra: dict[str, Any] = {}  # other diagnostics (not used for any verdict)

    def mark(self, name: str) -> None:
        now = self._clock()
        self.times[name] = self.times.get(name, 0.0) + now - self._t
        self._t = now


# -- jobs -------------------------------------------------------------------------------------
def _aten_ops_seen_by_profiler(prof: Any) -> Counter[str]:
    return Counter(e.name for e in prof.events() if e.name.startswith("aten::"))


def run_verify(job: Job, ch: Channel) -> None:
    """Correctness trials of the candidate, audited at the dispatcher and by the profiler.

    The reference also runs here (before or after the candidate, by the plan) so that freed
    reference outputs are poisoned where the candidate could pick them up; the outputs that
    are compared come from a separate reference-only worker with the same plan.
    """
    from torch.profiler import ProfilerActivity, profile

    check = check_tamper  # bound before any candidate code runs
    clock = _ORIGINALS["time.perf_counter"]
    ph = Phases()
    p = Problem(job, with_candidate=True)
    ph.mark("load")
    trials = job.trials
    ops: Counter[str] = Counter()
    out_bytes = 1 << 20
    profiler_enabled = torch.autograd._profiler_enabled
    watch = op_watch()
    changes = _OPWATCH_CHANGES[0]()
    kwatch = kernel_watch(p)
    if kwatch:
        kwatch.reset()  # every kernel of every trial, by origin: the parent applies the rules
    for t in range(trials):
        plan = ch.request("trial", index=t)  # this trial's secret, only now
        order = plan.get("order")
        base = p.inputs(int(plan["seed"]), float(plan.get("scale", 1.0)))

        def run_reference() -> None:
            args = clone_args(base)
            out = as_outputs(p.ref(*args), "the reference")
            p.sync()
            params = {q.data_ptr() for q in list(p.ref.parameters()) + list(p.ref.buffers())}
            for o in out:  # poison freed output memory before the candidate runs
                if o.is_floating_point() and o.data_ptr() not in params and o._base is None:
                    o.fill_(float("nan"))
            del out, args

        if order == "reference_first":
            run_reference()
        args = clone_args(base)
        poison_allocator(p.device, out_bytes)
        before = _live_helpers()
        ph.mark("reference")
        rec = OpRecorder()
        still_profiling = True
        before_watch = watch.counts()
        try:
            with torch.no_grad(), profile(activities=[ProfilerActivity.CPU]) as prof, rec:
                watch.arm()
                if kwatch:
                    kwatch.arm()
                try:
                    out = p.cand(*args)
                finally:
                    if kwatch:
                        kwatch.disarm()
                    watch.disarm()
                p.sync_caller_stream()
                still_profiling = profiler_enabled()
        except CandidateError:
            raise
        except Exception as e:  # noqa: BLE001
            raise CandidateError(_failure_kind(e), "ModelNew.forward raised:\n" + candidate_traceback(e, [job.workspace])) from None
        returned = clock()
        check()
        p.intact()
        check_torch_lookups()
        if not still_profiling:
            raise CandidateError("tamper", "ModelNew.forward switched off the harness's profiler")
        _watch_alive(watch, changes + 2 * (t + 1))
        _kernels_alive(kwatch, p)
        seen = rec.ops | (_aten_ops_seen_by_profiler(prof) - rec.ops)  # ops hidden from the dispatch mode
        ops.update(seen | (watch.counts() - before_watch - seen))  # and from both
        outs = as_outputs(out, "ModelNew.forward", p.device)
        after = _live_helpers()
        if after[1] > before[1]:
            raise CandidateError("audit", "ModelNew.forward left child processes running after it returned")
        if after[0] > before[0]:
            raise CandidateError("audit", "ModelNew.forward left threads running after it returned")
        ph.mark("candidate")
        snap = [o.detach().clone() for o in outs]  # on the device: the values at return time
        out_bytes = sum(o.numel() * o.element_size() for o in outs)
        for i, o in enumerate(snap):
            ch.send_tensor("candidate", t, i, o)
        ph.mark("send")
        if order == "candidate_first":
            run_reference()
        ph.mark("reference")
        # Outputs must not change once forward has returned: re-read them later (after this
        # trial's other work; in the last trial, after a pause: background work recurs each trial).
        wait = job.verify.settle_ms / 1e3 - (clock() - returned)
        if wait > 0 and t == trials - 1:
            time.sleep(wait)
        p.sync()
        if not all(_same_bits(o, s) for o, s in zip(outs, snap)):
            raise CandidateError("audit", "an output of ModelNew.forward changed after forward returned "
                                 "(work finishing in the background)")
        del outs, out, snap, args
        ph.mark("settle")
    kernels = records_as_counts(kwatch.records()) if kwatch else None
    own_share, share_kernels = None, None
    if job.mode == "permissive":
        own_share, share_kernels = own_kernel_share(p, job)
        ph.mark("own_share")
    check()
    if problems := inline_problems():  # an extension verify had to do without, named
        raise CandidateError("compile_error", "\n".join(problems))
    ch.final({"ok": True, "trials": trials, "ops": dict(ops), "forbidden": forbidden_ops(ops),
              "own_kernel_share": own_share, "params": p.params, "params_retry": p.params_retry, "phases": ph.times, "kernels": kernels,
              "share_kernels": share_kernels, "kernel_watch_error": _KWATCH_ERROR[0] if _KWATCH_ERROR else None,
              "own_objects": _own_objects(job)})


def run_reference_outputs(job: Job, ch: Channel) -> None:
    """The reference's outputs for the verify plan, in a worker that runs no candidate code."""
    ph = Phases()
    p = Problem(job, with_candidate=False)
    ph.mark("load")
    with torch.no_grad():
        for t, (seed, scale) in enumerate(zip(job.trial_seeds, job.trial_scales)):
            out = as_outputs(p.ref(*p.inputs(seed, scale)), "the reference")
            p.sync()
            ph.mark("reference")
            for i, o in enumerate(out):
                ch.send_tensor("reference", t, i, o)
                if t < len(job.projection_seeds):  # the re-check of a timed call: its projections, same weights
                    ch.send_tensor("projection", t, i, projection(o, job.projection_seeds[t], i))
            ph.mark("send")
    ch.final({"ok": True, "trials": len(job.trial_seeds), "phases": ph.times})


def _own_objects(job: Job) -> list[str]:
    """The shared objects of the candidate's build (its artifact directory, its cached
    extensions) this process has mapped: the parent audits their imports itself."""
    roots = [r for r in (job.artifact_dir, str(Path(job.cache_dir) / "inline")) if r]
    libs: list[str] = []
    with open("/proc/self/maps") as f:
        for line in f:
            path = line.split()[-1] if line.strip() else ""
            if ".so" in path and any(path.startswith(r) for r in roots) and path not in libs:
                libs.append(path)
    return libs[:64]


def own_kernel_share(p: Problem, job: Job) -> tuple[float | None, dict[str, int] | None]:
    """Permissive mode: on a GPU, the kernel records of one measured call with each launch's GPU
    time (`KernelWatch.timed`; the parent computes the share by origin); on the CPU, the share
    of the forward's compute done outside torch (computed here: no kernel records there)."""
    from torch.profiler import ProfilerActivity, profile

    args = p.inputs(secrets.randbits(62))
    if p.device.type == "cuda":
        kwatch = kernel_watch(p)
        if kwatch is None:
            return None, None
        with torch.no_grad():
            p.cand(*clone_args(args))  # warm: lazy loads and first-call work are not measured
            p.sync()
            call_args = clone_args(args)

            def measured() -> None:
                p.cand(*call_args)
                p.sync()

            records = kwatch.timed(measured)
        return None, records_as_counts(records)
    acts = [ProfilerActivity.CPU]

    # CPU: the candidate's own (ctypes/binding) calls are invisible to the profiler, so compare
    # the torch compute inside its forward with the reference's torch compute on the same
    # inputs, in elements processed (deterministic, unlike times on a shared host).
    def torch_work(fn: Any) -> float:
        with profile(activities=acts, record_shapes=True) as prof_w:
            fn(*clone_args(args))
        work = 0.0
        for e in prof_w.events():
            if e.name.startswith("aten::") and e.name.split("::")[1] not in STRICT_ALLOWED:
                sizes = [math.prod(s) for s in (e.input_shapes or []) if isinstance(s, (list, tuple))]
                work += max(sizes, default=1)
        return work

    with torch.no_grad():
        ref_work = torch_work(p.ref)
        cand_work = torch_work(p.cand)
    if ref_work <= 0:
        return (1.0 if cand_work == 0 else 0.0), None
    return max(0.0, 1.0 - cand_work / ref_work), None


_NVML: list[Any] = []  # [pynvml, handle] once initialized (in the spare, before any job)


def _nvml_handle() -> Any | None:
    if not _NVML:
        try:
            import pynvml

            pynvml.nvmlInit()
            idx = int(os.environ.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0] or 0)
            _NVML.extend([pynvml, pynvml.nvmlDeviceGetHandleByIndex(idx)])
        except Exception:  # noqa: BLE001 - telemetry is best effort
            return None
    return _NVML[1]


def _telemetry() -> dict[str, Any]:
    h = _nvml_handle()
    if h is None:
        return {"error": "NVML is not available"}
    try:
        pynvml = _NVML[0]
        util = pynvml.nvmlDeviceGetUtilizationRates(h)
        return {
            "gpu_name": pynvml.nvmlDeviceGetName(h),
            "sm_clock_mhz": pynvml.nvmlDeviceGetClockInfo(h, pynvml.NVML_CLOCK_SM),
            "mem_clock_mhz": pynvml.nvmlDeviceGetClockInfo(h, pynvml.NVML_CLOCK_MEM),
            "temperature_c": pynvml.nvmlDeviceGetTemperature(h, pynvml.NVML_TEMPERATURE_GPU),
            "utilization_pct": util.gpu,
            "power_w": pynvml.nvmlDeviceGetPowerUsage(h) / 1000.0,
            "throttle_reasons": int(pynvml.nvmlDeviceGetCurrentClocksThrottleReasons(h)),
        }
    except Exception as e:  # noqa: BLE001 - telemetry is best effort
        return {"error": str(e)[:200]}




_KWATCH: list[KernelWatch] = []  # the kernel watcher, loaded by `prewarm_device` (GPU workers)
_KWATCH_ERROR: list[str] = []  # why it could not be loaded
_KPROBE: list[torch.Tensor] = []  # a harness tensor whose fill is the watcher's probe launch


def _load_kernel_watch() -> None:
    """Install the kernel watcher (`cudagym.sandbox.origin`, built by the parent beside the op
    counter) before the profiler's first session takes CUPTI; why not, if it cannot be."""
    try:
        _KWATCH.append(KernelWatch.load(Path(os.environ.get("CUDAGYM_OPWATCH_DIR") or Path.home())))
        _KPROBE.append(torch.zeros(1, device="cuda"))
    except Exception as e:  # noqa: BLE001 - reported with every verify: the GPU audit cannot pass without it
        _KWATCH_ERROR.append(f"{type(e).__name__}: {e}"[:500])


def kernel_watch(p: Problem) -> KernelWatch | None:
    """The process's kernel watcher on a GPU job; None on the CPU or where it is missing (the
    verify result says why, and the parent fails the audit on it)."""
    return _KWATCH[0] if p.device.type == "cuda" and _KWATCH else None


def _kernels_alive(kwatch: KernelWatch | None, p: Problem) -> None:
    """Raise unless the kernel watcher still sees the harness's probe launch on this thread."""
    if kwatch is None:
        return
    why = kwatch.check_alive(lambda: _KPROBE[0].fill_(1.0))
    if why:
        raise CandidateError("tamper", f"the harness's kernel watcher was disabled: {why}")


def op_watch() -> Any:
    """The process's op counter (`cudagym.sandbox.opwatch`), loaded by `prewarm_host`."""
    if not _OPWATCH:
        raise RuntimeError("the op counter was not loaded (prewarm_host)")
    return _OPWATCH[0]


def _watch_alive(watch: Any, expected_changes: int) -> None:
    """Raise unless the op counter still counts and its state changed only as the harness changed
    it (`expected_changes`: arms, disarms and resets so far, by the C library's own count)."""
    why = watch.check_alive()
    if not why and _OPWATCH_CHANGES[0]() != expected_changes:
        why = "it was armed, disarmed or reset by the candidate"
    if why:
        raise CandidateError("tamper", f"the harness's op counter was disabled: {why}")


def _probe_fn(p: Problem) -> Any:
    """A call of one tiny kernel: the probes among a loop's calls that measure the loop's own
    overhead on the parent's clock (`cudagym.sandbox.feed`)."""
    probe = torch.zeros(1, dtype=torch.int32, device=p.device)

    def fill(*args: Any) -> torch.Tensor:
        probe.zero_()
        return probe

    return fill


def job_timer(p: Problem, job: Job) -> DeviceTimer:
    """The job's timer, its overhead measured for this job (GPU; before any candidate code loads,
    with the spares that are still starting paused) on a separate timer without the flush
    (`harness_calibration`). Measured once per process while a spare waits, it read up to the
    cap in some processes on an H100 (other spares creating their CUDA contexts), and calls
    shorter than it then read 0. Without the flush the output the close reads is hot, as a
    call's is."""
    calibration = harness_calibration.__wrapped__() if p.device.type == "cuda" else None
    native = op_watch().cpu_close if p.device.type == "cpu" else None
    timer = DeviceTimer(p.device, job.timing.flush_l2, launch_window_us=job.timing.launch_window_us,
                        calibration=calibration, native_close=native)
    if _OPWATCH_CALLBACKS:  # before any candidate code loads (`_timing_run` compares after each call)
        _CALLBACKS_BEFORE[:] = [_OPWATCH_CALLBACKS[0]()]
    return timer


def _timing_run(p: Problem, fn: Any, job: Job, ch: Channel, role: str, ph: Phases, timer: DeviceTimer) -> int:
    """Make the calls of `role` that the parent asks for, under the timing protocol
    (`cudagym.sandbox.timing`); returns how many were made.

    The same steps for every role and every call: the op counter armed around the call (the
    candidate's cumulative counts go with each request), a sample of every output read at
    the call's end (`DeviceTimer.read_at_end`: `SAMPLE_SIZE` secret random positions, drawn
    after the call returned; on a GPU, with projections of the whole output, by the close kernel
    while it holds every SM) and sent on the pipe, out of the worker's reach, before the next
    call is asked for. The calls the parent marks as probes call a tiny kernel of the harness
    instead, through the same steps.
    """
    rng = secrets.SystemRandom()
    timer_parts = {k: v for k, v in vars(timer).items() if callable(v)}
    timeouts = timer.close_timeouts()  # a baseline job's roles share one timer
    calibration = timer.calibration
    sets = [p.inputs(rng.getrandbits(62))]
    n_sets = job.timing.input_sets_for(sum(a.nbytes for a in sets[0] if isinstance(a, torch.Tensor)))
    sets += [p.inputs(rng.getrandbits(62)) for _ in range(n_sets - 1)]
    watch = op_watch()
    watch.reset()  # the role's counts start here; the parent sees them only grow
    kwatch = kernel_watch(p) if role == "candidate" else None
    if kwatch:
        kwatch.reset()  # the role's kernel records, sent with the op counts: they only grow
    model_calls = [0]
    changes = _OPWATCH_CHANGES[0]()  # then one arm and one disarm per call
    threads = threading.active_count()
    pending: list[tuple[torch.Size, Evidence]] = []
    made = [0]
    who = "ModelNew.forward" if role == "candidate" else f"the {role} model"
    ph.mark(f"{role}_setup")

    probe = _probe_fn(p)

    def call(*args: Any) -> Any:
        model_calls[0] += 1
        watch.arm()
        if kwatch:
            kwatch.arm()
        try:
            return fn(*args)
        except CandidateError:
            raise
        except Exception as e:  # noqa: BLE001
            raise CandidateError(_failure_kind(e), f"{who} raised in a timed-loop call:\n"
                                 + candidate_traceback(e, [job.workspace] if job.workspace else [])) from None
        finally:
            if kwatch:
                kwatch.disarm()
            watch.disarm()

    def after(i: int, out: Any) -> dict[str, Any]:
        pending.extend((o.shape, timer.read_at_end(o, SAMPLE_SIZE)) for o in as_outputs(out, who, p.device))
        return {}

    def next_call(report: dict[str, Any]) -> tuple[int, bool] | None:
        # the evidence of the call goes on the pipe before the candidate's code runs again; the
        # CPU close's as raw bytes (`Evidence.raw`): no ATen op, so no RecordFunction callback or
        # kernel of anyone's, runs between the close and the pipe
        for j, (shape, ev) in enumerate(pending):
            if ev.raw is not None:
                for what, t, raw, extra in (("sample", ev.values, ev.raw[0], {"full_shape": list(shape)}),
                                            ("positions", ev.positions, ev.raw[1], {})):
                    if t is not None:
                        ch.send({"type": "tensor", "role": what, "trial": made[0] - 1, "index": j,
                                 "dtype": str(t.dtype).removeprefix("torch."), "shape": list(t.shape), **extra}, raw)
                continue
            ch.send_tensor("sample", made[0] - 1, j, ev.values, pipe=True, full_shape=list(shape))
            if ev.positions is not None:
                ch.send_tensor("positions", made[0] - 1, j, ev.positions, pipe=True)
            if ev.projections is not None:
                ch.send_tensor("projection", made[0] - 1, j, ev.projections[:PROJECTIONS], pipe=True, seed=ev.seed)
        pending.clear()
        # a mode left on torch's stacks sees every op the harness runs: the next call's inputs as
        # they are generated (before its clock starts), the evidence's reads
        if torch._C._len_torch_dispatch_stack() or torch._C._len_torch_function_stack():
            raise CandidateError("tamper", "a torch dispatch or function mode was left active by the candidate")
        if made[0]:
            if _HOOK_ATTEMPTS or (hooks := foreign_hooks()):
                raise CandidateError("tamper", "a Python hook the harness did not set was tried or is active: "
                                     + (_HOOK_ATTEMPTS[0] if _HOOK_ATTEMPTS else hooks))
            if role == "candidate" and _CALLBACKS_BEFORE and _OPWATCH_CALLBACKS[0]() != _CALLBACKS_BEFORE[0]:
                raise CandidateError("tamper", "the candidate registered a RecordFunction callback (an observer of the "
                                     "harness's own ops; `at::addGlobalCallback` or `addThreadLocalCallback`)")
            _watch_alive(watch, changes + 2 * made[0])
            _kernels_alive(kwatch, p)
            if threading.active_count() > threads:
                raise CandidateError("audit", f"{who} left threads running after it returned")
        ops = dict(watch.counts())
        ops[MODEL_CALLS_KEY] = model_calls[0]  # the parent's per-call rules divide by it
        if kwatch:
            ops.update(records_as_counts(kwatch.records()))
        answer = ch.request("call", role=role, index=made[0], ops=ops, **report)
        if answer.get("stop"):
            return None
        made[0] += 1
        idle_ms = answer.get("idle_ms", 0.0)
        idle_s = min(max(float(idle_ms), 0.0), MAX_IDLE_MS) / 1e3 if isinstance(idle_ms, (int, float)) else 0.0
        return int(answer["seed"]), bool(answer.get("probe")), idle_s

    def probed(*args: Any) -> Any:  # the op counter goes through the same arm/disarm
        watch.arm()
        if kwatch:
            kwatch.arm()
        try:
            return probe(*args)
        finally:
            if kwatch:
                kwatch.disarm()
            watch.disarm()

    with torch.no_grad():
        try:
            n = drive_calls(call, sets, p.inputs, next_call, timer, after, probed)
        except TimerTampered as e:
            raise CandidateError("tamper", str(e)) from None
    ph.mark(f"{role}_timed_loop")
    if timer.cuda:
        ph.extra["harness_overhead_ns"] = calibration.overhead_ns
        ph.extra["read_cap_ns"] = calibration.read_cap_ns
        ph.extra[f"{role}_close_timeouts"] = timer.close_timeouts() - timeouts
        ph.extra["gate_holds_every_sm"] = timer.holds_every_sm
    check_tamper()
    p.intact()
    if any(getattr(timer, k, None) is not v for k, v in timer_parts.items()) or timer.calibration is not calibration:
        raise CandidateError("tamper", "the harness's timer was modified by the candidate")
    return n


def roofline_inputs(p: Problem) -> dict[str, float]:
    """Bytes moved (inputs + outputs) and FLOPs of one reference call."""
    from torch.utils.flop_counter import FlopCounterMode

    args = p.inputs(secrets.randbits(62))
    counter = FlopCounterMode(display=False)
    with torch.no_grad(), counter:
        out = as_outputs(p.ref(*args), "the reference")
    nbytes = sum(a.numel() * a.element_size() for a in args if isinstance(a, torch.Tensor))
    nbytes += sum(o.numel() * o.element_size() for o in out)
    return {"bytes": float(nbytes), "flops": float(counter.get_total_flops())}


def run_profile(job: Job, ch: Channel) -> None:
    """The timer's overhead (before any candidate code loads), then the candidate's timed loop;
    the times and samples go to the parent call by call (see `_timing_run`)."""
    check = check_tamper  # bound before any candidate code runs
    ph = Phases()
    p = Problem(job, with_candidate=False)
    timer = job_timer(p, job)
    p.load_candidate()
    ph.mark("load")
    tele0 = _telemetry() if p.device.type == "cuda" else {}
    calls = _timing_run(p, p.cand, job, ch, "candidate", ph, timer)
    check()
    tele1 = _telemetry() if p.device.type == "cuda" else {}
    ph.mark("telemetry")
    if problems := inline_problems():
        raise CandidateError("compile_error", "\n".join(problems))
    ch.final({"ok": True, "calls": calls, "params": p.params, "params_retry": p.params_retry, "telemetry": {"before": tele0, "after": tele1},
              "phases": ph.times, "diagnostics": ph.extra})


def run_baseline(job: Job, ch: Channel) -> None:
    """The reference's timed loops (eager, then torch.compile), under the candidate's protocol."""
    ph = Phases()
    p = Problem(job, with_candidate=False)
    timer = job_timer(p, job)
    _timing_run(p, p.ref, job, ch, "eager", ph, timer)
    body: dict[str, Any] = {"ok": True, **roofline_inputs(p)}
    if job.with_compile_baseline:
        try:
            compiled = torch.compile(p.ref)
            with torch.no_grad():
                compiled(*p.inputs(secrets.randbits(62)))  # the first call compiles
            ph.mark("torch_compile")
        except Exception as e:  # noqa: BLE001
            body["compile_error"] = f"{type(e).__name__}: {str(e)[:500]}"
        else:
            _timing_run(p, compiled, job, ch, "compiled", ph, timer)
    if job.library_baselines:
        body["library_errors"] = _library_runs(p, job, ch, ph, timer)
    body["device_name"] = torch.cuda.get_device_name(p.device) if p.device.type == "cuda" else "cpu"
    ch.final({**body, "phases": ph.times, "diagnostics": ph.extra})


def _library_runs(p: Problem, job: Job, ch: Channel, ph: Phases, timer: DeviceTimer) -> dict[str, str]:
    """The timed loops of the job's library baselines (`cudagym.sandbox.library`), each planned,
    then checked against the reference on one input set; why each one that was not timed was not."""
    from cudagym.sandbox.library import LibraryUnavailable, library_matmul

    errors: dict[str, str] = {}
    atol, rtol = job.library_tolerance
    for name in job.library_baselines:
        args = p.inputs(secrets.randbits(62))
        try:
            fn = library_matmul(name, args)
            with torch.no_grad():
                want, got = p.ref(*args), fn(*args)
            if not isinstance(want, torch.Tensor) or want.shape != got.shape or not torch.allclose(
                    got.float(), want.float(), atol=atol, rtol=rtol):
                worst = (got.float() - want.float()).abs().max().item() if isinstance(want, torch.Tensor) \
                    and want.shape == got.shape else float("nan")
                raise LibraryUnavailable(f"its result does not match the reference (max abs error {worst:.3g}, "
                                         f"atol {atol:g}, rtol {rtol:g})")
        except LibraryUnavailable as e:
            errors[name] = str(e)
            continue
        ph.mark(f"{name}_plan")
        _timing_run(p, fn, job, ch, name, ph, timer)
    return errors


def run_compile_inline(job: Job, ch: Channel) -> None:
    """Run the candidate as verify will (import model_new.py; ModelNew(*get_init_inputs()) after
    a fresh seed, on the job's device; one forward on get_inputs()) under a loader that builds
    nothing and writes nothing shared (`cudagym.sandbox.inline`). Reports the extensions asked
    for that are not in the cache, for the parent to build in trusted jobs, and those that
    failed to load, whatever the candidate did with the loader's exceptions; and an import
    failure. Failures in ModelNew or forward are verify's to report."""
    from cudagym.sandbox.inline import MAX_REQUESTS_PER_PASS, install_inline_loader

    loader = install_inline_loader(Path(job.cache_dir), Path(job.workspace))
    import_error = None
    try:
        mod = load_candidate(job)
    except CandidateError as e:
        import_error = str(e)
    except BaseException as e:  # noqa: BLE001 - SystemExit and the like: still report the requests
        import_error = f"importing model_new.py failed: {type(e).__name__}: {e}"
    else:
        try:
            ref = load_reference(job)
            device = torch.device("cuda:0" if job.device == "cuda" else "cpu")
            torch.manual_seed(secrets.randbits(62))
            with torch.device(device):
                model = mod.ModelNew(*ref.get_init_inputs())
                args = [a.to(device) if isinstance(a, torch.Tensor) else a for a in ref.get_inputs()]
            with torch.no_grad():
                model.to(device)(*args)
        except BaseException:  # noqa: BLE001, S110 - the candidate's own failure: verify reports it
            pass
    ch.final({"ok": True, "requests": loader.missing[:MAX_REQUESTS_PER_PASS], "load_failures": loader.failures,
              "loaded": loader.loaded, "import_error": import_error})


def run_build_inline(job: Job, ch: Channel) -> None:
    """Build the one extension of `job.inline_request` (checked by the parent) with torch's own
    loader into `job.inline_build_root`; runs no candidate code and never loads what it built."""
    from cudagym.sandbox.inline import InlineCompileError, build_extension

    try:
        build_extension(job.inline_request or {}, Path(job.inline_build_root or ""))
    except InlineCompileError as e:
        raise CandidateError("compile_error", str(e)) from None
    ch.final({"ok": True})


def run_ncu(job: Job, ch: Channel) -> None:
    """The ncu job kind (`cudagym.sandbox.ncu`). In the sandboxed worker: Nsight Compute over a
    child worker on the same job, and its metrics in the final frame. In that child (under ncu):
    run the candidate's forward a few times; ncu records the kernels launched between
    cudaProfilerStart and cudaProfilerStop, which enclose only the candidate's calls (not the
    input generation and copies around them), after one warm-up call."""
    from cudagym.sandbox.ncu import CALLS, UNDER_NCU, ncu_summary

    if not os.environ.get(UNDER_NCU):
        ch.final({"ok": True, "ncu": ncu_summary(job)})
        return
    p = Problem(job, with_candidate=True)
    args = p.inputs(secrets.randbits(62))
    sets = [clone_args(args) for _ in range(CALLS + 1)]
    cudart = torch.cuda.cudart()
    with torch.no_grad():
        p.cand(*sets[0])
        p.sync()
        cudart.cudaProfilerStart()
        for a in sets[1:]:
            p.cand(*a)
            p.sync()
        cudart.cudaProfilerStop()
    ch.final({"ok": True, "calls": CALLS})


def run_probe(job: Job, ch: Channel) -> None:
    """Run `job.probe` as candidate code (used by the sandbox's own tests)."""
    ns: dict[str, Any] = {}
    try:
        exec(compile(job.probe or "", "<candidate probe>", "exec"), ns)  # noqa: S102
    except Exception as e:  # noqa: BLE001
        raise CandidateError(_failure_kind(e), candidate_traceback(e, [job.workspace])) from None
    ch.final({"ok": True, "result": repr(ns.get("RESULT"))[:2000]})


def _own_functions(mod: types.ModuleType) -> dict[tuple[types.ModuleType, str], tuple[Any, Any]]:
    """The module's functions (cached ones too) and their code."""
    return {(mod, k): (v, getattr(v, "__wrapped__", v).__code__) for k, v in list(vars(mod).items())
            if isinstance(getattr(v, "__wrapped__", v), types.FunctionType) and v.__module__ == mod.__name__}


_timing_module = sys.modules[DeviceTimer.__module__]
_HARNESS_FUNCS = {**_own_functions(sys.modules[__name__]), **_own_functions(_timing_module)}
# every callable the harness names (its own and imported ones), as bound at import
_HARNESS_NAMES = {k: v for k, v in list(globals().items()) if callable(v) and not k.startswith("__")}
_HARNESS_METHODS = {(cls, k): v for cls in (Channel, LineReader, OpRecorder, Problem, CandidateError, Phases, DeviceTimer,
                                            OpWatch, KernelWatch)
                    for k, v in vars(cls).items() if callable(v)}
_METHOD_CODE = {key: fn.__code__ for key, fn in _HARNESS_METHODS.items() if isinstance(fn, types.FunctionType)}

JOBS = {"verify": run_verify, "reference": run_reference_outputs, "profile": run_profile, "baseline": run_baseline,
        "compile_inline": run_compile_inline, "build_inline": run_build_inline, "probe": run_probe, "ncu": run_ncu}
