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
from collections.abc import Callable
from typing import Any, Literal

from pydantic import BaseModel, Field, field_validator

from cudagym.core.verdict import AuditMode

JobKind = Literal["verify", "reference", "profile", "baseline", "compile_inline", "build_inline", "probe", "ncu"]
TIMING_KINDS = ("profile", "baseline")  # need the device to themselves


class VerifyConfig(BaseModel):
    """Correctness protocol: trials with fresh secret seeds, half of them candidate-first."""

    trials: int = Field(default=6, ge=5)
    scaled_trial: bool = True  # one trial with floating inputs scaled x3 (another distribution)
    min_own_share: float = 0.3  # permissive mode: share of device time in the candidate's kernels
    settle_ms: float = 20.0  # wait before re-reading an output, to catch work finishing late


MAX_IDLE_MS = 1000.0  # the longest gap server mode may idle before a call


class TimingConfig(BaseModel):
    """Timing protocol (see `cudagym.sandbox.timing`)."""

    warmup_calls: int = 5
    warmup_ms: float = 100.0  # wall-clock, at least: clocks leave their idle state
    min_calls: int = 20
    max_calls: int = 500
    target_ms: float = 300.0  # wall-clock budget of the timed calls (sets their number after warm-up)
    # rotating input buffers, refilled with fresh values before every call: up to input_sets of
    # them within input_set_bytes and max_calls / 8 (at least 4). A one-op call of a few
    # microseconds reads a few percent more or less with where its buffers lie; 16 sets instead of
    # 4 (and the placements `drive_calls` rotates) took an 8 us softmax's spread over 10 processes
    # from 3.5% to 2.5% on an H100 (`benchmarks/probe_stamps.py`)
    input_sets: int = 16
    input_set_bytes: int = 512 * 2**20
    recheck_calls: int = 6  # timed calls, drawn by the parent (`CallFeed.recheck_sample`), whose samples are re-checked
    flush_l2: bool = True
    # GPU: every SM is held this long while each call is launched, so that the host's work of
    # launching it is not timed (host work beyond it is); the call's inputs take their values at
    # its end. 200 us left 10-70% of a one-op call's launches late in the harness on an H100 (host
    # spans 0.11-0.25 ms, median), and those calls read 10-50 us long (benchmarks/probe_launch_window.py)
    launch_window_us: float = 1000.0
    # The parent's clock bounds the reported times on a GPU (`cudagym.sandbox.feed`): a median
    # gap beyond clock_slack_ms + clock_slack_rel x the median call is reported as tampering.
    # Honest gaps: -1.3 to +0.5 ms on an H100 (48 loops, calibration taken before the loop);
    # on a loaded 2-core CPU -13 to +30 ms at 2-19 ms calls, so the CPU target only reports it
    clock_slack_ms: float = 1.0
    clock_slack_rel: float = 1.0
    # Server mode (`ServerTiming`): before every call (warm-up and probes too, so that nothing
    # tells them apart) the worker idles a gap drawn uniformly from idle_ms, from a generator
    # seeded by idle_seed and the role: calls arrive at random intervals, not back to back, so
    # the GPU's clocks and the host are not warm as in a loop. None: offline (back to back).
    idle_ms: tuple[float, float] | None = None
    idle_seed: int = 0

    def input_sets_for(self, set_bytes: int) -> int:
        """How many input sets a loop rotates when one takes `set_bytes`: as many as fit
        input_set_bytes and a full loop uses 8 times each, at most input_sets, at least 4. A set
        that never comes back cannot show a result replayed by buffer (the parent re-checks calls
        whose buffers came back, `CallFeed.recheck_sample`)."""
        fits = min(self.input_sets, self.input_set_bytes // max(set_bytes, 1), self.max_calls // 8)
        return max(min(self.input_sets, 4), fits)

    @staticmethod
    def parse_idle(text: str) -> tuple[float, float]:
        """'LOW,HIGH' in ms (a command line's server-mode gaps) as `idle_ms`; ValueError if not."""
        try:
            low, high = (float(x) for x in text.split(","))
        except ValueError:
            raise ValueError(f"server-mode gaps are LOW,HIGH in ms (e.g. 1,10), not {text!r}") from None
        return TimingConfig(idle_ms=(low, high)).idle_ms  # type: ignore[return-value]

    @field_validator("idle_ms")
    @classmethod
    def _gap_bounds(cls, v: tuple[float, float] | None) -> tuple[float, float] | None:
        if v is not None and not 0.0 <= v[0] <= v[1] <= MAX_IDLE_MS:
            raise ValueError(f"idle_ms must be (low, high) with 0 <= low <= high <= {MAX_IDLE_MS:g} ms, not {v}")
        return v


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
    inline_build_root: str | None = None  # build_inline only: torch's build directory (in its writable staging dir)
    inline_request: dict[str, Any] | None = None  # build_inline only: the extension, as the parent checked it
    mode: AuditMode = "strict"
    seed: int = 0  # secret; never derived from anything the candidate sees
    # verify: the candidate's worker gets the number of trials here and each trial's seed, scale
    # and order only when the trial starts (`cudagym.sandbox.feed.TrialFeed`); the reference-only
    # worker, which runs no candidate code, gets the whole plan here. Its outputs are the ones
    # compared (correctness cannot be forged in-process).
    init_seed: int = 0
    # ModelNew's parameters: its own same-seed build, or Model's state_dict loaded (a second try;
    # `harness.Problem`)
    params: Literal["seed", "state_dict"] = "seed"
    trials: int = 0
    trial_seeds: list[int] = Field(default_factory=list)
    trial_scales: list[float] = Field(default_factory=list)
    trial_orders: list[str] = Field(default_factory=list)
    # reference (re-check of timed calls): trial t's outputs are also projected with the weights of
    # the call's seed (`cudagym.sandbox.timing.projection`)
    projection_seeds: list[int] = Field(default_factory=list)
    verify: VerifyConfig = Field(default_factory=VerifyConfig)
    timing: TimingConfig = Field(default_factory=TimingConfig)
    limits: LimitsConfig = Field(default_factory=LimitsConfig)
    writable: list[str] = Field(default_factory=list)  # extra writable dirs (baseline: compiler caches)
    with_compile_baseline: bool = True
    # baseline: library baselines to time after eager and torch.compile (`cudagym.sandbox.library`),
    # each first checked against the reference at (atol, rtol)
    library_baselines: list[str] = Field(default_factory=list)
    library_tolerance: tuple[float, float] = (1e-2, 1e-2)
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


def read_frame(read_into: Callable[[memoryview], bool], max_payload: int) -> tuple[dict[str, Any], memoryview] | None:
    """One frame from a stream; `read_into(view)` fills `view` completely or returns False at
    the end of the stream. None at a clean end; FrameError for a malformed or truncated frame.
    The payload is read straight into its own buffer (one copy from the pipe, none after)."""
    head = bytearray(_HDR.size)
    if not read_into(memoryview(head)):
        return None
    (hl,) = _HDR.unpack(head)
    if hl > MAX_HEADER:
        raise FrameError("bad frame header length")
    hbuf = bytearray(hl + _LEN.size)
    if not read_into(memoryview(hbuf)):
        raise FrameError("truncated frame header")
    try:
        header = json.loads(bytes(hbuf[:hl]))
    except ValueError:
        raise FrameError("frame header is not JSON") from None
    if not isinstance(header, dict):
        raise FrameError("frame header is not an object")
    (pl,) = _LEN.unpack_from(hbuf, hl)
    if pl > max_payload:
        raise FrameError(f"a frame payload of {pl} bytes exceeds the limit of {max_payload}")
    payload = bytearray(pl)
    if pl and not read_into(memoryview(payload)):
        raise FrameError("truncated frame payload")
    return header, memoryview(payload)


def decode_frames(buf: bytes | bytearray) -> list[tuple[dict[str, Any], memoryview]]:
    """Split a complete result stream held in memory into (header, payload) frames."""
    view, pos = memoryview(buf), 0

    def read_into(dst: memoryview) -> bool:
        nonlocal pos
        n = len(dst)
        if pos + n > len(view):
            if pos < len(view):
                raise FrameError("truncated frame")
            return False
        dst[:] = view[pos : pos + n]
        pos += n
        return True

    out = []
    while (frame := read_frame(read_into, len(buf))) is not None:
        out.append(frame)
    return out
