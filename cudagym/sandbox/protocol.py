"""Messages between the evaluator (parent) and a sandboxed worker process.

The parent writes one `Job` as a JSON line to the worker's stdin. The worker answers on a
dedicated pipe with frames: `[u32 header length][header JSON][u64 payload length][payload]`.
Tensors travel as raw bytes with dtype and shape in the header, never pickled: the parent
does not unpickle anything the candidate's process could have written. Output comparison,
statistics and the verdict are computed in the parent, out of the candidate's reach.
"""

from __future__ import annotations

import json
import struct
from typing import Any, Literal

from pydantic import BaseModel, Field

from cudagym.rewards.verdict import AuditMode

JobKind = Literal["verify", "reference", "profile", "baseline", "compile_inline", "probe", "ncu"]
TIMING_KINDS = ("profile", "baseline")  # need the device to themselves


class VerifyConfig(BaseModel):
    """Correctness protocol: trials with fresh secret seeds, half of them candidate-first."""

    trials: int = Field(default=6, ge=5)
    scaled_trial: bool = True  # one trial with floating inputs scaled x3 (another distribution)
    min_own_share: float = 0.3  # permissive mode: share of device time in the candidate's kernels
    settle_ms: float = 20.0  # wait before re-reading an output, to catch work finishing late


class TimingConfig(BaseModel):
    """Timing protocol (see `cudagym.sandbox.timing`)."""

    warmup_calls: int = 5
    warmup_ms: float = 100.0  # and at least this long, so that clocks leave their idle state
    min_calls: int = 20
    max_calls: int = 1000
    target_ms: float = 300.0  # time budget of the timed loop, excluding flushes
    input_sets: int = 4  # rotating input buffers, refilled with fresh values before every call
    recheck_calls: int = 3  # timed calls whose outputs are checked against the reference
    flush_l2: bool = True


class LimitsConfig(BaseModel):
    """Per-job sandbox limits."""

    timeout_s: float = 120.0
    memory_mb: int = 8192  # host memory of the worker (resident)
    max_processes: int = 64  # processes + threads of the job
    max_file_mb: int = 64
    network: bool = False


class Job(BaseModel):
    kind: JobKind
    nonce: str  # echoed in the final frame; a frame without it is a forgery
    task_id: str
    task_code: str = ""
    dtype: str = "float32"
    device: str = "cpu"  # "cpu" or "cuda" (the worker sees one GPU as cuda:0)
    workspace: str = ""
    artifact_dir: str | None = None
    cache_dir: str = ""
    inline_build_root: str | None = None  # compile_inline only
    mode: AuditMode = "strict"
    seed: int = 0  # secret; never derived from anything the candidate sees
    # verify/reference: the same plan goes to the candidate's worker and to a reference-only
    # worker, whose outputs are the ones compared (correctness cannot be forged in-process).
    init_seed: int = 0
    trial_seeds: list[int] = Field(default_factory=list)
    trial_scales: list[float] = Field(default_factory=list)
    trial_orders: list[str] = Field(default_factory=list)
    verify: VerifyConfig = Field(default_factory=VerifyConfig)
    timing: TimingConfig = Field(default_factory=TimingConfig)
    limits: LimitsConfig = Field(default_factory=LimitsConfig)
    writable: list[str] = Field(default_factory=list)  # extra writable dirs (baseline: compiler caches)
    with_compile_baseline: bool = True
    probe: str | None = None  # probe jobs: python source run as the candidate (tests of the sandbox)


_HDR = struct.Struct("<I")
_LEN = struct.Struct("<Q")
MAX_HEADER = 1 << 20


def encode_frame_head(header: dict[str, Any], payload_len: int) -> bytes:
    """Everything of a frame but its payload (sent separately, without a copy)."""
    h = json.dumps(header).encode()
    return _HDR.pack(len(h)) + h + _LEN.pack(payload_len)


def encode_frame(header: dict[str, Any], payload: bytes = b"") -> bytes:
    return encode_frame_head(header, len(payload)) + payload


class FrameError(Exception):
    """A malformed frame: the result channel was written by something other than the harness."""


def decode_frames(buf: bytes | bytearray) -> list[tuple[dict[str, Any], memoryview]]:
    """Split a result stream into (header, payload) frames; payloads are views, not copies."""
    view = memoryview(buf)
    out, i = [], 0
    while i < len(buf):
        if i + _HDR.size > len(buf):
            raise FrameError("truncated frame header")
        (hl,) = _HDR.unpack_from(buf, i)
        i += _HDR.size
        if hl > MAX_HEADER or i + hl + _LEN.size > len(buf):
            raise FrameError("bad frame header length")
        try:
            header = json.loads(bytes(view[i : i + hl]))
        except ValueError:
            raise FrameError("frame header is not JSON") from None
        if not isinstance(header, dict):
            raise FrameError("frame header is not an object")
        i += hl
        (pl,) = _LEN.unpack_from(buf, i)
        i += _LEN.size
        if i + pl > len(buf):
            raise FrameError("truncated frame payload")
        out.append((header, view[i : i + pl]))
        i += pl
    return out
