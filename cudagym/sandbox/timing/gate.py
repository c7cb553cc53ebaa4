"""The gate kernels of the GPU timer (`cudagym.sandbox.timing`): their CUDA source, the ctypes
mirrors of the close kernel's arguments, and their compilation (NVRTC) and loading, once per
process. These run when a `DeviceTimer` is built, before any candidate code loads; what runs
during a timed call is in `timer`.

The compiled image (a cubin) is made once, not in every worker: NVRTC needs no CUDA context, so
the sandbox's parent compiles it, before any worker starts, for each visible GPU's architecture
(from NVML), into the harness's own build directory beside the op watcher's library
(`store_gate_images`, called by `opwatch.build_library`); a worker loads the image whose name
matches its GPU (`gate_kernels`, in its prewarm) and compiles only where none does. Its name is
the hash of the source (as `gate_source` makes it for the GPU's resident blocks per SM), the
architecture, NVRTC's version and torch's (whose NVRTC options compile it). A candidate cannot
substitute the image: it is written by the parent alone, under a temporary name renamed into
place and made read-only, in a directory no worker may write (Landlock confines a worker's writes,
truncations, unlinks and renames to its workspace and scratch, whatever a file's mode, which a
worker that keeps root's uid may change; the docker backend mounts the directory read-only), and
a worker reads it in its prewarm, before it reads its job, so no candidate code has run in that
process yet; a later job cannot reach an earlier worker. This is the trust the
op watcher's library beside it already has, which every worker executes natively.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import uuid
from collections.abc import Iterable
from pathlib import Path
from typing import Any, NamedTuple

import torch

CLOSE_TIMEOUT_NS = 1_000_000_000  # the close kernel gives up after this long
GATE_THREADS = 256
MAX_SAMPLED_OUTPUTS = 16  # outputs of one call the close kernel reads (more are read before it)
MAX_SAMPLED_DIMS = 8  # dimensions of a non-contiguous output the close kernel reads (more: made contiguous first)
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
__device__ __noinline__ void project_dense(const T* src, unsigned long long n, unsigned int s0, unsigned int s1,
                                           double* proj) {
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
        accumulate(component((const volatile unsigned char*)s.src + off * s.elem_size
                             + (i & (parts - 1)) * part_size, kind),
                   i, s0, s1, acc);
    }
    add_block(acc, (double*)s.proj);
}
__device__ void project(const Sampled& s, unsigned int o, unsigned long long seed) {
    const unsigned int s0 = (unsigned int)seed ^ mix32(2u * o + 1u),
                       s1 = (unsigned int)(seed >> 32) ^ mix32(2u * o + 2u);
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
                flat = (long long)((mix64(samples.seed
                                          + 0x9e3779b97f4a7c15ull * ((unsigned long long)o << 32 | i)) >> 11)
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


class Sampled(ctypes.Structure):
    """The close kernel's `Sampled` (one output it reads; see the source above)."""

    _fields_ = [("src", ctypes.c_uint64), ("values", ctypes.c_uint64), ("positions", ctypes.c_uint64),
                ("proj", ctypes.c_uint64), ("numel", ctypes.c_int64), ("count", ctypes.c_int64),
                ("elem_size", ctypes.c_int64), ("ndim", ctypes.c_int64), ("kind", ctypes.c_int64),
                ("index", ctypes.c_int64),
                ("sizes", ctypes.c_int64 * MAX_SAMPLED_DIMS),
                ("strides", ctypes.c_int64 * MAX_SAMPLED_DIMS)]


class Samples(ctypes.Structure):
    """The close kernel's `Samples`, passed by value: no copy to the GPU inside the timed interval."""

    _fields_ = [("seed", ctypes.c_uint64), ("n", ctypes.c_int64), ("out", Sampled * MAX_SAMPLED_OUTPUTS)]


class Gate(NamedTuple):
    """The gate kernels of one GPU and their launch shape."""

    open: Any  # torch's NVRTC kernel handles
    close: Any
    blocks: int  # the whole grid, resident at once
    holds_every_sm: bool  # False: a GPU where the blocks cannot fill every SM's thread slots


# The threads an SM keeps resident, by compute capability, where not 2048: what the parent
# compiles the source for without a CUDA context (`store_gate_images`). A GPU that says otherwise
# finds no image of its name and its worker compiles its own.
THREADS_PER_SM = {(7, 5): 1024, (8, 6): 1536, (8, 9): 1536, (12, 0): 1536, (12, 1): 1536}
GATE_IMAGE_DIR = "gate"  # under the harness's build directory (CUDAGYM_OPWATCH_DIR)


def blocks_per_sm(threads_per_sm: int) -> int:
    """Gate blocks an SM keeps resident when it keeps `threads_per_sm` threads."""
    return max(1, threads_per_sm // GATE_THREADS)


def nvrtc_version() -> str:
    """NVRTC's version ("13.0"), as torch loads it."""
    from torch.cuda._utils import _get_gpu_rtc_library

    major, minor = ctypes.c_int(0), ctypes.c_int(0)
    _get_gpu_rtc_library().nvrtcVersion(ctypes.byref(major), ctypes.byref(minor))
    return f"{major.value}.{minor.value}"


def gate_image_name(capability: tuple[int, int], per_sm: int, nvrtc: str) -> str:
    """The file name of the gate kernels' image for GPUs of `capability` that keep `per_sm` gate
    blocks resident, compiled by NVRTC `nvrtc` (see the module's text)."""
    key = hashlib.sha256("\0".join([gate_source(per_sm), f"sm_{capability[0]}{capability[1]}", nvrtc,
                                     torch.__version__]).encode()).hexdigest()[:32]
    return f"gate-sm{capability[0]}{capability[1]}-{key}.cubin"


def compile_gate(capability: tuple[int, int], per_sm: int) -> bytes:
    """The gate kernels' image for `capability`, as torch's NVRTC helper makes it (a cubin; no
    CUDA context needed)."""
    from torch.cuda._utils import _nvrtc_compile

    image, _ = _nvrtc_compile(gate_source(per_sm), "cudagym_gate_open",
                              compute_capability=f"{capability[0]}{capability[1]}")
    return image


def store_gate_images(root: Path, capabilities: Iterable[tuple[int, int]]) -> list[Path]:
    """The gate kernels' images for GPUs of `capabilities` under `root/gate/`, compiled where
    absent (written under a temporary name, renamed into place, read-only); by the sandbox's
    parent, before its workers start. Raises what NVRTC raises (no NVRTC, a failed compile)."""
    directory = Path(root) / GATE_IMAGE_DIR
    nvrtc = nvrtc_version()
    paths = []
    for cc in dict.fromkeys(capabilities):
        per_sm = blocks_per_sm(THREADS_PER_SM.get(cc, 2048))
        path = directory / gate_image_name(cc, per_sm, nvrtc)
        if not path.is_file():
            directory.mkdir(parents=True, exist_ok=True)
            staging = directory / f".tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
            try:
                staging.write_bytes(compile_gate(cc, per_sm))
                staging.chmod(0o444)
                os.replace(staging, path)
            finally:
                staging.unlink(missing_ok=True)
        paths.append(path)
    return paths


def stored_gate_image(root: Path | None, capability: tuple[int, int], per_sm: int) -> bytes | None:
    """The image the parent stored for this GPU (`store_gate_images`), or None."""
    if root is None:
        return None
    try:
        return (Path(root) / GATE_IMAGE_DIR / gate_image_name(capability, per_sm, nvrtc_version())).read_bytes()
    except OSError:
        return None


@functools.cache
def gate_kernels(index: int) -> Gate:
    """Load the gate kernels for GPU `index` (once per process): the image the parent stored for
    its architecture under the harness's build directory (CUDAGYM_OPWATCH_DIR), else compiled
    here (NVRTC). Called by the worker's prewarm, before any candidate code."""
    from torch.cuda._utils import _cuda_load_module, _get_gpu_runtime_library

    props = torch.cuda.get_device_properties(index)
    capability = (props.major, props.minor)
    per_sm = blocks_per_sm(props.max_threads_per_multi_processor)
    root = os.environ.get("CUDAGYM_OPWATCH_DIR")
    names = ["cudagym_gate_open", "cudagym_gate_close"]
    with torch.cuda.device(index):
        stored = stored_gate_image(Path(root) if root else None, capability, per_sm)
        try:
            kernels = _cuda_load_module(stored, names) if stored is not None else None
        except RuntimeError:  # an image the driver refuses (another driver than the parent's NVRTC targets)
            kernels = None
        if kernels is None:
            kernels = _cuda_load_module(compile_gate(capability, per_sm), names)
        if not isinstance(kernels, dict):  # torch returns the module itself only when no names are given
            raise RuntimeError(f"torch loaded the gate module without its kernels ({type(kernels).__name__})")
        resident = ctypes.c_int(0)
        libcuda = _get_gpu_runtime_library()
        for k in (kernels["cudagym_gate_open"], kernels["cudagym_gate_close"]):
            libcuda.cuOccupancyMaxActiveBlocksPerMultiprocessor(ctypes.byref(resident), k.func, GATE_THREADS, 0)
            per_sm = min(per_sm, resident.value)
    per_sm = max(per_sm, 1)
    return Gate(kernels["cudagym_gate_open"], kernels["cudagym_gate_close"], per_sm * props.multi_processor_count,
                per_sm * GATE_THREADS >= props.max_threads_per_multi_processor)


def cuda_driver() -> Any:
    """The CUDA driver library, as torch loaded it."""
    from torch.cuda._utils import _get_gpu_runtime_library

    return _get_gpu_runtime_library()


def cudart() -> Any | None:
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
