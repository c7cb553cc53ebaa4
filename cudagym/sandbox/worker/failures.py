"""How a worker names a failure of the candidate's: `CandidateError` (its `kind` an `ErrorKind`
value), the kind an exception of the candidate's code maps to, and the traceback the candidate is
shown (its own frames only).

A module of its own, without torch, because the wire protocol's worker end raises
`CandidateError` too and the parent imports that module.
"""

from __future__ import annotations

import errno
import traceback

MAX_MESSAGE = 1000  # characters of an exception's own message kept in a verdict


class CandidateError(Exception):
    """The candidate's own code failed; `kind` is an ErrorKind value."""

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(message)
        self.kind = kind


def failure_kind(e: BaseException, hook_attempts: list[str]) -> str:
    """Sandbox refusals (writes outside the workspace, network) are named as such; any hook
    refused so far (`WorkerState.hook_attempts`) makes the failure tampering."""
    if hook_attempts:  # the refusal of a profile/trace/audit hook (`integrity.audit_hook`) surfaced here
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


def candidate_traceback(exc: BaseException, roots: list[str]) -> str:
    """The exception with only the frames from the candidate's own files."""
    tb = traceback.extract_tb(exc.__traceback__)
    keep = [f for f in tb if any(f.filename.startswith(r) for r in roots) or f.filename.startswith("<candidate")]
    lines = traceback.format_list(keep)[-12:] if keep else []
    what = "".join(traceback.format_exception_only(type(exc), exc)).strip()
    if len(what) > MAX_MESSAGE:  # the candidate's own message, trimmed (it may hold raw data)
        what = what[:MAX_MESSAGE] + f" ... ({len(what)} characters)"
    return ("Traceback (candidate frames):\n" + "".join(lines) if lines else "") + what
