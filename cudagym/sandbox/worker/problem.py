"""The models a job runs and how they are loaded: the task's reference, the candidate's
`model_new.py`, both built from the same init inputs after the same secret seed (`Problem`),
the inputs they are called with, and the checks on what they return (`as_outputs`).
"""

from __future__ import annotations

import importlib.util
import os
import secrets
import sys
import types
from pathlib import Path
from collections.abc import Callable
from typing import Any

import torch

from cudagym import runtime
from cudagym.sandbox.worker.dtypes import WIRE_DTYPES
from cudagym.sandbox.worker.failures import CandidateError, candidate_traceback, failure_kind
from cudagym.sandbox.worker.integrity import InputKernels, check_reclassed, check_tamper, live_threads, rebound
from cudagym.sandbox.worker.state import WorkerState
from cudagym.sandbox.worker.wire import Job


_GENERATOR = torch.Generator  # torch's C class, bound before any candidate code


def input_generators(device: torch.device) -> tuple[torch.Generator, ...]:
    """The generators a job's inputs draw from: the CPU's; on a GPU, every device's too. Seeded
    through their own C method (`Problem.inputs`), not `torch.manual_seed`, whose Python reads
    names of torch's modules at each call (`torch.cuda.manual_seed_all`, the private-use
    backend's): rebound by the candidate, they ran its code as the harness seeded the next
    call's inputs, before the interval (red team 18's g and h computed the output there)."""
    generators = [torch.default_generator]
    if device.type == "cuda":
        generators += list(torch.cuda.default_generators)
    return tuple(generators)


def load_reference(job: Job) -> types.ModuleType:
    """The task's code, run as the module `cudagym_reference`."""
    mod = types.ModuleType("cudagym_reference")
    mod.__file__ = f"<reference {job.task_id}>"
    exec(compile(job.task_code, mod.__file__, "exec"), mod.__dict__)  # noqa: S102 - the task is trusted
    return mod


def load_candidate(job: Job, state: WorkerState, before: Callable[[], None] | None = None) -> types.ModuleType:
    """Import the workspace's model_new.py (its build's artifact directory on the path) as
    `model_new`; `before` runs just before the first of its code does."""
    ws = job.workspace
    if job.artifact_dir:
        os.environ[runtime.ENV_VAR] = job.artifact_dir
        sys.path.insert(0, job.artifact_dir)
    sys.path.insert(0, ws)
    path = Path(ws) / "model_new.py"
    if not path.is_file():
        raise CandidateError("exception", "model_new.py does not exist: write it first")
    spec = importlib.util.spec_from_file_location("model_new", path)
    if spec is None or spec.loader is None:
        raise CandidateError("exception", "model_new.py cannot be loaded as a Python module")
    if before is not None:
        before()
    state.threads_before = live_threads()
    state.candidate_ran = True
    mod = importlib.util.module_from_spec(spec)
    sys.modules["model_new"] = mod
    try:
        spec.loader.exec_module(mod)
    except Exception as e:  # noqa: BLE001
        raise CandidateError(failure_kind(e, state.hook_attempts),
                             "importing model_new.py failed:\n" + candidate_traceback(e, [ws])) from None
    if not isinstance(getattr(mod, "ModelNew", None), type):
        raise CandidateError("exception", "model_new.py must define a class ModelNew(nn.Module)")
    return mod



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

    def __init__(self, job: Job, state: WorkerState, with_candidate: bool) -> None:
        self.job = job
        self.state = state
        self.device = torch.device("cuda:0" if job.device == "cuda" else "cpu")
        if self.device.type == "cuda":
            torch.backends.cuda.matmul.allow_tf32 = False
            torch.backends.cudnn.allow_tf32 = False
        elif job.kind in ("verify", "profile"):
            # oneDNN's JIT writes torch's own code into anonymous executable memory (the reference
            # runs in this worker too); off, any that appears is the candidate's: generated code
            # copied out of its file (`cudagym.sandbox.maps`), refused in strict mode, credited no
            # own share in permissive mode
            torch.backends.mkldnn.enabled = False  # type: ignore[assignment]  # a ContextProp, set as documented
        self._generators = input_generators(self.device)  # before any candidate code
        self.ref_mod = load_reference(job)
        self._ref_api = {k: getattr(self.ref_mod, k) for k in ("Model", "get_inputs", "get_init_inputs")}
        self.init_seed = job.init_seed or secrets.randbits(62)
        torch.manual_seed(self.init_seed)
        self._init = [x.to(self.device) if isinstance(x, torch.Tensor) else x for x in self.ref_mod.get_init_inputs()]
        torch.manual_seed(self.init_seed)
        self.ref = self.ref_mod.Model(*self._init).to(self.device)
        self.cand: Any = None  # ModelNew, once built (`load_candidate`)
        self.input_kernels: InputKernels | None = None  # set before candidate code loads
        self._ref_names: dict[str, Any] = {}
        self.params = ""
        self.params_retry = False
        if with_candidate:
            self.load_candidate()

    def load_candidate(self, before: Callable[[], None] | None = None) -> None:
        """Import model_new.py and build ModelNew (see the class's text); `before`: as
        `load_candidate`'s."""
        job = self.job
        self.input_kernels = self._input_kernels()
        self._ref_names = dict(vars(self.ref_mod))  # what the task's get_inputs reaches (`torch`, helpers)
        cand_mod = load_candidate(job, self.state, before)
        cls = cand_mod.ModelNew
        if issubclass(cls, self.ref_mod.Model) or any(
            c.__name__ == "Model" and c.__module__ in ("model", "cudagym_reference") for c in cls.__mro__
        ):
            raise CandidateError("audit", "ModelNew must not be (a subclass of) the reference Model")
        torch.manual_seed(self.init_seed)
        try:
            self.cand = cls(*self._init)
        except Exception as e:  # noqa: BLE001
            raise CandidateError(failure_kind(e, self.state.hook_attempts), "ModelNew(*get_init_inputs()) failed:\n"
                                 + candidate_traceback(e, [job.workspace])) from None
        if not isinstance(self.cand, torch.nn.Module):
            raise CandidateError("exception", f"ModelNew(...) built a {type(self.cand).__name__}, not an nn.Module")
        try:
            self.cand.to(self.device)
        except Exception as e:  # noqa: BLE001
            raise CandidateError(failure_kind(e, self.state.hook_attempts), "ModelNew.to(device) failed:\n"
                                 + candidate_traceback(e, [job.workspace])) from None
        self.params = self._settle_parameters()
        check_tamper(self.state)

    def _input_kernels(self) -> InputKernels:
        """What the dispatcher runs to make a call's inputs, before any candidate code: the ops
        (every one, nested ones too: the op counter's RecordFunction callback) of one generation
        and of the copies the timed loop refills its buffers with."""
        watch = self.state.opwatch
        ops = {"aten::copy_", "aten::clone", "aten::_to_copy", "aten::empty_like", "aten::empty_strided",
               "aten::empty.memory_format"}
        if watch is not None:
            watch.reset()
            watch.arm()
            try:
                args = self.inputs(secrets.randbits(62))
                for a in args:
                    if isinstance(a, torch.Tensor) and a.numel():
                        a.view(-1)[:1].clone().copy_(a.view(-1)[:1])
            finally:
                watch.disarm()
            ops |= {f"{o.name}.{o.overload}" if o.overload else o.name for o in watch.ops()}
            watch.reset()
            del args
        return InputKernels(ops, self.state.originals["torch._C._dispatch_dump"])

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
                raise CandidateError(failure_kind(e, self.state.hook_attempts),
                                     "loading Model's state_dict into ModelNew failed: "
                                     + " ".join(str(e).split())[-300:]) from None
            return f"ModelNew's own parameters, built after the same seed ({' '.join(str(e).split())[-200:]})"
        return ("Model's state_dict loaded into ModelNew (second try: with its own same-seed parameters, which "
                "differ from Model's, it was wrong)")

    def intact(self) -> None:
        """Raise if the candidate rebound the reference's functions or this object's methods."""
        if type(self) is not Problem or any(k in vars(self)
                                            for k in ("inputs", "sync", "sync_caller_stream", "intact")) \
                or type(self.ref_mod) is not types.ModuleType:
            raise CandidateError("tamper", "the harness's problem object was modified by the candidate")
        if any(getattr(self.ref_mod, k, None) is not v for k, v in self._ref_api.items()):
            raise CandidateError("tamper", "the reference module's functions were replaced by the candidate")

    def inputs(self, seed: int, scale: float = 1.0) -> list[Any]:
        guard = self.input_kernels  # once candidate code may have run: torch's own kernels make them
        if guard is not None or self.cand is not None:
            self._inputs_untouched(guard)
        for g in self._generators:  # not `torch.manual_seed` (`input_generators`)
            g.manual_seed(seed)
        if self.device.type == "cpu":  # torch's default: no device mode, whose Python reads torch's
            args = list(self.ref_mod.get_inputs())  # globals at each factory call (red team 19's d)
        else:
            with torch.device(self.device):
                args = list(self.ref_mod.get_inputs())
        out = []
        for a in args:
            if isinstance(a, torch.Tensor):
                a = a.to(self.device)
                if scale != 1.0 and a.is_floating_point():
                    a = a * scale
            out.append(a)
        if guard is not None or self.cand is not None:
            self._inputs_untouched(guard)
        return out

    def _inputs_untouched(self, guard: InputKernels | None) -> None:
        """Raise if what makes a call's inputs was changed since the candidate loaded: the kernels
        of its ops (`InputKernels`), the watched functions (torch's factories, the device mode the
        generation runs under), the names of the task's module that `get_inputs` reaches."""
        if type(guard) is not InputKernels or type(self.ref_mod) is not types.ModuleType:
            raise CandidateError("tamper", "the harness's input generation was modified by the candidate")
        check_reclassed(self.state, (self, Problem))  # first: reading a swapped module runs the candidate's code
        gens = self._generators
        if type(gens) is not tuple or not all(type(g) is _GENERATOR for g in gens):
            raise CandidateError("tamper", "the generators the harness seeds the next inputs with were replaced by the "
                                 "candidate")
        InputKernels.check(guard)
        if changed := rebound(self.state.originals):
            raise CandidateError("tamper", f"{changed[0]} was replaced by the candidate (it runs as the harness makes "
                                 "the next call's inputs)")
        names = vars(self.ref_mod)
        if len(names) != len(self._ref_names) or any(names.get(k) is not v for k, v in self._ref_names.items()):
            raise CandidateError("tamper", "the task module's names were rebound by the candidate (its get_inputs "
                                 "makes the next call's inputs)")

    def sync(self) -> None:
        if self.device.type == "cuda":
            self.state.originals["torch.cuda.synchronize"]()

    def sync_caller_stream(self) -> None:
        """Wait for the caller's stream only: PyTorch semantics for a returned output. Work left
        on a side stream that was not joined is still running, and shows up as wrong or late."""
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise equality (NaNs included) of two tensors of the same dtype."""
    a, b = a.detach().contiguous().reshape(-1), b.detach().contiguous().reshape(-1)
    if a.dtype != b.dtype or a.numel() != b.numel():
        return False
    return bool(torch.equal(a.view(torch.uint8), b.view(torch.uint8)))


def clone_args(args: list[Any]) -> list[Any]:
    """Tensors cloned, other arguments as they are."""
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

