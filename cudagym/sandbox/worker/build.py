"""The jobs that build or load code without checking it: `compile_inline` (which extensions the
candidate asks torch to build), `build_inline` (one of them, built by the parent's trusted job)
and `probe` (a snippet run as candidate code: the sandbox's own tests).
"""

from __future__ import annotations

import secrets
from pathlib import Path
from typing import Any

import torch

from cudagym.sandbox.worker.failures import CandidateError, candidate_traceback, failure_kind
from cudagym.sandbox.worker.problem import load_candidate, load_reference
from cudagym.sandbox.worker.state import WorkerState
from cudagym.sandbox.worker.wire import Channel, Job


def run_compile_inline(job: Job, ch: Channel, state: WorkerState) -> None:
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
        mod = load_candidate(job, state)
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


def run_build_inline(job: Job, ch: Channel, state: WorkerState) -> None:
    """Build the one extension of `job.inline_request` (checked by the parent) with torch's own
    loader into `job.inline_build_root`; runs no candidate code and never loads what it built."""
    from cudagym.sandbox.inline import InlineCompileError, build_extension

    try:
        build_extension(job.inline_request or {}, Path(job.inline_build_root or ""))
    except InlineCompileError as e:
        raise CandidateError("compile_error", str(e)) from None
    ch.final({"ok": True})


def run_probe(job: Job, ch: Channel, state: WorkerState) -> None:
    """Run `job.probe` as candidate code (used by the sandbox's own tests)."""
    ns: dict[str, Any] = {}
    try:
        exec(compile(job.probe or "", "<candidate probe>", "exec"), ns)  # noqa: S102
    except Exception as e:  # noqa: BLE001
        raise CandidateError(failure_kind(e, state.hook_attempts), candidate_traceback(e, [job.workspace])) from None
    ch.final({"ok": True, "result": repr(ns.get("RESULT"))[:2000]})
