"""What a timed call's close reads of its outputs (`cudagym.sandbox.timing`): the evidence sent to
the parent, and the bookkeeping of one call's reads on both targets (the close kernel's samples on
a GPU, the native CPU close's entries).
"""

from __future__ import annotations

import ctypes
from typing import Any, NamedTuple

import torch

from cudagym.sandbox.timing.gate import Samples

MAX_CPU_DIMS = 64  # dimensions of a strided output the CPU close reads (more: made contiguous first)


class CpuClose(ctypes.Structure):
    """One output of the CPU close (`cpu_close` in opwatch.cpp; sizes and strides in elements;
    `proj`: 4 doubles, `kind`: `PROJECTED_KINDS`, 0 for none; `seed`: written by the close)."""

    _fields_ = [("src", ctypes.c_uint64), ("values", ctypes.c_uint64), ("positions", ctypes.c_uint64),
                ("numel", ctypes.c_int64), ("count", ctypes.c_int64), ("elem_size", ctypes.c_int64),
                ("ndim", ctypes.c_int64), ("sizes", ctypes.c_int64 * MAX_CPU_DIMS),
                ("strides", ctypes.c_int64 * MAX_CPU_DIMS), ("proj", ctypes.c_uint64), ("kind", ctypes.c_int64),
                ("index", ctypes.c_int64), ("seed", ctypes.c_uint64)]


def _ints(shape: Any) -> str:
    """A shape as a JSON list."""
    return "[" + ", ".join(str(int(d)) for d in shape) + "]"


class Evidence(NamedTuple):
    """What `DeviceTimer.read_at_end` read of one output at a call's end."""

    values: torch.Tensor  # the sampled values (all of them, in the output's shape, if positions is None)
    positions: torch.Tensor | None  # their flat (row-major) positions
    projections: torch.Tensor | None  # `PROJECTIONS` float64 sums (`projection`) of the whole output
    seed: int  # the call's secret seed of the positions and weights, drawn after the call returned
    # CPU target: the raw bytes of values, positions and projections (the buffers the close fills),
    # to send without an ATen op between the close and the pipe, and the close's entry (its `seed`)
    raw: tuple[memoryview, memoryview | None, memoryview | None, CpuClose] | None = None

    def cpu_seed(self) -> int:
        """The seed the CPU close drew for this output's call (0 before the close)."""
        return int(self.raw[3].seed) if self.raw is not None else self.seed


class Reading:
    """What the close kernel reads of one call (GPU), gathered by `read_at_end` while `after` runs."""

    def __init__(self, seed: int, projections: torch.Tensor | None) -> None:
        self.samples = Samples(seed=seed)
        self.kept: list[torch.Tensor] = []  # alive until the close kernel has read them
        self.projections = projections  # (MAX_SAMPLED_OUTPUTS, PROJECTIONS), zeroed before the open gate
        self.outputs = 0  # outputs read so far (each one's index in the weights' hash)
        self.dense = 0  # what the close kernel projects: contiguous elements (max(elements, bytes / 4) per output)
        self.strided = 0  # and others
        # GPU: what is copied to host memory right after the close kernel, on its stream (device
        # address, host address, bytes), and the host copy of `projections`
        self.to_host: list[tuple[int, int, int]] = []
        self.host_projections: torch.Tensor | None = None
        # the CPU close's outputs: its native entries (`CpuClose`) and each one's tensor and evidence
        self.cpu: list[tuple[CpuClose, tuple[torch.Tensor, Evidence | None]]] = []
        self._layout: list[str] = []  # what each one is (`layout`)

    def layout(self) -> bytes:
        """What each CPU output of the call is, for the native close's frame (JSON, one item per
        entry, null for one it reads without sampling): its index among the call's outputs, the
        dtype, the sampled values' shape and the output's. Written here, not by a `json` module the
        candidate can rebind (the frame's bytes and stamps are the close's own)."""
        return ("[" + ", ".join(self._layout) + "]").encode()

    def add_cpu(self, t: torch.Tensor, count: int, kind: int) -> Evidence:
        """Register CPU output `t` for the close (`DeviceTimer.call`): `count` values at
        positions drawn by the close (all values, in `t`'s shape, and no positions, if `t` has no
        more than `count` elements), then every element read and (`kind`: `PROJECTED_KINDS`, 0:
        none) projected, into buffers allocated here, before the close; the evidence holds them
        (filled once the close returned) and their raw bytes (sent without an ATen op: nothing
        hooked into torch runs between close and send)."""
        if not t.is_contiguous():  # read through process_vm_readv by the close: a copy, inside the interval
            t = t.contiguous()
        numel = t.numel()
        n = numel if numel <= count else count
        values = torch.empty(n, dtype=t.dtype)
        positions = None if n == numel else torch.empty(n, dtype=torch.int64)
        # kind 0 (a dtype the native close does not project): projected by `DeviceTimer._close_cpu`
        projections = torch.zeros(4, dtype=torch.float64) if count else None
        shape, strides = ((numel,), (1,)) if t.is_contiguous() else (tuple(t.shape), tuple(t.stride()))
        entry = CpuClose(src=t.data_ptr() if numel else 0, values=values.data_ptr(),
                          positions=0 if positions is None else positions.data_ptr(), numel=numel,
                          count=n if count else 0, elem_size=t.element_size(), ndim=len(shape),
                          proj=0 if projections is None else projections.data_ptr(), kind=kind if count else 0,
                          index=self.outputs)
        self.outputs += 1
        if t.is_contiguous():
            self.dense += max(numel, numel * t.element_size() // 4)
        else:
            self.strided += numel
        for d, (size, stride) in enumerate(zip(shape, strides)):
            entry.sizes[d], entry.strides[d] = size, stride
        raw = (values.view(torch.uint8).numpy().data if n else memoryview(b""),
               None if positions is None else positions.view(torch.uint8).numpy().data,
               None if projections is None else projections.view(torch.uint8).numpy().data, entry)
        ev = Evidence(values.view(t.shape) if positions is None else values, positions, projections, 0, raw)
        self.cpu.append((entry, (t, ev if count else None)))  # t: alive until the close has read it
        self._layout.append(f'{{"index": {int(entry.index)}, "dtype": "{str(t.dtype).removeprefix("torch.")}", '
                            f'"shape": {_ints(ev.values.shape)}, "full_shape": {_ints(t.shape)}}}' if count else "null")
        return ev
