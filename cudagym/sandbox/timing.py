"""The timing protocol, run inside a worker, driven by the parent.

The parent decides every call: the worker asks it for the next call (`drive_calls`), and gets
the seed of that call's inputs or the word to stop. Which calls are warm-up and which are timed,
and how many there are, is the parent's decision (`cudagym.sandbox.feed.CallFeed`), made with its
own clock; the worker cannot tell them apart, and neither can the callee. Before every call the
call's input buffers are refilled with values generated from its seed: same pointers, new
contents, so neither pointer- nor content-keyed result caches can replay. Each call's time is
computed as soon as the call is over and goes to the parent with the next request; no record of
past calls stays in the worker.

CUDA: CUDA events on the caller's stream, no profiler. Per call:
1. synchronize the device: the GPU is idle;
2. on the caller's stream: reset persisting L2 lines, then the *open gate* kernel. It runs as
   many 256-thread blocks as the GPU keeps resident at once (every SM full: no other kernel's
   block can run beside them). Its blocks hold their SMs for the launch window
   (`TimingConfig.launch_window_us`), then copy this call's input values from a staging copy
   into the call's input buffers, then flush the L2 cache by reading a buffer twice its size (a
   read leaves clean lines: the call pays for no write-backs). Then the start event;
3. call. The call is launched while the window runs, so the host's work of getting its
   launches to the GPU is hidden up to the window (as launch latency is in Triton's
   `do_bench`, where the flush alone does it). None of its kernels, on any stream, can start
   before the gate ends: the SMs are full. During the window the input buffers still hold an
   earlier call's values, so host work there cannot compute this call's answer (say on the
   CPU, copied in by a copy engine, which the gate does not hold): only work ordered after
   the start event sees the inputs;
4. the *close gate* kernel, on the same stream (the stream the call started on, even if the call
   changed the current stream): the same blocks, which go on only once all of them have been
   resident at once, so once no kernel of the call, on any stream, still holds an SM. While they
   all still hold the SMs they read the call's output samples (`DeviceTimer.read_at_end`: secret
   positions from a seed drawn after the call returned) and project every element of every
   output on secret +-1 weights from the same seed (`projection`), then exit. Then the end
   event. The close kernel is issued after the call returned on the host, so host work that
   ends after the window is timed, and every page of the output is read (a lazily mapped or
   managed one is there) before the end event;
5. synchronize the device, then a last event; the call's time is read.

A call's time is end event less start event, less the close's *read phase* (from its last block's
arrival to its last block's exit, on the device clock: `DeviceTimer.stamps_ns`; at most
`READ_SLACK_NS` more than the calibration's, plus the calibrated time per element projected
beyond the calibration's output, plus `READ_SLACK_REL` of it), less the harness's overhead: that same
interval for a call that launches nothing (its output read by the close as a call's is), the
median of `CALIBRATION_CALLS` calls, measured by each timing job before any candidate code is
loaded (`harness.job_timer`), at most `MAX_OVERHEAD_NS`. So a call that launches nothing reads
0, and a kernel's time holds its own launch on the GPU, as Nsight Compute counts it. Why each
part (H100, 10 fresh processes, `benchmarks/probe_stamps.py`):
- one stream: with the gates on a stream of their own, the two hand-overs between it and the
  caller's stream added 1-2.5 us to a one-kernel call, a different amount for each kernel
  (relu 16x16384 read 4.3 us against Nsight Compute's 3.3, a 32 MB relu 22.2 against 20.2);
- the read phase: it took 9.5-11.2 us, with the outputs' number, size and place (a sum's 16
  values against softmax's 2048 samples), and was the rest of the kernel-to-kernel variation;
  left out, five one-op problems of 2.8-20 us read within 0.8 us of Nsight Compute, and all 14
  one-kernel problems of `benchmarks/bench_baselines.py` within 0.4 us below 10 us, on an H100
  and an H200;
- a call that launches nothing: a probe kernel's interval less its stamped own time left out
  the probe's launch, which Nsight Compute counts as a kernel's: a 4 KB relu read 0.4-0.9 us
  against 2.8.
The read phase's cap bounds what a forged stamp could take off a call.

What the SMs do not show is work on a stream the caller's stream never waits for that is not
running when the close kernel's blocks all become resident: a copy engine's copy, or a kernel
that becomes ready at that moment and loses the race for the SMs to the close kernel (on an
H100, a device-to-device `cudaMemcpyAsync` on such a stream read 0.066 ms where the honest call
read 0.061, and its output was complete when sampled after the end event, as the harness then
did). So the samples are read inside the close kernel, not after it:
- at the close: an output still being written by a copy, or not yet written by a kernel that
  could not start, is read as it is: a mismatch; if the close kernel gives up
  (`CLOSE_TIMEOUT_NS`: something held an SM that long), the call runs to the last event, less
  `TAIL_ALLOWANCE_MS`;
- during the launch window: a copy may run, but the inputs do not yet hold the call's values
  (step 3); only the gate's copy and flush (tens of microseconds) run after they do and before
  the start event.

No profiler, because the CUDA profiler's concurrent-kernel tracing (the way to see kernels on
every stream) instruments kernels: it slowed kernels of many short-lived blocks by 9-12% on an
H200 and left torch's, cuBLAS's and Triton's alone (`benchmarks/probe_ncu_gap.py`), a bias
against honest candidates of a common style.

CPU: the wall clock around the call, after reading a buffer larger than the LLC. The interval
holds the call, then the *CPU close*: `after` (the harness's: it checks the outputs and registers
each with `read_at_end`, which allocates its evidence buffers), then one call into the harness's
own native library (`cudagym_cpu_close` in opwatch.cpp, compiled by the parent, bound by ctypes
before any candidate code loads) that reads every page of every output (every element of a
strided one), draws the sample positions with getrandom() and gathers the values there into
those buffers. The clock stops when it returns. Why in one native call, inside the interval:
before, the positions were drawn after the clock stopped with `torch.randint` and the values
gathered with ATen ops, in the candidate's process; a RecordFunction callback or a Python profile
hook the candidate left behind ran there, and either did the whole call's work untimed (+3 with
nothing computed inside the call) or computed only the 2048 positions it read from randint's
output. Now (1) no code but the harness's native code runs between the draw and the read: no
Python (a ctypes call releases the GIL and makes no profile event), no ATen op, so no callback,
dispatcher kernel or hook of anyone's sees a position before its value is taken; (2) anything a
hook does after the call returns and before the close runs inside the interval, and is timed;
(3) pages a fault handler fills on first read are filled, and timed, in the close. After it the
harness sends the evidence's raw bytes (`Evidence.raw`) with no ATen op, and a Python profile,
trace or monitoring hook found right after the call (`foreign_hooks`) is `TimerTampered`. Left:
a native thread of the candidate's that rewrites the evidence buffers between the close and the
pipe write (it must find them and know the positions: they are in the buffer only after the
close), and native code that edits the interpreter's or torch's state directly.

Evidence (what the parent re-checks, `cudagym.rewards.compare`): each output's samples, their
positions and (GPU) its projections are sent on the pipe before the worker asks for the next
call, so nothing the candidate runs later (its next call, a finalizer, a kernel writing the
worker's page-locked result memory) can change them. The projections make a sample rewritten
before that (by code running beside the harness) worthless without the whole output: the
weights are drawn after the call returned, so an honest output's projections differ from the
reference's by a Rademacher sum of its per-element errors (bounded by the tolerance), and an
output computed only where it was sampled differs by a sum of large ones. Cost per GPU call (H100,
`benchmarks/probe_evidence_cost.py`): 2.6 ps of close kernel per fp32 element (+1.5 us at 1 MB,
+42 us at 64 MB), left out of the reported time; ~40 us of host time per output to send it.

Per-call times are in milliseconds. Statistics are computed by the parent (`TimingStats`).
"""

from __future__ import annotations

import ctypes
import functools
import gc
import os
import secrets
import statistics
import sys
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

import torch


# Part of the baseline cache's key: a change to how calls are timed must not reuse old baselines
# 12: the CPU target's close (page reads, sample draw and reads) is one native call inside the interval;
# 11: the close projects every output (its read phase capped per byte), a CPU call's output pages
# are read inside its interval; 10: one stream, the close's read phase left out, the overhead of a call that launches nothing
# (9: a self-stamping probe, more input sets, placements rotated; 7: outputs sampled by the close
# kernel; 6: a 1 ms window)
PROTOCOL_VERSION = "gated-events-12"

CALIBRATION_CALLS = 100  # calls that launch nothing, which measure the harness's overhead
CALIBRATION_ELEMENTS = 1 << 18  # the fp32 output those calls' close reads (and projects)
# then this many with a contiguous fp32 output of LARGE_CALIBRATION_ELEMENTS, and with a transposed
# one of STRIDED_CALIBRATION_ELEMENTS: the close's time per element projected (H100: 2.6 ps per
# contiguous fp32 element, 2 bytes or 4 alike: the hash and fp64 sums, not the reads, bound it)
LARGE_CALIBRATION_CALLS = 10
LARGE_CALIBRATION_ELEMENTS = 1 << 24
STRIDED_CALIBRATION_ELEMENTS = 1 << 22
READ_SLACK_REL = 0.1  # a call's read phase is left out up to its projections' share of it plus this
# Sizes of the allocation held across each GPU call in turn (`drive_calls`), so that what a call
# allocates (its output) lands at other addresses from one call to the next: a one-op call of a few
# microseconds reads 0.3-0.7 us more or less from one process to the next with its placement
# (H100, `benchmarks/probe_stamps.py`), and a job's median should not hang on one placement.
PLACEMENT_BYTES = (0, 2**18, 2**19, 3 * 2**18, 2**20, 3 * 2**19, 5 * 2**19, 2**22)
MAX_OVERHEAD_NS = 30_000  # the most overhead a timer leaves out: a measurement above it is capped (H100: 4.3 us)
# A call's read phase is left out up to the calibration's plus this (H100: 9.5-11.2 us, calibration 10.6-11.5)
READ_SLACK_NS = 2_000
CLOSE_TIMEOUT_NS = 1_000_000_000  # the close kernel gives up after this long
TAIL_ALLOWANCE_MS = 1.0  # the host's wake-up after the device-wide synchronize, at most (step 5)
GATE_THREADS = 256
SAMPLE_SIZE = 2048  # elements of each output of a call read at its end (`DeviceTimer.read_at_end`; all, if fewer)
MAX_SAMPLED_OUTPUTS = 16  # outputs of one call the close kernel reads (more are read before it)
MAX_SAMPLED_DIMS = 8  # dimensions of a non-contiguous output the close kernel reads (more: made contiguous first)
PROJECTIONS = 4  # secret +-1 projections of every output of a GPU call (`projection`)
# The close kernel's codes of the dtypes it projects (complex: two parts per element; others are
# projected before it, inside the call's interval)
PROJECTED_KINDS = {torch.float32: 1, torch.float64: 2, torch.float16: 3, torch.bfloat16: 4, torch.uint8: 5,
                   torch.bool: 5, torch.int8: 6, torch.int16: 7, torch.int32: 8, torch.int64: 9,
                   torch.complex32: 10, torch.complex64: 11, torch.complex128: 12}

_GATE_SOURCE = r"""
#define THREADS GATE_THREADS
__device__ __forceinline__ unsigned long long now_ns() {
    unsigned long long t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    return t;
}
// gate[0]: blocks of the close kernel that arrived; gate[1]: kept reads; gate[2]: close timeouts;
// gate[3]: blocks of the close kernel that read their share of the samples
extern "C" __global__ void __launch_bounds__(THREADS, BLOCKS_PER_SM)
cudagym_gate_open(const unsigned long long* flush, unsigned int words, unsigned int* gate, unsigned int window_ns,
                  const long long* copies, int n_copies, unsigned long long* stamps) {
    unsigned long long t0 = now_ns();
    if (blockIdx.x == 0 && threadIdx.x == 0) gate[0] = gate[3] = 0u;
    while (now_ns() - t0 < window_ns) {}
    // only now do the call's input buffers take this call's values: copies[3c..3c+2] = src, dst, bytes
    const unsigned long long tid = blockIdx.x * THREADS + threadIdx.x, stride = (unsigned long long)gridDim.x * THREADS;
    for (int c = 0; c < n_copies; ++c) {
        const unsigned char* src = (const unsigned char*)copies[3 * c];
        unsigned char* dst = (unsigned char*)copies[3 * c + 1];
        unsigned long long n = (unsigned long long)copies[3 * c + 2], head = 0ull;
        if ((((unsigned long long)src | (unsigned long long)dst) & 15ull) == 0ull) {
            const uint4* s4 = (const uint4*)src;
            uint4* d4 = (uint4*)dst;
            for (unsigned long long i = tid; i < n / 16; i += stride) d4[i] = s4[i];
            head = n / 16 * 16;
        }
        for (unsigned long long i = head + tid; i < n; i += stride) dst[i] = src[i];
    }
    const volatile unsigned long long* p = flush;
    unsigned long long acc = 0ull;
    for (unsigned long long i = tid; i < words; i += stride) acc ^= p[i];
    if (acc == 0x9e3779b97f4a7c15ull) gate[1] = 1u;  // the buffer is zeros: never, but the reads stay
    __syncthreads();
    if (threadIdx.x == 0) atomicMax(stamps, now_ns());  // stamps[0]: the gate's last block ends
}
// A call's sampled outputs, read by the close kernel (`DeviceTimer.read_at_end`): `count`
// elements of `src` (`numel` elements of `elem_size` bytes, `ndim` sizes and strides, in
// elements) at positions drawn from the close's seed (all of them, in order, if count == numel),
// copied to `values`; the positions to `positions` (if not null).
// `kind` (`PROJECTED_KINDS`; 0: none) and `proj` (4 doubles, zeroed before the open gate): the
// output's projections on secret +-1 weights over every element (see `projection`); `index`: the
// output's place among the call's outputs (in the weights' hash).
struct Sampled {
    unsigned long long src, values, positions, proj;
    long long numel, count, elem_size, ndim, kind, index;
    long long sizes[MAX_DIMS], strides[MAX_DIMS];
};
struct Samples {
    unsigned long long seed;
    long long n;
    Sampled out[MAX_SAMPLED];
};
__device__ __forceinline__ unsigned long long mix64(unsigned long long z) {
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}
__device__ __forceinline__ unsigned int mix32(unsigned int x) {
    x ^= x >> 16; x *= 0x7feb352du; x ^= x >> 15; x *= 0x846ca68bu; x ^= x >> 16;
    return x;
}
// One real component of an element as a double: kinds 1 f32, 2 f64, 3 f16, 4 bf16, 5 u8/bool,
// 6 i8, 7 i16, 8 i32, 9 i64 (complex outputs: their parts' kind, two per element)
__device__ __forceinline__ double component(const volatile unsigned char* p, int kind) {
    switch (kind) {
    case 1: return (double)*(const volatile float*)p;
    case 2: return *(const volatile double*)p;
    case 3: { unsigned short b = *(const volatile unsigned short*)p; float f;
              asm("{ .reg .b16 h; mov.b16 h, %1; cvt.f32.f16 %0, h; }" : "=f"(f) : "h"(b)); return (double)f; }
    case 4: return (double)__uint_as_float((unsigned int)*(const volatile unsigned short*)p << 16);
    case 5: return (double)*(const volatile unsigned char*)p;
    case 6: return (double)*(const volatile signed char*)p;
    case 7: return (double)*(const volatile short*)p;
    case 8: return (double)*(const volatile int*)p;
    default: return (double)*(const volatile long long*)p;
    }
}
// Every element of output `o` (its real components in row-major order, i) times weights +-1
// from bits 0..3 of a hash of (seed, o, i), summed in fp64 into proj[0..3] (`projection` is the
// same on the host). Out of line: its loop then has the registers to itself.
struct Acc { double a0, a1, a2, a3; };
__device__ __forceinline__ void accumulate(double x, unsigned long long i, unsigned int s0, unsigned int s1, Acc& acc) {
    unsigned int h = mix32((unsigned int)i ^ s0);
    if (i >> 32) h = mix32(h ^ (unsigned int)(i >> 32) ^ s1);
    acc.a0 += (h & 1u) ? -x : x;
    acc.a1 += (h & 2u) ? -x : x;
    acc.a2 += (h & 4u) ? -x : x;
    acc.a3 += (h & 8u) ? -x : x;
}
__device__ __noinline__ void add_block(Acc acc, double* proj) {
    for (int k = 16; k > 0; k >>= 1) {
        acc.a0 += __shfl_down_sync(0xffffffffu, acc.a0, k);
        acc.a1 += __shfl_down_sync(0xffffffffu, acc.a1, k);
        acc.a2 += __shfl_down_sync(0xffffffffu, acc.a2, k);
        acc.a3 += __shfl_down_sync(0xffffffffu, acc.a3, k);
    }
    __shared__ double partial[THREADS / 32][4];
    const int warp = threadIdx.x / 32;
    if ((threadIdx.x & 31) == 0) {
        partial[warp][0] = acc.a0; partial[warp][1] = acc.a1; partial[warp][2] = acc.a2; partial[warp][3] = acc.a3;
    }
    __syncthreads();
    if (threadIdx.x < 4) {
        double sum = 0.0;
        for (int w = 0; w < THREADS / 32; ++w) sum += partial[w][threadIdx.x];
        atomicAdd(proj + threadIdx.x, sum);
    }
    __syncthreads();
}
template <int KIND, typename T>
__device__ __noinline__ void project_dense(const T* src, unsigned long long n, unsigned int s0, unsigned int s1, double* proj) {
    const volatile T* p = (const volatile T*)src;
    const unsigned long long stride = (unsigned long long)gridDim.x * THREADS;
    Acc acc = {0.0, 0.0, 0.0, 0.0};
    for (unsigned long long i = blockIdx.x * THREADS + threadIdx.x; i < n; i += stride)
        accumulate(component((const volatile unsigned char*)(p + i), KIND), i, s0, s1, acc);
    add_block(acc, proj);
}
__device__ __noinline__ void project_strided(const Sampled& s, unsigned int s0, unsigned int s1) {
    // complex: two parts of kind 3 (complex32), 1 (complex64) or 2 (complex128) per element
    const int parts = s.kind >= 10 ? 2 : 1, kind = s.kind == 10 ? 3 : s.kind == 11 ? 1 : s.kind == 12 ? 2 : (int)s.kind;
    const long long part_size = s.elem_size / parts;
    const unsigned long long n = (unsigned long long)s.numel * parts, stride = (unsigned long long)gridDim.x * THREADS;
    Acc acc = {0.0, 0.0, 0.0, 0.0};
    for (unsigned long long i = blockIdx.x * THREADS + threadIdx.x; i < n; i += stride) {
        long long off = 0, rest = (long long)(parts == 2 ? i >> 1 : i);
        for (int d = (int)s.ndim - 1; d >= 0; --d) {
            off += (rest % s.sizes[d]) * s.strides[d];
            rest /= s.sizes[d];
        }
        accumulate(component((const volatile unsigned char*)s.src + off * s.elem_size + (i & (parts - 1)) * part_size, kind),
                   i, s0, s1, acc);
    }
    add_block(acc, (double*)s.proj);
}
__device__ void project(const Sampled& s, unsigned int o, unsigned long long seed) {
    const unsigned int s0 = (unsigned int)seed ^ mix32(2u * o + 1u), s1 = (unsigned int)(seed >> 32) ^ mix32(2u * o + 2u);
    if (!(s.ndim == 1 && s.strides[0] == 1)) { project_strided(s, s0, s1); return; }
    double* proj = (double*)s.proj;
    const unsigned long long n = (unsigned long long)s.numel;  // contiguous: no index arithmetic
    switch (s.kind) {
    case 1: project_dense<1>((const float*)s.src, n, s0, s1, proj); break;
    case 2: project_dense<2>((const double*)s.src, n, s0, s1, proj); break;
    case 3: project_dense<3>((const unsigned short*)s.src, n, s0, s1, proj); break;
    case 4: project_dense<4>((const unsigned short*)s.src, n, s0, s1, proj); break;
    case 5: project_dense<5>((const unsigned char*)s.src, n, s0, s1, proj); break;
    case 6: project_dense<6>((const signed char*)s.src, n, s0, s1, proj); break;
    case 7: project_dense<7>((const short*)s.src, n, s0, s1, proj); break;
    case 8: project_dense<8>((const int*)s.src, n, s0, s1, proj); break;
    case 9: project_dense<9>((const long long*)s.src, n, s0, s1, proj); break;
    case 10: project_dense<3>((const unsigned short*)s.src, 2 * n, s0, s1, proj); break;  // complex: parts in a row
    case 11: project_dense<1>((const float*)s.src, 2 * n, s0, s1, proj); break;
    default: project_dense<2>((const double*)s.src, 2 * n, s0, s1, proj); break;
    }
}
extern "C" __global__ void __launch_bounds__(THREADS, BLOCKS_PER_SM)
cudagym_gate_close(unsigned int* gate, unsigned int blocks, unsigned int timeout_ns, unsigned long long* stamps,
                   const __grid_constant__ Samples samples) {
    __shared__ int gave_up;
    if (threadIdx.x == 0) {
        gave_up = 0;
        unsigned long long t0 = now_ns();
        atomicMax(stamps + 1, ~t0);  // stamps[1]: ~ the first block's arrival; stamps[2]: the last's
        atomicMax(stamps + 2, t0);
        atomicAdd(gate, 1u);
        volatile unsigned int* arrived = gate;
        while (*arrived < blocks) {
            if (now_ns() - t0 > timeout_ns) { atomicAdd(gate + 2, 1u); gave_up = 1; break; }
        }
    }
    __syncthreads();
    if (samples.n == 0) {
        if (threadIdx.x == 0) atomicMax(stamps + 3, now_ns());
        return;
    }
    // Every block is resident: no other kernel holds an SM, and none can start before the last
    // block below has read its share. What the call left unwritten now stays unwritten here.
    const unsigned long long tid = blockIdx.x * THREADS + threadIdx.x, stride = (unsigned long long)gridDim.x * THREADS;
    for (int o = 0; o < (int)samples.n; ++o) {
        const Sampled& s = samples.out[o];
        for (unsigned long long i = tid; i < (unsigned long long)s.count; i += stride) {
            long long flat = (long long)i;
            if (s.count != s.numel)
                flat = (long long)((mix64(samples.seed + 0x9e3779b97f4a7c15ull * ((unsigned long long)o << 32 | i)) >> 11)
                                   % (unsigned long long)s.numel);
            long long off = 0, rest = flat;
            for (int d = (int)s.ndim - 1; d >= 0; --d) {
                off += (rest % s.sizes[d]) * s.strides[d];
                rest /= s.sizes[d];
            }
            const volatile unsigned char* from = (const volatile unsigned char*)s.src + off * s.elem_size;
            unsigned char* to = (unsigned char*)s.values + i * s.elem_size;
            for (int b = 0; b < (int)s.elem_size; ++b) to[b] = from[b];
            if (s.positions) ((long long*)s.positions)[i] = flat;
        }
    }
    for (int o = 0; o < (int)samples.n; ++o)
        if (samples.out[o].proj) project(samples.out[o], (unsigned int)samples.out[o].index, samples.seed);
    __threadfence();
    __syncthreads();
    if (threadIdx.x == 0) {
        unsigned long long t0 = now_ns();
        atomicAdd(gate + 3, 1u);
        volatile unsigned int* read = gate + 3;
        while (!gave_up && *read < blocks) {
            if (now_ns() - t0 > timeout_ns) break;
        }
        atomicMax(stamps + 3, now_ns());  // stamps[3]: the last block leaves
    }
    __syncthreads();
}
"""


def gate_source(blocks_per_sm: int) -> str:
    """The gate kernels' CUDA source for GPUs that keep `blocks_per_sm` of their blocks resident."""
    return (_GATE_SOURCE.replace("GATE_THREADS", str(GATE_THREADS)).replace("BLOCKS_PER_SM", str(blocks_per_sm))
            .replace("MAX_SAMPLED", str(MAX_SAMPLED_OUTPUTS)).replace("MAX_DIMS", str(MAX_SAMPLED_DIMS)))


class _Sampled(ctypes.Structure):
    """The close kernel's `Sampled` (one output it reads; see the source above)."""

    _fields_ = [("src", ctypes.c_uint64), ("values", ctypes.c_uint64), ("positions", ctypes.c_uint64),
                ("proj", ctypes.c_uint64), ("numel", ctypes.c_int64), ("count", ctypes.c_int64),
                ("elem_size", ctypes.c_int64), ("ndim", ctypes.c_int64), ("kind", ctypes.c_int64),
                ("index", ctypes.c_int64),
                ("sizes", ctypes.c_int64 * MAX_SAMPLED_DIMS),
                ("strides", ctypes.c_int64 * MAX_SAMPLED_DIMS)]


class _Samples(ctypes.Structure):
    """The close kernel's `Samples`, passed by value: no copy to the GPU inside the timed interval."""

    _fields_ = [("seed", ctypes.c_uint64), ("n", ctypes.c_int64), ("out", _Sampled * MAX_SAMPLED_OUTPUTS)]


class Gate(NamedTuple):
    """The gate kernels of one GPU and their launch shape."""

    open: Any  # torch's NVRTC kernel handles
    close: Any
    blocks: int  # the whole grid, resident at once
    holds_every_sm: bool  # False: a GPU where the blocks cannot fill every SM's thread slots


@functools.cache
def gate_kernels(index: int) -> Gate:
    """Compile (NVRTC) and load the gate kernels for GPU `index` (once per process)."""
    from torch.cuda._utils import _cuda_load_module, _get_gpu_runtime_library, _nvrtc_compile

    props = torch.cuda.get_device_properties(index)
    per_sm = max(1, props.max_threads_per_multi_processor // GATE_THREADS)
    with torch.cuda.device(index):
        ptx, _ = _nvrtc_compile(gate_source(per_sm), "cudagym_gate_open")
        kernels = _cuda_load_module(ptx, ["cudagym_gate_open", "cudagym_gate_close"])
        resident = ctypes.c_int(0)
        libcuda = _get_gpu_runtime_library()
        for k in (kernels["cudagym_gate_open"], kernels["cudagym_gate_close"]):
            libcuda.cuOccupancyMaxActiveBlocksPerMultiprocessor(ctypes.byref(resident), k.func, GATE_THREADS, 0)
            per_sm = min(per_sm, resident.value)
    per_sm = max(per_sm, 1)
    return Gate(kernels["cudagym_gate_open"], kernels["cudagym_gate_close"], per_sm * props.multi_processor_count,
                per_sm * GATE_THREADS >= props.max_threads_per_multi_processor)


def _cuda_driver() -> Any:
    """The CUDA driver library, as torch loaded it."""
    from torch.cuda._utils import _get_gpu_runtime_library

    return _get_gpu_runtime_library()


def _cudart() -> Any | None:
    import glob

    roots = [os.path.dirname(torch.__file__)]
    try:
        import nvidia  # type: ignore[import-not-found]

        roots += list(nvidia.__path__)
    except ImportError:
        pass
    for root in roots:
        for path in glob.glob(os.path.join(root, "**", "libcudart.so*"), recursive=True):
            try:
                return ctypes.CDLL(path)
            except OSError:
                continue
    for name in ("libcudart.so", "libcudart.so.13", "libcudart.so.12"):
        try:
            return ctypes.CDLL(name)
        except OSError:
            continue
    return None


_M32 = 0xFFFFFFFF
_PROJECTION_CHUNK = 1 << 22  # elements per step of `projection`


def _mul32(x: Any, c: int) -> Any:
    """x * c mod 2**32 for x in [0, 2**32) (ints or int64 tensors: no product passes 2**49)."""
    return (x * (c & 0xFFFF) + (((x * (c >> 16)) & 0xFFFF) << 16)) & _M32


def _mix32(x: Any) -> Any:
    """The close kernel's `mix32` (a 32-bit integer hash), on ints or int64 tensors."""
    x = x ^ (x >> 16)
    x = _mul32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = _mul32(x, 0x846CA68B)
    return x ^ (x >> 16)


def projection(t: torch.Tensor, seed: int, index: int) -> torch.Tensor:
    """Output `index` of a call projected as the close kernel projects it (float64, on `t`'s
    device): `PROJECTIONS` sums over every real component x_i of `t` (row-major; a complex
    element's real then imaginary part) of w_ki * x_i, with w_ki = +1 or -1 from bit k of a hash
    of (`seed`, `index`, i); then sum |x_i| and sum x_i^2 over the finite components, and the
    number of components that are not finite (the parent's bound on honest differences,
    `cudagym.rewards.compare.projection_mismatch`, uses these three).

    Weights drawn after the call returned are independent of an honest kernel's rounding, so
    its projections differ from the reference's by a Rademacher sum of its per-element errors;
    an output not computed in full differs by a sum of unbounded ones."""
    x = torch.view_as_real(t.detach()) if t.is_complex() else t.detach()
    x = x.reshape(-1)
    s0 = (seed & _M32) ^ _mix32(2 * index + 1)
    s1 = ((seed >> 32) & _M32) ^ _mix32(2 * index + 2)
    sums = torch.zeros(PROJECTIONS + 3, dtype=torch.float64, device=t.device)
    for lo in range(0, x.numel(), _PROJECTION_CHUNK):
        part = x[lo:lo + _PROJECTION_CHUNK].to(torch.float64)
        i = torch.arange(lo, lo + part.numel(), dtype=torch.int64, device=t.device)
        h = _mix32((i & _M32) ^ s0)
        if lo + part.numel() > 1 << 32:
            h = torch.where(i >> 32 != 0, _mix32(h ^ (i >> 32) ^ s1), h)
        for k in range(PROJECTIONS):
            sums[k] += torch.where((h >> k) & 1 == 1, -part, part).sum()
        finite = torch.isfinite(part)
        kept = torch.where(finite, part, 0.0)
        sums[PROJECTIONS] += kept.abs().sum()
        sums[PROJECTIONS + 1] += (kept * kept).sum()
        sums[PROJECTIONS + 2] += (~finite).sum()
    return sums


def touch_pages(out: Any) -> None:
    """Read every page of each CPU tensor in `out` (a tensor, or a list or tuple of them), with
    torch: the CPU close of a timer without the harness's native close (tools, tests; a worker's
    timer has it), inside the call's interval, so that an output whose pages are filled when
    first read (a fault handler, a lazy mapping) is filled, and timed, there. A contiguous
    tensor is read one byte per 4 KB; any other tensor, in full."""
    for t in out if isinstance(out, (list, tuple)) else (out,):
        if type(t) is not torch.Tensor or t.is_cuda or t.is_sparse or t.numel() == 0 or t.device.type == "meta":
            continue
        if t.is_contiguous():
            raw = t.detach().reshape(-1).view(torch.uint8)
            _ = int(raw[::4096].sum()) + int(raw[-1])
        else:
            t.detach().abs().sum() if not t.is_complex() else torch.view_as_real(t.detach()).abs().sum()


MAX_CPU_DIMS = 64  # dimensions of a strided output the CPU close reads (more: made contiguous first)


class _CpuClose(ctypes.Structure):
    """One output of the CPU close (`cpu_close` in opwatch.cpp; sizes and strides in elements)."""

    _fields_ = [("src", ctypes.c_uint64), ("values", ctypes.c_uint64), ("positions", ctypes.c_uint64),
                ("numel", ctypes.c_int64), ("count", ctypes.c_int64), ("elem_size", ctypes.c_int64),
                ("ndim", ctypes.c_int64), ("sizes", ctypes.c_int64 * MAX_CPU_DIMS),
                ("strides", ctypes.c_int64 * MAX_CPU_DIMS)]


_NATIVE_CLOSE: list[Any] = []  # the harness's `cudagym_cpu_close` (`use_native_close`), for CPU timers made after


def use_native_close(fn: Any) -> None:
    """CPU timers made from now on close their calls with `fn` (the harness's own native
    `cudagym_cpu_close` from opwatch.cpp, through ctypes: `OpWatch.cpu_close`)."""
    _NATIVE_CLOSE[:] = [fn]


class TimerTampered(Exception):
    """Something the candidate set up would run between a call's close and its evidence's send."""


def foreign_hooks() -> str:
    """The Python hooks that run code of someone else's at the harness's next Python call or
    line, on this thread or (`threading`) on threads started later: profile and trace functions,
    and (Python 3.12+) `sys.monitoring` callbacks of any tool. The harness sets none, so any is
    the candidate's (names joined; "" for none)."""
    found = [name for name, hook in (("sys.setprofile", sys.getprofile()), ("sys.settrace", sys.gettrace()),
                                     ("threading.setprofile", getattr(threading, "_profile_hook", None)),
                                     ("threading.settrace", getattr(threading, "_trace_hook", None)))
             if hook is not None]
    monitoring = getattr(sys, "monitoring", None)
    if monitoring is not None:
        found += [f"sys.monitoring tool {i} ({monitoring.get_tool(i)})" for i in range(6) if monitoring.get_tool(i)]
    return ", ".join(found)


class Evidence(NamedTuple):
    """What `DeviceTimer.read_at_end` read of one output at a call's end."""

    values: torch.Tensor  # the sampled values (all of them, in the output's shape, if positions is None)
    positions: torch.Tensor | None  # their flat (row-major) positions
    projections: torch.Tensor | None  # GPU: `PROJECTIONS` float64 sums (`projection`); None on the CPU target
    seed: int  # the call's secret seed of the positions and weights, drawn after the call returned
    # CPU target: the raw bytes of values and positions (the buffers the close fills), to send
    # without an ATen op between the close and the pipe
    raw: tuple[memoryview, memoryview | None] | None = None


class _Reading:
    """What the close kernel reads of one call (GPU), gathered by `read_at_end` while `after` runs."""

    def __init__(self, seed: int, projections: torch.Tensor | None):
        self.samples = _Samples(seed=seed)
        self.kept: list[torch.Tensor] = []  # alive until the close kernel has read them
        self.projections = projections  # (MAX_SAMPLED_OUTPUTS, PROJECTIONS), zeroed before the open gate
        self.outputs = 0  # outputs read so far (each one's index in the weights' hash)
        self.dense = 0  # what the close kernel projects: contiguous elements (max(elements, bytes / 4) per output)
        self.strided = 0  # and others
        # the CPU close's outputs: its native entries (`_CpuClose`) and each one's tensor and evidence
        self.cpu: list[tuple[_CpuClose, tuple[torch.Tensor, Evidence | None]]] = []

    def add_cpu(self, t: torch.Tensor, count: int) -> Evidence:
        """Register CPU output `t` for the close (`DeviceTimer.call`): its pages are read, then
        `count` values at positions drawn by the close (all values, in `t`'s shape, and no
        positions, if `t` has no more than `count` elements) are gathered into buffers allocated
        here, before the close; the evidence holds them (filled once `call` returns) and their raw
        bytes (sent without an ATen op: nothing hooked into torch runs between close and send)."""
        if t.dim() > MAX_CPU_DIMS and not t.is_contiguous():
            t = t.contiguous()
        numel = t.numel()
        n = numel if numel <= count else count
        values = torch.empty(n, dtype=t.dtype)
        positions = None if n == numel else torch.empty(n, dtype=torch.int64)
        shape, strides = ((numel,), (1,)) if t.is_contiguous() else (tuple(t.shape), tuple(t.stride()))
        entry = _CpuClose(src=t.data_ptr() if numel else 0, values=values.data_ptr(),
                          positions=0 if positions is None else positions.data_ptr(), numel=numel,
                          count=n if count else 0, elem_size=t.element_size(), ndim=len(shape))
        for d, (size, stride) in enumerate(zip(shape, strides)):
            entry.sizes[d], entry.strides[d] = size, stride
        raw = (memoryview(values.view(torch.uint8).numpy()) if n else memoryview(b""),
               None if positions is None else memoryview(positions.view(torch.uint8).numpy()))
        ev = Evidence(values.view(t.shape) if positions is None else values, positions, None, 0, raw)
        self.cpu.append((entry, (t, ev if count else None)))  # t: alive until the close has read it
        return ev


class Calibration(NamedTuple):
    """What a timer leaves out of each GPU call (`DeviceTimer.calibrate`)."""

    overhead_ns: int  # the interval of a call that launches nothing, less its read phase
    read_cap_ns: int  # the most of a call's own read phase left out of it (0: none is)
    # the cap's growth per element projected beyond CALIBRATION_ELEMENTS, contiguous (counted as
    # max(elements, bytes / 4)) and not (ps)
    read_ps_per_element: float = 0.0
    read_ps_per_strided_element: float = 0.0

    @classmethod
    def measured(cls, overhead_ns: float, read_ns: float, per_element_ps: float = 0.0,
                 per_strided_element_ps: float = 0.0) -> Calibration:
        """From a calibration's medians: the overhead, at most `MAX_OVERHEAD_NS`; the read
        phase, plus `READ_SLACK_NS`, as the cap; the cap's growth per projected element, plus
        `READ_SLACK_REL`."""
        return cls(min(max(int(overhead_ns), 0), MAX_OVERHEAD_NS), max(int(read_ns), 0) + READ_SLACK_NS,
                   max(float(per_element_ps), 0.0) * (1 + READ_SLACK_REL),
                   max(float(per_strided_element_ps), 0.0) * (1 + READ_SLACK_REL))

    def left_out_ns(self, read_ns: int, dense: int = 0, strided: int = 0) -> int:
        """What is left out of a call whose close took `read_ns` to read its outputs and to
        project `dense` contiguous elements (max(elements, bytes / 4) of each) and `strided`
        others."""
        grown = self.read_ps_per_element * max(dense - CALIBRATION_ELEMENTS, 0) + self.read_ps_per_strided_element * strided
        return self.overhead_ns + min(max(read_ns, 0), self.read_cap_ns + int(grown / 1000))


class DeviceTimer:
    """Times calls on `device` (cuda:N or cpu) under the protocol above.

    `call(fn, args)` makes one call and returns its output and its time in ms. `calibration`
    is left out of every CUDA call (None: `harness_calibration()`). `close_timeouts()` counts the
    calls so far whose close kernel gave up.
    """

    def __init__(self, device: torch.device, flush_l2: bool = True, launch_window_us: float = 1000.0,
                 calibration: Calibration | None = None, native_close: Any = None):
        self.device = device
        # the CPU close (`_close_cpu`): the harness's native one (a worker's timer always has it)
        self._native_close = None if device.type == "cuda" else native_close or (_NATIVE_CLOSE[0] if _NATIVE_CLOSE else None)
        self.cuda = device.type == "cuda"
        self._sync = torch.cuda.synchronize if self.cuda else (lambda: None)
        self._perf = time.perf_counter
        if self.cuda:
            l2 = getattr(torch.cuda.get_device_properties(device), "L2_cache_size", 50 * 2**20) or 50 * 2**20
            flush_bytes = max(2 * l2, 64 * 2**20)
            self._cudart = _cudart()
            gate = gate_kernels(device.index if device.index is not None else torch.cuda.current_device())
            self._open, self._close, self._blocks = gate.open, gate.close, gate.blocks
            self._grid, self._block = (gate.blocks, 1, 1), (GATE_THREADS, 1, 1)
            self.holds_every_sm = gate.holds_every_sm
            self._gate = torch.zeros(4, dtype=torch.int32, device=device)
            # the gate kernels' %globaltimer stamps of the last call (ns; see the source)
            self._stamps = torch.zeros(4, dtype=torch.int64, device=device)
            self._libcuda = _cuda_driver()
            self._window_ns = int(launch_window_us * 1e3)
            if calibration is None:
                calibration = harness_calibration()
        else:
            flush_bytes = 64 * 2**20
            self._cudart = None
        self.calibration = calibration or Calibration(0, 0)
        self.window_ms = launch_window_us / 1e3 if self.cuda else 0.0
        # the host's time from the open kernel's launch to the close kernel's (the CPU target: the
        # call's): past `window_ms`, the call's time holds host work (diagnostic, last call only)
        self.host_ms: float | None = None
        self._flush_buf = torch.zeros(flush_bytes // 8, dtype=torch.int64, device=device) if flush_l2 else None
        # while `call`'s `after` runs: what the close kernel will read, and the tensors it reads
        self._reading: _Reading | None = None

    def flush(self) -> None:
        """The CPU target's cache flush (on a GPU, the open gate kernel reads the buffer)."""
        if self._flush_buf is not None:
            torch.sum(self._flush_buf)

    def stages(self, arg: Any) -> bool:
        """Whether the open gate can give `arg` its values (a contiguous tensor on the GPU)."""
        return self.cuda and isinstance(arg, torch.Tensor) and arg.is_cuda and arg.is_contiguous() and arg.numel() > 0

    def copy_plan(self, pairs: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor | None:
        """The open gate's copies (source, destination: tensors of the same size, see `stages`),
        for `call`'s `copies`; None for none."""
        rows = []
        for src, dst in pairs:
            if not (self.stages(src) and self.stages(dst)) or src.nbytes != dst.nbytes:
                raise ValueError("the open gate copies between contiguous GPU tensors of one size")
            rows += [src.data_ptr(), dst.data_ptr(), dst.nbytes]
        return torch.tensor(rows, dtype=torch.int64, device=self.device) if rows else None

    def call(self, fn: Callable[..., Any], args: Sequence[Any],
             after: Callable[[Any], None] | None = None, copies: torch.Tensor | None = None) -> tuple[Any, float]:
        """One call under the protocol; returns its output and its time in ms. `after(out)` runs
        once the call has returned, to register its outputs with `read_at_end`, inside the
        interval on both targets (on a GPU: on the timer's stream, before the close kernel, which
        reads them; on the CPU: before the native close, which reads them; see the module's text).
        `copies` (`copy_plan`; GPU): what the open gate copies at the window's end, before the
        start event. CPU: raises `TimerTampered` after the interval if a Python hook that is not
        the harness's was active when the call returned."""
        if not self.cuda:
            # The CPU close (see `cpu_close`): `after` (which registers outputs with `read_at_end`),
            # then one native call that reads every page, draws the positions and gathers the
            # values, all inside the interval. Nothing the candidate hooks into Python or ATen
            # can run between the draw and the read, and what it runs before the draw is timed.
            self.flush()
            reading = _Reading(0, None)
            t0 = self._perf()
            out = fn(*args)
            hooks = foreign_hooks()  # read inside the interval: a hook found here is never trusted
            self._reading = reading
            try:
                if after is not None:
                    after(out)
                else:
                    for t in out if isinstance(out, (list, tuple)) else (out,):
                        if type(t) is torch.Tensor and t.device.type == "cpu" and t.layout == torch.strided:
                            reading.add_cpu(t, 0)  # read every page, sample none
            finally:
                self._reading = None
            failed = self._close_cpu(reading)
            ms = self.host_ms = (self._perf() - t0) * 1e3
            if failed:
                raise RuntimeError("the timer's CPU close failed (getrandom)")
            if hooks:
                raise TimerTampered(f"a Python hook the harness did not set was active after the call: {hooks}")
            return out, ms
        # one stream for the gates, the events and the call (see the module's text): the caller's
        stream = torch.cuda.current_stream(self.device)
        marks = tuple(torch.cuda.Event(enable_timing=True) for _ in range(3))
        flush, words = (self._flush_buf, self._flush_buf.numel()) if self._flush_buf is not None else (self._gate, 0)
        self._sync()
        if self._cudart is not None:
            self._cudart.cudaCtxResetPersistingL2Cache()
        plan, n_copies = (copies, copies.numel() // 3) if copies is not None else (self._gate, 0)
        self._stamps.zero_()
        # the close kernel adds each output's projections here (zeroed now: no kernel of the harness's between call and close)
        projections = (torch.zeros(MAX_SAMPLED_OUTPUTS, PROJECTIONS, dtype=torch.float64, device=self.device)
                       if after is not None else None)
        self._open(self._grid, self._block, [flush, words, self._gate, self._window_ns, plan, n_copies, self._stamps],
                   stream=stream)
        opened = self._perf()
        marks[0].record(stream)
        out = fn(*args)
        reading = _Reading(_randbits(64), projections)  # the seed is drawn after the call returned
        with torch.cuda.stream(stream):  # the call may have left another stream current
            if after is not None:
                self._reading = reading
                try:
                    after(out)
                finally:
                    self._reading = None
            self._launch_close(reading.samples, stream)
            self.host_ms = (self._perf() - opened) * 1e3
            marks[1].record(stream)
        self._sync()
        reading.kept.clear()
        marks[2].record(stream)
        marks[2].synchronize()
        read_ns = self.read_phase_ns if self.calibration.read_cap_ns else 0
        return out, call_ms(marks[0].elapsed_time(marks[1]), marks[0].elapsed_time(marks[2]),
                            self.calibration.left_out_ns(read_ns, reading.dense, reading.strided))

    @property
    def stamps_ns(self) -> tuple[int, int, int, int]:
        """The last call's device-clock stamps (ns; GPU): the open gate's end, the close gate's
        first and last block arriving and its last block leaving."""
        s = self._stamps.tolist()
        return (s[0], ~s[1] & (2**64 - 1), s[2], s[3])

    @property
    def read_phase_ns(self) -> int:
        """The last call's read phase: the close gate's last block's exit less its last arrival (ns; GPU)."""
        _, _, last, leave = self.stamps_ns
        return leave - last  # (`Calibration.left_out_ns` bounds it)

    def read_at_end(self, t: torch.Tensor, count: int = SAMPLE_SIZE) -> Evidence:
        """`count` values of `t` at secret random flat (row-major) positions, and the positions;
        or, if `t` has no more than `count` elements, all its values in its shape, and None; on
        a GPU, with `t`'s projections (`projection`: over every element, with weights from the
        same seed).

        On a GPU, from `call`'s `after`: the close kernel reads them once it holds every SM, so
        nothing the call launched, on any stream, can still be writing `t` (a copy engine's copy
        is read half done) or start writing it before they are read; the positions and weights
        come from a seed drawn after the call returned. The tensors hold them once `call`
        returns. Elsewhere, and for outputs past `MAX_SAMPLED_OUTPUTS` in one call or of a dtype
        the close kernel does not project, they are read at once (on a GPU, still inside the
        call's interval).

        On the CPU target, from `call`'s `after`: registers `t` for the CPU close, which draws the
        positions and reads the values in one native call inside the interval; the evidence's
        tensors (and `raw` bytes) hold them once `call` returns (`_Reading.add_cpu`). Outside a
        call, read at once with torch."""
        reading = self._reading
        if reading is not None and not self.cuda:
            return reading.add_cpu(t, count)
        t = t.detach()
        everything = t.numel() <= count
        seed = reading.samples.seed if reading is not None else _randbits(64)
        index = reading.outputs if reading is not None else 0
        if reading is not None:
            reading.outputs += 1
        kind = PROJECTED_KINDS.get(t.dtype, 0)
        if (reading is None or not t.is_cuda or t.numel() == 0 or reading.samples.n >= MAX_SAMPLED_OUTPUTS
                or kind == 0 or reading.projections is None):
            projections = projection(t, seed, index)[:PROJECTIONS] if t.is_cuda else None
            if everything:
                return Evidence(t.clone(), None, projections, seed)
            gen = torch.Generator(device=t.device).manual_seed(seed & (2**62 - 1))
            idx = torch.randint(t.numel(), (count,), device=t.device, generator=gen)
            return Evidence(t.reshape(-1)[idx], idx, projections, seed)
        samples = reading.samples
        if t.dim() > MAX_SAMPLED_DIMS and not t.is_contiguous():
            t = t.contiguous()
        n = t.numel() if everything else count
        values = torch.empty(n, dtype=t.dtype, device=t.device)
        positions = None if everything else torch.empty(n, dtype=torch.int64, device=t.device)
        shape, strides = ([t.numel()], [1]) if t.is_contiguous() else (list(t.shape), list(t.stride()))
        projections = reading.projections[samples.n]
        s = samples.out[samples.n]
        s.src, s.values, s.positions = t.data_ptr(), values.data_ptr(), 0 if positions is None else positions.data_ptr()
        s.proj, s.kind, s.index = projections.data_ptr(), kind, index
        s.numel, s.count, s.elem_size, s.ndim = t.numel(), n, t.element_size(), len(shape)
        for d, (size, stride) in enumerate(zip(shape, strides)):
            s.sizes[d], s.strides[d] = size, stride
        samples.n += 1
        if t.is_contiguous():
            reading.dense += max(t.numel(), t.numel() * t.element_size() // 4)
        else:
            reading.strided += t.numel()
        reading.kept.append(t)  # alive until the close kernel has read it
        return Evidence(values.view(t.shape) if everything else values, positions, projections, seed)

    def _close_cpu(self, reading: _Reading) -> int:
        """The CPU close of `reading`'s outputs: the harness's native `cpu_close` where the timer
        has it (every worker's timer), else the same steps in torch (tests and tools only: its
        draw and reads are ATen ops, which a candidate's RecordFunction callback sees)."""
        entries = reading.cpu
        if self._native_close is not None:
            array = (_CpuClose * max(len(entries), 1))(*(e for e, _ in entries))
            return int(self._native_close(ctypes.addressof(array), len(entries)))
        for entry, (t, ev) in entries:
            touch_pages(t)
            if ev is None or entry.count == 0:
                continue
            flat = t.reshape(-1)
            if ev.positions is None:
                ev.values.copy_(t)
            else:
                gen = torch.Generator().manual_seed(_randbits(62))
                ev.positions.copy_(torch.randint(t.numel(), (entry.count,), generator=gen))
                ev.values.copy_(flat[ev.positions])
        return 0

    def _launch_close(self, samples: _Samples, stream: torch.cuda.Stream) -> None:
        """The close kernel on `stream` (launched here: torch's kernel handles pass no structs
        by value)."""
        params = (ctypes.c_void_p(self._gate.data_ptr()), ctypes.c_uint(self._blocks), ctypes.c_uint(CLOSE_TIMEOUT_NS),
                  ctypes.c_void_p(self._stamps.data_ptr()), samples)
        pointers = (ctypes.c_void_p * len(params))(*(ctypes.cast(ctypes.byref(p), ctypes.c_void_p) for p in params))
        err = self._libcuda.cuLaunchKernel(self._close.func, self._blocks, 1, 1, GATE_THREADS, 1, 1, 0,
                                           stream._as_parameter_, pointers, None)
        if err:
            raise RuntimeError(f"the timer's close kernel failed to launch: CUDA driver error {err}")

    def calibrate(self, calls: int | None = None) -> Calibration:
        """Measure this timer's overhead and leave it out of its calls from now on; returns it.

        The median over `calls` (default `CALIBRATION_CALLS`) calls that launch nothing, an output
        read at the call's end as a call's is, through this timer's gate, flush and window, of the
        call's interval less its read phase: capped at `MAX_OVERHEAD_NS`; the read phase's median
        plus `READ_SLACK_NS` caps what is left out of a call for its own. Then
        `LARGE_CALIBRATION_CALLS` such calls with a contiguous output of `LARGE_CALIBRATION_ELEMENTS`
        and as many with a transposed one of `STRIDED_CALIBRATION_ELEMENTS`: the read phase's
        growth per element projected (plus `READ_SLACK_REL`) raises that cap for a call with
        larger outputs. Run it before any candidate code loads. The CPU target has none."""
        if not self.cuda:
            self.calibration = Calibration(0, 0)
            return self.calibration
        output = torch.zeros(CALIBRATION_ELEMENTS, device=self.device)  # read at each call's end as a call's output is

        def read(_: Any) -> None:
            self.read_at_end(output)

        self.calibration = Calibration(0, 0)
        for _ in range(5):
            self.call(lambda: None, [], read)
        timed = []
        for _ in range(CALIBRATION_CALLS if calls is None else calls):
            ms = self.call(lambda: None, [], read)[1]
            read_ns = self.read_phase_ns
            timed.append((ms * 1e6 - read_ns, read_ns, self.host_ms or 0.0))
        # a call the host launched after the window's end holds that lateness: not the timer's own
        on_time = [t for t in timed if t[2] <= self.window_ms] or timed
        read_ns = statistics.median(t[1] for t in on_time)

        def read_phase(t: torch.Tensor) -> float:
            phases = []
            for _ in range(LARGE_CALIBRATION_CALLS):
                self.call(lambda: None, [], lambda _: self.read_at_end(t))
                phases.append(self.read_phase_ns)
            return statistics.median(phases)

        dense = read_phase(torch.zeros(LARGE_CALIBRATION_ELEMENTS, device=self.device))
        side = int(STRIDED_CALIBRATION_ELEMENTS ** 0.5)
        strided = read_phase(torch.zeros(side, side, device=self.device).t())
        self.calibration = Calibration.measured(
            statistics.median(t[0] for t in on_time), read_ns,
            (dense - read_ns) * 1000 / (LARGE_CALIBRATION_ELEMENTS - CALIBRATION_ELEMENTS),
            (strided - read_ns) * 1000 / (side * side))
        return self.calibration

    def close_timeouts(self) -> int:
        """Calls so far whose close kernel gave up (timed to the device-wide synchronize)."""
        return int(self._gate[2].item()) if self.cuda else 0


def _randbits(k: int) -> int:
    """`k` secret random bits (the calls' seeds of positions and weights)."""
    return secrets.randbits(k)


def call_ms(end_ms: float, last_ms: float, left_out_ns: int) -> float:
    """A GPU call's time from its events (ms after the start event): to the end event, or to
    the last event less the host's allowance if that is later (the close kernel gave up), less
    what the timer leaves out (its overhead and the call's read phase)."""
    return max(max(end_ms, last_ms - TAIL_ALLOWANCE_MS) - left_out_ns / 1e6, 0.0)


@functools.cache
def harness_calibration() -> Calibration:
    """The harness's overhead on this process's GPU, measured on a timer of its own without the
    L2 flush (`DeviceTimer.calibrate`); measured once per process (a timing job measures it
    again, `harness.job_timer`)."""
    return DeviceTimer(torch.device("cuda"), flush_l2=False, calibration=Calibration(0, 0)).calibrate()


def refill_(buffers: Sequence[Any], fresh: Sequence[Any]) -> None:
    """Copy fresh values into existing input buffers (tensors in place; other args unchanged)."""
    for b, f in zip(buffers, fresh):
        if isinstance(b, torch.Tensor) and isinstance(f, torch.Tensor):
            b.copy_(f)


def drive_calls(
    fn: Callable[..., Any],
    input_sets: list[list[Any]],
    inputs_for: Callable[[int], list[Any]],
    next_call: Callable[[dict[str, Any]], tuple[int, bool, float] | None],
    timer: DeviceTimer,
    after: Callable[[int, Any], dict[str, Any]] | None = None,
    probe: Callable[..., Any] | None = None,
) -> int:
    """Make the calls the parent asks for; returns how many were made.

    `next_call(report)` asks the parent for the next call, reporting the previous one (`{}`
    before the first; then `{"ms": its time, "host_ms": `timer.host_ms`, **after(i, out)}`), and returns the seed of the
    next call's inputs, whether it is a probe (`probe` is called instead of `fn`: the
    parent measures the loop's own overhead on it) and how long to idle before it (seconds;
    server mode), or None to stop. Call i's buffers
    `input_sets[i % k]` are refilled with `inputs_for(seed)`: before the call on the CPU target;
    on a GPU, by the open gate at the end of the launch window, from a staging copy (a buffer it
    cannot copy, a non-contiguous one, is refilled before the call). On a GPU an allocation of
    `PLACEMENT_BYTES[(i // k) % 8]` is held across call i, so that the call's own allocations
    land elsewhere from one round of input sets to the next. `after(i, out)` runs once call
    i has returned (`DeviceTimer.call`'s `after`: it reads outputs with `read_at_end`) and returns
    what to report about it. The garbage collector is paused so that a collection does not land
    inside a call.
    """
    k = len(input_sets)
    # GPU: the fresh values go to a staging copy, which the open gate copies into the call's
    # buffers at the end of the launch window (see the module's text)
    first = input_sets[0] if input_sets else []
    stage = [a.clone() if all(timer.stages(b[j]) and b[j].nbytes == a.nbytes for b in input_sets) else None
             for j, a in enumerate(first)]
    plans = [timer.copy_plan([(s, a) for s, a in zip(stage, args) if s is not None]) for args in input_sets]
    gc_was_enabled = gc.isenabled()
    gc.collect()
    gc.disable()
    try:
        report: dict[str, Any] = {}
        i = 0
        out: Any = None
        while (asked := next_call(report)) is not None:
            # the previous call's output was held until `next_call` sent its evidence: a finalizer
            # the candidate tied to it (`weakref.finalize`, a storage's deleter) runs only now
            out = None
            seed, is_probe, idle_s = asked
            if idle_s > 0:
                time.sleep(idle_s)  # server mode: the call arrives after a gap (nothing is timed here)
            args = input_sets[i % k]
            refill_([s if s is not None else a for s, a in zip(stage, args)], inputs_for(seed))
            seen: dict[str, Any] = {}
            hook = None if after is None else (lambda out, i=i: seen.update(after(i, out)))
            spacer = (torch.empty(PLACEMENT_BYTES[(i // k) % len(PLACEMENT_BYTES)], dtype=torch.uint8, device=timer.device)
                      if timer.cuda else None)
            out, ms = timer.call(probe if is_probe and probe is not None else fn, args, hook, plans[i % k])
            del spacer
            report = {"ms": ms, "host_ms": timer.host_ms, **seen}
            i += 1
        return i
    finally:
        if gc_was_enabled:
            gc.enable()
