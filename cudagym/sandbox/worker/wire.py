"""The wire protocol between the evaluator (parent) and a sandboxed worker, both ends in one place.

The parent writes one `Job` as a JSON line to the worker's stdin. The worker answers on a
dedicated pipe with frames: `[u32 header length][header JSON][u64 payload length][payload]`.
Tensors travel as raw bytes with dtype and shape in the header (dtypes of
`cudagym.sandbox.worker.dtypes.WIRE_DTYPES`), never pickled: the parent does not unpickle
anything the candidate's process could have written. Output comparison, statistics and the
verdict are computed in the parent, out of the candidate's reach.

- the worker's end, `Channel`: writes frames, copies tensor bytes into the result memory, asks
  the parent for the next step (request frames, answered on stdin, read by `LineReader`);
- the parent's end, `FrameReader` and `collect_outcome`: reads the frames on a thread as they
  arrive (answering request frames), and maps the result memory only once the worker is gone.

Shared by every sandbox backend. The parent imports this module without torch (only the
worker's `Channel.send_tensor` needs it).
"""

from __future__ import annotations

import asyncio
import json
import math
import mmap
import os
import select
import struct
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

from pydantic import BaseModel, Field

from cudagym.core.verdict import AuditMode
from cudagym.sandbox.protocol import EVIDENCE_SAMPLES, LimitsConfig, TimingConfig, VerifyConfig
from cudagym.sandbox.worker.failures import CandidateError

if TYPE_CHECKING:
    import torch


JobKind = Literal["verify", "reference", "profile", "baseline", "compile_inline", "build_inline", "probe", "ncu"]
TIMING_KINDS = ("profile", "baseline")  # need the device to themselves
# the mark a timed job's worker writes as it is about to import the candidate's code (and waits for
# the parent to have): a thread started after its arrival was started by the candidate's code
LOADING_MARK = "candidate"
# how long (s) a CPU profile's worker takes the harness's steps between timed calls (the next inputs,
# the cache flush) right before that mark: their samples are what torch's compute between the calls
# may be (`cudagym.sandbox.cpusamples.attribute`)
HARNESS_STEPS_S = 0.3


@dataclass
class JobOutcome:
    """What came back from one worker. `final` is None when the worker died or was killed."""

    final: dict[str, Any] | None
    tensors: list[tuple[dict[str, Any], bytes | memoryview]] = field(default_factory=list)
    started: dict[str, Any] | None = None
    returncode: int | None = None
    timed_out: bool = False
    memory_exceeded: bool = False
    process_limited: bool = False
    channel_error: str | None = None  # malformed or forged frames
    output: str = ""  # the worker's stdout+stderr (the candidate's prints), trimmed
    seconds: float = 0.0  # from the worker's ready frame to its exit
    wait_s: float = 0.0  # waiting for a spare worker to be ready (start-up not yet done)
    lease_wait_s: float = 0.0  # then waiting for the device (a GPU's lease, the CPU's slots)
    lease_upgrade_s: float = 0.0  # a GPU timing job, loaded under a shared lease: waiting for the GPU alone
    phases: dict[str, float] = field(default_factory=dict)  # the worker's own time per phase (s)
    # a timing job: another process used its GPU before or during it (what was seen); the
    # timing is not valid
    device_busy: str | None = None
    # a timing job: the host's load during its timed loops (`QuietWindows.load`): windows,
    # window_s, host_busy_s, job_busy_s, parent_busy_s, other_cores, frozen_jobs, frozen_processes
    host_load: dict[str, Any] = field(default_factory=dict)
    # where the job's directories were as the worker saw them, {worker path: host path}, for
    # those it saw elsewhere than the host (a container's job directory); paths a job's outputs
    # name (a build's dependency files) are read through it
    paths: dict[str, str] = field(default_factory=dict)


# Answers a worker's request during its job: `responder(request, arrived_s)` gets the request
# frame's header and the `time.perf_counter()` at which it arrived, and returns the answer (a
# JSON object written to the worker as one line). Called on the sandbox's own thread, one request
# at a time per job; it must not block.
Responder = Callable[[dict[str, Any], float], dict[str, Any]]


# where a forked worker has its inputs maker's pipes: the parent's seeds (read), the maker's
# answers (written) (`cudagym.sandbox.worker.maker`)
MAKER_FDS = (5, 6)


class Job(BaseModel):
    """One job for one worker, written to its stdin as a JSON line: what to run (`kind`), on which
    task and workspace, under which protocols and limits."""

    kind: JobKind
    nonce: str  # echoed in the final frame; a frame without it is a forgery
    task_id: str
    task_code: str = ""
    dtype: str = "float32"
    device: str = "cpu"  # "cpu" or "cuda" (the worker sees one GPU as cuda:0)
    # a CPU profile job: its timed calls' inputs are made by the worker's inputs maker, whose pipes
    # the sandbox gave it (`cudagym.sandbox.worker.maker`); set by the sandbox, not the evaluator
    inputs_maker: bool = False
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
    # `cudagym.sandbox.worker.problem.Problem`)
    params: Literal["seed", "state_dict"] = "seed"
    trials: int = 0
    trial_seeds: list[int] = Field(default_factory=list)
    trial_scales: list[float] = Field(default_factory=list)
    trial_orders: list[str] = Field(default_factory=list)
    # reference (re-check of timed calls): trial t's outputs are also projected with the weights of
    # the call's seed (`cudagym.sandbox.timing.projection`)
    projection_seeds: list[int] = Field(default_factory=list)
    # reference (re-check): the trials from this one on send their projections only, not their
    # outputs (the timed calls whose samples are not compared)
    projected_only_from: int | None = None
    # reference (verify): the seed of trial t's evidence, for outputs above
    # `verify.whole_output_mb` (`cudagym.sandbox.worker.verify.output_evidence`); the candidate's
    # worker gets it from the parent once the trial's outputs exist (`TrialFeed`)
    evidence_seeds: list[int] = Field(default_factory=list)
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
    # the scheduler gives the job its device alone, as a timing job has it (verify's retry after it
    # ran out of device memory beside other jobs: `Evaluator.averify`); the worker reads nothing of it
    alone: bool = False


# -- frames -----------------------------------------------------------------------------------
_HDR = struct.Struct("<I")
_LEN = struct.Struct("<Q")
MAX_HEADER = 1 << 20


def _unencodable(o: Any) -> Any:
    raise TypeError(f"Object of type {type(o).__name__} is not JSON serializable")


def _parse_constant(name: str) -> float:
    return float(name)  # NaN, Infinity, -Infinity


# The worker's frames are encoded, and the parent's answers decoded, by `_json`'s C encoder and
# scanner, made as this module is imported (before any candidate code): `json.dumps`/`loads` are
# Python that reads the `json` modules' globals on every call, which candidate code can rebind
# (red team 19's b read each next call's seed through a `json.loads` of its own and computed the
# output before the interval; its e halved the reported times inside `json.dumps`). The output is
# `json.dumps`'s (the same separators and escapes); a header holding no JSON type raises TypeError.
try:
    from _json import make_encoder as _make_encoder, make_scanner as _make_scanner, \
        encode_basestring_ascii as _escape

    _ENCODE: Callable[[Any, int], Any] = _make_encoder(None, _unencodable, _escape, None, ": ", ", ",
                                                       False, False, True)
    _scanner = _make_scanner(type("_Context", (), {
        "strict": True, "object_hook": None, "object_pairs_hook": None, "parse_float": float, "parse_int": int,
        "parse_constant": staticmethod(_parse_constant), "memo": {}})())
except ImportError:  # an interpreter without the C accelerator
    _ENCODE, _scanner = None, None  # type: ignore[assignment]
_JOIN = "".join


def dumps(obj: Any) -> str:
    """`json.dumps(obj)`, in C."""
    return _JOIN(_ENCODE(obj, 0)) if _ENCODE is not None else json.dumps(obj)


def loads(text: str | bytes) -> Any:
    """`json.loads(text)` of one JSON object (ValueError if it is not one), in C."""
    if _scanner is None:
        return json.loads(text)
    if isinstance(text, (bytes, bytearray)):
        text = text.decode()
    text = text.strip()
    try:
        obj, end = _scanner(text, 0)
    except StopIteration:
        raise ValueError("not JSON") from None
    if end != len(text):
        raise ValueError("extra data after the JSON value")
    return obj


def encode_frame_head(header: dict[str, Any], payload_len: int) -> bytes:
    """Everything of a frame but its payload (sent separately, without a copy)."""
    h = dumps(header).encode()
    return _HDR.pack(len(h)) + h + _LEN.pack(payload_len)


def encode_frame(header: dict[str, Any], payload: bytes = b"") -> bytes:
    return encode_frame_head(header, len(payload)) + payload


class FrameError(Exception):
    """A malformed frame: the result channel was written by something other than the harness."""


def read_frame(read_into: Callable[[memoryview], bool], max_payload: int,
               admit: Callable[[dict[str, Any], int], None] | None = None) -> tuple[dict[str, Any], memoryview] | None:
    """One frame from a stream; `read_into(view)` fills `view` completely or returns False at
    the end of the stream. None at a clean end; FrameError for a malformed or truncated frame, or
    one `admit(header, payload length)` refuses (before its payload is read).
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
    if admit is not None:
        admit(header, pl)
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


# -- the worker's end ---------------------------------------------------------------------------
class Channel:
    """The result channel to the parent: frames on a pipe, tensor bytes in a shared-memory file.

    The parent hands every worker a sealed memfd of fixed capacity; a tensor is copied (from the
    GPU, directly) into the next free region and its frame names the region. The parent maps
    the file only after the worker is gone, so the bytes it compares can no longer change.
    Without a memfd, tensor bytes travel on the pipe. `stdin`: where the parent's answers to
    requests arrive (the reader that read the job's line); `premapped`: the start of the result
    memory, mapped while the worker was a spare (`prewarm.premap_results`).
    """

    def __init__(self, fd: int, nonce: str, stdin: LineReader, shm_fd: int | None = None,
                 premapped: mmap.mmap | None = None) -> None:
        self._fd, self._nonce, self._shm = fd, nonce, shm_fd
        self._write = os.write
        self._shm_off = 0
        self._shm_cap = os.fstat(shm_fd).st_size if shm_fd is not None else 0
        self._premapped = premapped if shm_fd is not None else None
        self._stdin = stdin

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
        import torch  # the worker's end only: the parent imports this module without torch

        c = t.detach()
        header = {"type": "tensor", "role": role, "trial": trial, "index": index,
                  "dtype": str(c.dtype).removeprefix("torch."), "shape": list(c.shape), **extra}
        n = c.numel() * c.element_size()
        if n and self._shm is not None and not pipe:
            off = self._shm_off
            if off + n > self._shm_cap:
                raise CandidateError("output_format",
                                     f"the outputs exceed the result limit of {self._shm_cap >> 20} MB")
            if self._premapped is not None and off + n <= len(self._premapped):
                mm, at = self._premapped, off  # populated (and page-locked on a GPU) while a spare
            else:
                mm, at = map_shared(self._shm, n, off), 0
            dst = torch.frombuffer(mm, dtype=c.dtype, count=c.numel(), offset=at)
            dst.copy_(c.reshape(-1))  # device -> shared pages, one copy
            del dst
            if mm is not self._premapped:
                mm.close()
            self._shm_off = off + -(-n // mmap.ALLOCATIONGRANULARITY) * mmap.ALLOCATIONGRANULARITY
            self.send({**header, "offset": off, "nbytes": n})
            return
        c = c.to("cpu").contiguous()
        raw = c.reshape(-1).view(torch.uint8).numpy().data.cast("B") if c.numel() else b""
        self.send(header, raw)

    @property
    def fd(self) -> int:
        """The pipe's descriptor (the CPU timer's native open and close write on it too)."""
        return self._fd

    def final(self, body: dict[str, Any]) -> None:
        self.send({"type": "final", "nonce": self._nonce, **body})

    def mark(self, what: str, wait: bool = False, **body: Any) -> None:
        """A mark the parent notes with its own clock as it arrives (`FrameReader.marks`): where
        forward starts and where it returned (`at`: this process's clock, read just before), the
        CPU sampler's windows (`cudagym.sandbox.cpusamples`). With `wait`, this process goes on
        once the parent has read it: nothing the harness runs next falls before the arrival (a
        window opens at the earlier of a start's `at` and its arrival, and closes at the later of
        an end's: a parent slow to read, on a loaded machine, would stretch verify's windows over
        the harness's next steps, its reference run and its dispatcher reads)."""
        self.send({"type": "mark", "what": what, "wait": wait, **body})
        if wait:
            self._answer()

    def request(self, what: str, **body: Any) -> dict[str, Any]:
        """Ask the parent for the next step (see `cudagym.sandbox.feed`); its answer."""
        self.send({"type": "request", "what": what, **body})
        return self._answer()

    def _answer(self) -> dict[str, Any]:
        line = self._stdin.readline()
        try:
            answer = loads(line)
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

    def __init__(self, fd: int) -> None:
        self._fd, self._buf = fd, bytearray()
        self._read = os.read

    def readline(self) -> bytes:
        buf = self._buf
        if type(buf) is not bytearray:  # before any method of it runs (red team 30's subclass ran its `in`)
            raise CandidateError("tamper", "the harness's result channel was modified by the candidate (its "
                                 "reader's buffer is not a bytearray)")
        while b"\n" not in buf:
            chunk = self._read(self._fd, 1 << 16)
            if not chunk:
                self._buf = bytearray()
                return bytes(buf)
            buf += chunk
        end = buf.index(b"\n") + 1
        line = bytes(buf[:end])
        del buf[:end]
        return line


def map_shared(fd: int, size: int, offset: int = 0) -> mmap.mmap:
    """A writable, populated (no page faults later) shared mapping of part of the result memory."""
    return mmap.mmap(fd, size, flags=mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0),
                     prot=mmap.PROT_READ | mmap.PROT_WRITE, offset=offset)


# -- the parent's end ---------------------------------------------------------------------------
# the bytes of one element of each dtype the evidence of a CPU call may hold (`native_layout`)
_ITEMSIZE = {"float32": 4, "float64": 8, "float16": 2, "bfloat16": 2, "uint8": 1, "bool": 1, "int8": 1, "int16": 2,
             "int32": 4, "int64": 8, "complex32": 4, "complex64": 8, "complex128": 16, "uint16": 2, "uint32": 4,
             "uint64": 8, "float8_e4m3fn": 1, "float8_e5m2": 1, "float8_e4m3fnuz": 1, "float8_e5m2fnuz": 1}


def native_layout(layout: Any, sizes: Any, payload: int) -> list[tuple[dict[str, Any], int]] | str:
    """The tensor headers (but "type" and "trial") and byte counts of a native close's evidence, in
    payload order; or why its layout (the worker's, per output: "index", "dtype", the samples'
    "shape", the output's "full_shape"; null for an output read but not sampled) and its sizes
    (the close's, per output: [values, positions, projection] bytes) do not take exactly `payload`
    bytes: outputs numbered 0, 1, ... in order, `EVIDENCE_SAMPLES` values each (all of an output
    that has no more, in its shape, without positions), 8 bytes a position, 32 for 4 projections."""
    if not isinstance(layout, list) or not isinstance(sizes, list) or len(layout) != len(sizes):
        return "not one size for each output"
    pieces: list[tuple[dict[str, Any], int]] = []
    index = 0
    for meta, size in zip(layout, sizes):
        if not (isinstance(size, list) and len(size) == 3 and all(type(b) is int and b >= 0 for b in size)):
            return f"malformed sizes {size!r}"
        v, p, j = size
        if meta is None:
            if v or p or j:
                return "bytes for an output it does not describe"
            continue
        if not isinstance(meta, dict) or set(meta) != {"index", "dtype", "shape", "full_shape"}:
            return f"malformed output {meta!r}"
        shape, full, itemsize = meta["shape"], meta["full_shape"], _ITEMSIZE.get(str(meta["dtype"]))
        if not all(isinstance(t, list) and all(type(d) is int and d >= 0 for d in t) for t in (shape, full)):
            return f"malformed shapes {meta!r}"
        numel = math.prod(full)
        count = min(numel, EVIDENCE_SAMPLES)
        sampled = numel > EVIDENCE_SAMPLES
        if meta["index"] != index or itemsize is None or (shape != [count] if sampled else shape != full) \
                or v != count * itemsize or p != (8 * count if sampled else 0) or j not in (0, 32):
            return f"output {index}: {meta!r} does not take {size!r} bytes"
        index += 1
        head = {"index": meta["index"], "dtype": meta["dtype"]}
        pieces.append(({**head, "role": "sample", "shape": shape, "full_shape": full}, v))
        if p:
            pieces.append(({**head, "role": "positions", "dtype": "int64", "shape": [count]}, p))
        if j:
            pieces.append(({**head, "role": "projection", "dtype": "float64", "shape": [4]}, j))
    if sum(n for _, n in pieces) != payload:
        return "its sizes do not add up to its payload"
    return pieces


class FrameReader:
    """Reads one worker's result pipe on its own thread, frame by frame.

    Frames are small (tensor bytes go through the worker's result memory); a payload that does
    come on the pipe is read straight into its own buffer.
    `ready` resolves at the worker's ready frame; `done` when the pipe closes or `stop()`.
    `startup_s` then holds the seconds of each of the worker's start-up steps (its own clocks) and
    `wall`, from `started` (when the worker was asked for; default: now) to the ready frame.
    Request frames are answered here, as they arrive, by the job's responder (see
    `Sandbox.run`), on the worker's stdin (`answer_fd`); `requests` counts them.
    """

    def __init__(self, fd: int, loop: asyncio.AbstractEventLoop, max_bytes: int, started: float | None = None) -> None:
        self._fd, self._loop, self._budget = fd, loop, max_bytes
        self.ready: asyncio.Future[bool] = loop.create_future()
        self.done: asyncio.Future[None] = loop.create_future()
        self.final_seen: asyncio.Future[None] = loop.create_future()  # the harness's result arrived
        self.frames: list[tuple[dict[str, Any], memoryview]] = []
        self.error: str | None = None  # a malformed frame (not a worker that died mid-frame)
        self.responder: Responder | None = None  # set when the job starts
        # run before a mark the worker waits on is acknowledged (its `what`): a dict to acknowledge
        # with instead of `{}` (`cudagym.sandbox.makerlink.MakerLink.opened`)
        self.on_mark: Callable[[str], dict[str, Any] | None] | None = None
        self.on_acked: Callable[[str], None] | None = None  # run once that acknowledgement is written (or failed)
        self.answer_fd: int | None = None
        self.requests = 0
        # the CPU target's native stamps of timed calls since the last request (`stamped`), and the
        # call the next ones belong to: (role, index) of the last call request not answered "stop"
        self._stamps: list[dict[str, Any]] = []
        self._calling: tuple[Any, int] | None = None
        self.native_stamps = False  # the job's calibration request said its calls are stamped natively
        self._call_steps: list[str] = []  # the frames of the call under way, in order (`_admit`)
        self._close_pieces: list[tuple[dict[str, Any], int]] = []  # the last close's evidence (`_admit`)
        # (what, the worker's clock it reported, arrival on this process's clock) of each mark
        # and request (`Channel.mark`): where the job's forward calls began and ended
        self.marks: list[tuple[str, Any, float]] = []
        self.in_call = False  # between a "forward" mark and its "returned" one (the parent's other work waits)
        self.startup_s: dict[str, float] = {}
        self._started = time.perf_counter() if started is None else started
        self._stop = threading.Event()
        self._poll = select.poll()
        self._poll.register(fd, select.POLLIN | select.POLLHUP | select.POLLERR)
        threading.Thread(target=self._run, name="cudagym-frames", daemon=True).start()

    def stop(self) -> None:
        self._stop.set()

    def _read_into(self, view: memoryview) -> bool:
        while len(view):
            while not self._poll.poll(50):
                if self._stop.is_set():
                    return False
            n = os.readv(self._fd, [view])
            if n == 0:
                return False
            view = view[n:]
        return True

    def _answer(self, request: dict[str, Any], arrived: float) -> dict[str, Any]:
        """Answer one request on the worker's stdin (a worker that stopped reading gets none); the
        answer. The request carries, under "stamps", the native stamps that arrived since the last
        one (`stamped`; whatever the worker put there is replaced)."""
        request["stamps"], self._stamps = self._stamps, []
        self.requests += 1
        if self.responder is None or self.answer_fd is None:
            answer: dict[str, Any] = {"refused": "this job takes no requests"}
        else:
            try:
                answer = self.responder(request, arrived)
            except Exception as e:  # noqa: BLE001 - a responder bug must not hang the worker
                answer = {"refused": f"the evaluator could not answer: {type(e).__name__}: {e}"}
        if self.answer_fd is not None:
            try:
                write_all(self.answer_fd, (json.dumps(answer) + "\n").encode())
            except OSError:
                pass
        return answer

    def _admit(self, header: dict[str, Any], payload: int) -> None:
        """Refuse a frame by its header, before its payload is read (`read_frame`). In a natively
        stamped call the harness sends, in this order: the call's start mark (the CPU candidate's
        calls), the open, the close, the projections of a dtype the close does not project (from
        the worker's Python, `timed.send_evidence`), the end mark, the next request; anything else,
        or out of that order, is not the harness's (red team 32's "returned" mark of its own, sent
        before the harness's close, ended the parent's window early). A close's payload is exactly
        what its layout's outputs take (`native_layout`): a frame the candidate wrote whose payload
        would take in the harness's frames after it is refused here, not read until the worker
        stalls. The final frame may come at any point (a job that failed mid-call)."""
        kind, what = header.get("type"), header.get("what")
        if kind == "stamp" and what == "close":  # its pieces, for `stamped`
            if set(header) != {"layout", "type", "what", "ns", "phase_ns", "dense", "seed", "sizes"}:
                raise FrameError("a close stamp with other fields than the harness's")
            pieces = native_layout(header.get("layout"), header.get("sizes"), payload)
            if isinstance(pieces, str):
                raise FrameError(f"a close stamp whose layout does not match its payload: {pieces}")
            self._close_pieces = pieces
        if not self.native_stamps or self._calling is None or kind == "final":
            return
        # the call's frames in the harness's order: its start mark (CPU candidate), the open, the close,
        # (the projections of a dtype the close does not project), its end mark, the next request
        steps: dict[tuple[Any, Any], str] = {("mark", "forward"): "forward", ("stamp", "open"): "open",
                                             ("stamp", "close"): "close", ("mark", "returned"): "returned",
                                             ("request", what): "request"}
        step = steps.get((kind, what))
        if kind == "tensor" and header.get("role") == "projection" and header.get("dtype") == "float64" \
                and header.get("shape") == [4] and payload == 32:
            step = "projection"
        seen = self._call_steps
        last = seen[-1] if seen else ""
        after = {"forward": ("",), "open": ("", "forward"), "close": ("open",), "projection": ("close", "projection"),
                 "returned": ("close", "projection"), "request": ("close", "projection", "returned")}
        marked = "forward" in seen  # a call that began with a mark ends with one (the CPU candidate's)
        if step is None or last not in after[step] or (step == "returned" and not marked) \
                or (step == "request" and marked and "returned" not in seen):
            raise FrameError(f"a {kind!r} frame ({what or header.get('role')!r}) out of the harness's order in a "
                             f"natively stamped call (after {seen or 'its request'})")
        seen.append(step)

    def stamped(self, header: dict[str, Any], payload: memoryview,
                arrived: float) -> list[tuple[dict[str, Any], memoryview]]:
        """A native stamp of a CPU timed call (`cudagym_cpu_open`/`cudagym_cpu_close` in opwatch.cpp,
        written by the harness's native code before anything of the candidate's ran after the
        clock's reading): kept for the next request ("stamps": {"what", "ns", "arrived_s"}, and
        the close's "phase_ns", "dense" and "seed"); a close's evidence comes back as the tensor
        frames the worker's `Channel.send_tensor` would have sent (role "sample", "positions",
        "projection"), of the call asked for last (none outside a call: the calibration's).

        FrameError for a stamp in a job whose timer declared none (with the calibration, the job's
        first request: the calibration's own calls come before it); a close's header and bytes were
        checked by `_admit` before its payload was read."""
        what = header.get("what")
        if not self.native_stamps and self.requests:  # before the first request: the calibration's calls
            raise FrameError("a stamp frame in a job whose timer stamps no call natively")
        stamp: dict[str, Any] = {"what": what, "ns": header.get("ns"), "arrived_s": arrived}
        if what == "close":
            stamp.update({k: header.get(k) for k in ("phase_ns", "dense", "seed")})
        elif what != "open" or len(payload) or set(header) != {"type", "what", "ns"}:
            raise FrameError(f"a stamp frame of unknown kind {what!r}")
        self._stamps.append(stamp)
        if what != "close":
            return []
        pieces = self._close_pieces  # as `_admit` read them from this frame's header
        if self._calling is None:
            return []  # the calibration's calls (before any call was asked for)
        out, at = [], 0
        for head, n in pieces:
            if head.get("role") == "projection":
                head["seed"] = header.get("seed")
            out.append(({"type": "tensor", "trial": self._calling[1], **head}, payload[at:at + n]))
            at += n
        return out

    def _resolve(self, fut: asyncio.Future[Any], value: Any) -> None:
        def set_() -> None:
            if not fut.done():
                fut.set_result(value)

        try:
            self._loop.call_soon_threadsafe(set_)
        except RuntimeError:  # the loop has closed (sandbox shut down)
            pass

    def _run(self) -> None:
        try:
            first = read_frame(self._read_into, 0)
            ok = first is not None and first[0].get("type") == "ready"
            if ok and first is not None:
                steps = first[0].get("startup_s")
                self.startup_s = {str(k): float(v) for k, v in (steps if isinstance(steps, dict) else {}).items()
                                  if isinstance(v, (int, float))}
                self.startup_s["wall"] = time.perf_counter() - self._started
            self._resolve(self.ready, ok)
            while ok:
                frame = read_frame(self._read_into, self._budget, self._admit)
                arrived = time.perf_counter()
                if frame is None:
                    break
                kind = frame[0].get("type")
                if kind != "stamp" or self._calling is not None:  # the calibration's evidence is not kept
                    self._budget -= len(frame[1])
                if kind == "mark":  # answered here: no responder sees it
                    what = str(frame[0].get("what"))
                    self.marks.append((what, frame[0].get("at"), arrived))
                    self.in_call = what == "forward" or (self.in_call and what != "returned")
                    if frame[0].get("wait") and self.answer_fd is not None:
                        try:
                            ack = self.on_mark(what) if self.on_mark is not None else None
                            write_all(self.answer_fd, (json.dumps(ack) + "\n").encode() if ack else b"{}\n")
                        except OSError:
                            pass
                        finally:
                            if self.on_acked is not None:
                                self.on_acked(what)
                    continue
                if kind == "request":
                    self.marks.append((f"request:{frame[0].get('what')}", None, arrived))
                    if frame[0].get("what") == "calibration" and not self.requests:
                        # declared by the worker before any candidate code loads (`timed.job_timer`)
                        self.native_stamps = frame[0].get("native_stamps") is True
                    answer = self._answer(frame[0], arrived)
                    index = frame[0].get("index")
                    self._calling = ((frame[0].get("role"), index) if frame[0].get("what") == "call"
                                     and type(index) is int and not answer.get("stop") else None)
                    self._call_steps = []
                    continue
                if kind == "stamp":
                    self.frames.extend(self.stamped(frame[0], frame[1], arrived))
                    continue
                self.frames.append(frame)
                if kind == "final":
                    self._resolve(self.final_seen, None)
        except FrameError as e:
            if "truncated" not in str(e):  # a worker that died mid-frame has no result: a crash
                self.error = f"malformed result channel: {e}"
        except OSError as e:
            self.error = f"result channel: {e}"
        finally:
            self._resolve(self.ready, False)
            try:
                os.close(self._fd)
            except OSError:
                pass
            self._resolve(self.done, None)


def write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


def result_memory(capacity: int) -> int:
    """A sealed memfd of fixed capacity (sparse: only what is written takes memory)."""
    import fcntl

    fd = os.memfd_create("cudagym-results", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    os.ftruncate(fd, capacity)
    fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_GROW | fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_SEAL)
    return fd


def _map_results(shm_fd: int,
                 frames: list[tuple[dict[str, Any], memoryview]]) -> list[tuple[dict[str, Any], memoryview]]:
    """Tensor frames with their bytes: from the pipe, or from the worker's result memory."""
    cap = os.fstat(shm_fd).st_size
    spans = []
    for h, _ in frames:
        if h.get("type") == "tensor" and "offset" in h:
            off, n = h.get("offset"), h.get("nbytes")
            if not (isinstance(off, int) and isinstance(n, int) and 0 <= off and 0 < n and off + n <= cap):
                raise FrameError(f"a tensor frame names bytes outside the result memory ({off!r}, {n!r})")
            spans.append(off + n)
    # read-only (the worker is dead: the bytes are final) and populated: no fault per 4 KB page
    mm = mmap.mmap(shm_fd, max(spans), flags=mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0),
                   prot=mmap.PROT_READ) if spans else None
    view = memoryview(mm) if mm is not None else None
    out = []
    for h, payload in frames:
        if h.get("type") == "tensor" and "offset" in h and view is not None:
            payload = view[h["offset"] : h["offset"] + h["nbytes"]]
        out.append((h, payload))
    return out


def collect_outcome(frames: FrameReader, shm_fd: int, nonce: str, outcome: JobOutcome,
                    release: Callable[[], None]) -> None:
    """Fill `outcome` from a finished worker's frames and result memory (checked: a malformed or
    forged channel is a `channel_error`); `release()` frees the worker's descriptors after."""
    try:
        if frames.error:
            outcome.channel_error = frames.error
            return
        try:
            received = _map_results(shm_fd, frames.frames)
        except FrameError as e:
            outcome.channel_error = f"malformed result channel: {e}"
            return
    finally:
        release()
    finals = [h for h, _ in received if h.get("type") == "final"]
    for h, payload in received:
        t = h.get("type")
        if t == "started":
            outcome.started = h
        elif t == "tensor":
            outcome.tensors.append((h, payload))
        elif t != "final":
            outcome.channel_error = f"unexpected frame type {t!r} on the result channel"
    if len(finals) > 1:
        outcome.channel_error = "more than one result on the result channel"
    elif finals:
        if finals[0].get("nonce") != nonce:
            outcome.channel_error = "a result without the job's nonce (forged)"
        else:
            outcome.final = finals[0]
            phases = finals[0].get("phases")
            outcome.phases = {str(k): float(v) for k, v in (phases if isinstance(phases, dict) else {}).items()
                              if isinstance(v, (int, float))}
    outcome.phases.update({f"startup_{k}": v for k, v in frames.startup_s.items()})
