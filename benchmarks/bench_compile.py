"""Compile time of one elementwise kernel: cudagym's Toolchain against torch's JIT builders.

Rows (median wall seconds over `--repeats`, all measured in this run):

  (a) cudagym, torch binding: the one kernel source edited, binding object cached, relinked
  (b) cudagym, no binding (ctypes `libkernels.so`): the edited kernel source compiled + linked
  (c) cudagym, unchanged rebuild (cache hit)
  (d) KernelBench style: `load_inline` with `#include <torch/extension.h>`, fresh build dir
  (e) CUDA-Agent style: `cpp_extension.load(sources=[kernel, binding .cpp])`, fresh build dir

Every repeat changes the kernel's bytes (a constant in a comment and in code), so no cache can
answer an edited build. The baselines get `TORCH_CUDA_ARCH_LIST` matching our `-arch` so both
compile for the same GPU. Usage::

    python benchmarks/bench_compile.py --target cuda --repeats 5   # on the GPU machine
    python benchmarks/bench_compile.py --target cpu --repeats 1    # anywhere
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable
from pathlib import Path

from cudagym.sandbox.toolchain import Toolchain, ToolchainConfig
from cudagym.sandbox.workspace import Workspace
from cudagym.tasks.model import Target

CUDA_KERNEL = """\
#include <cuda_runtime.h>
// variant {v}
__global__ void axpby_kernel(const float* x, const float* y, float* out, float a, float b, int n) {{
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) out[i] = a * x[i] + b * y[i] + {v}.0f * 0.0f;
}}
extern "C" void launch_axpby(const float* x, const float* y, float* out, float a, float b, int n,
                             cudaStream_t stream) {{
    axpby_kernel<<<(n + 255) / 256, 256, 0, stream>>>(x, y, out, a, b, n);
}}
"""

CPU_KERNEL = """\
// variant {v}
extern "C" void launch_axpby(const float* x, const float* y, float* out, float a, float b, int n,
                             void* stream) {{
    #pragma omp parallel for
    for (int i = 0; i < n; ++i) out[i] = a * x[i] + b * y[i] + {v}.0f * 0.0f;
}}
"""

# the same thin binding for (a) and (e); it calls the launcher on the default stream
BINDING = """\
#include <torch/extension.h>
extern "C" void launch_axpby(const float* x, const float* y, float* out, float a, float b, int n,
                             {stream_type} stream);

torch::Tensor axpby(torch::Tensor x, torch::Tensor y, double a, double b) {{
    auto out = torch::empty_like(x);
    launch_axpby(x.data_ptr<float>(), y.data_ptr<float>(), out.data_ptr<float>(), (float)a, (float)b,
                 (int)x.numel(), nullptr);
    return out;
}}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {{ m.def("axpby", &axpby); }}
"""

# KernelBench's single-file layout: the kernel and its torch wrapper in one inline source
INLINE_CUDA = """\
#include <torch/extension.h>
// variant {v}
__global__ void axpby_kernel(const float* x, const float* y, float* out, float a, float b, int n) {{
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) out[i] = a * x[i] + b * y[i] + {v}.0f * 0.0f;
}}
torch::Tensor axpby(torch::Tensor x, torch::Tensor y, double a, double b) {{
    auto out = torch::empty_like(x);
    int n = x.numel();
    axpby_kernel<<<(n + 255) / 256, 256>>>(x.data_ptr<float>(), y.data_ptr<float>(), out.data_ptr<float>(),
                                           (float)a, (float)b, n);
    return out;
}}
"""
INLINE_CPP_DECL = "torch::Tensor axpby(torch::Tensor x, torch::Tensor y, double a, double b);"
INLINE_CPU = """\
#include <torch/extension.h>
// variant {v}
torch::Tensor axpby(torch::Tensor x, torch::Tensor y, double a, double b) {{
    auto out = torch::empty_like(x);
    const float* xp = x.data_ptr<float>(); const float* yp = y.data_ptr<float>(); float* op = out.data_ptr<float>();
    int n = x.numel();
    #pragma omp parallel for
    for (int i = 0; i < n; ++i) op[i] = (float)a * xp[i] + (float)b * yp[i] + {v}.0f * 0.0f;
    return out;
}}
"""

CHECK = """
import sys, ctypes, torch
d, kind, dev = sys.argv[1], sys.argv[2], sys.argv[3]
x = torch.arange(8, dtype=torch.float32, device=dev); y = torch.ones(8, device=dev)
if kind == "ext":
    sys.path.insert(0, d); import kernel_ext; out = kernel_ext.axpby(x, y, 2.0, 3.0)
else:
    lib = ctypes.CDLL(d + "/libkernels.so"); out = torch.empty_like(x)
    f = ctypes.c_float
    lib.launch_axpby(ctypes.c_void_p(x.data_ptr()), ctypes.c_void_p(y.data_ptr()), ctypes.c_void_p(out.data_ptr()),
                     f(2.0), f(3.0), ctypes.c_int(8), ctypes.c_void_p(0))
if dev == "cuda": torch.cuda.synchronize()
assert torch.equal(out.cpu(), 2 * x.cpu() + 3), out
print("ok")
"""


class Variants:
    """Kernel sources that differ in every call (comment and code), unique across runs."""

    def __init__(self) -> None:
        self.base = uuid.uuid4().int % 1_000_000 * 1000
        self.n = 0

    def next(self) -> int:
        self.n += 1
        return self.base + self.n


def timed(fn: Callable[[], object]) -> tuple[float, object]:
    t0 = time.perf_counter()
    out = fn()
    return time.perf_counter() - t0, out


def check(artifact_dir: str, kind: str, target: str) -> None:
    out = subprocess.run([sys.executable, "-c", CHECK, artifact_dir, kind, target], capture_output=True, text=True)
    if out.returncode != 0:
        raise SystemExit(f"the built {kind} does not compute axpby:\n{out.stderr[-2000:]}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", choices=["cuda", "cpu"], default="cuda")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--arch", default=None, help="nvcc -arch for our builds (default: detected, else sm_90a)")
    ap.add_argument("--no-check", action="store_true", help="skip running the built kernels once")
    args = ap.parse_args()

    import torch.utils.cpp_extension as cpp

    target = Target(args.target)
    cuda = target == Target.CUDA
    root = Path(tempfile.mkdtemp(prefix="bench_compile_"))
    tc = Toolchain(root / "cache", ToolchainConfig(cuda_arch=args.arch))
    kernel_name, kernel_src = ("axpby.cu", CUDA_KERNEL) if cuda else ("axpby.cpp", CPU_KERNEL)
    binding = BINDING.format(stream_type="cudaStream_t" if cuda else "void*")
    if cuda:
        binding = binding.replace("#include <torch/extension.h>",
                                  "#include <torch/extension.h>\n#include <cuda_runtime.h>")
        # the baselines compile for the same GPU as we do: sm_90a -> TORCH_CUDA_ARCH_LIST=9.0a
        arch = tc.cuda_arch
        digits = arch[3:].rstrip("a")
        os.environ.setdefault("TORCH_CUDA_ARCH_LIST",
                              f"{digits[:-1]}.{digits[-1]}" + ("a" if arch.endswith("a") else ""))
    variants = Variants()
    times: dict[str, list[float]] = {k: [] for k in "abcde"}

    def workspace(name: str, with_binding: bool) -> Workspace:
        (root / name / "kernels").mkdir(parents=True)
        ws = Workspace(root / name)
        ws.write(f"kernels/{kernel_name}", kernel_src.format(v=variants.next()))
        if with_binding:
            ws.write("kernels/axpby_binding.cpp", binding)
        return ws

    def build(ws: Workspace, expect_compiled: list[str] | None) -> tuple[float, str]:
        sec, res = timed(lambda: tc.build(ws, target))
        if not res.ok:
            raise SystemExit("build failed:\n" + "\n".join(res.errors))
        if expect_compiled is not None and res.compiled != expect_compiled:
            raise SystemExit(f"expected to compile {expect_compiled}, compiled {res.compiled}")
        return sec, res.artifact_dir

    ws_a = workspace("ws_binding", True)
    print("warm-up: building the binding once (not timed) ...", flush=True)
    build(ws_a, None)
    ws_b = workspace("ws_ctypes", False)
    build(ws_b, None)
    edited = [f"kernels/{kernel_name}"]
    for _ in range(args.repeats):
        ws_a.write(f"kernels/{kernel_name}", kernel_src.format(v=variants.next()))
        sec, art_a = build(ws_a, edited)
        times["a"].append(sec)
        ws_b.write(f"kernels/{kernel_name}", kernel_src.format(v=variants.next()))
        sec, art_b = build(ws_b, edited)
        times["b"].append(sec)
        sec, _ = build(ws_b, [])
        times["c"].append(sec)

        v = variants.next()
        inline_kw = (dict(cpp_sources=INLINE_CPP_DECL, cuda_sources=INLINE_CUDA.format(v=v)) if cuda
                     else dict(cpp_sources=INLINE_CPU.format(v=v), extra_cflags=["-O3", "-fopenmp"],
                               extra_ldflags=["-fopenmp"]))
        d_dir = root / f"d_{v}"
        d_dir.mkdir()
        sec, _ = timed(lambda: cpp.load_inline(name=f"bench_inline_{v}", functions=["axpby"],
                                               build_directory=str(d_dir), verbose=False, **inline_kw))
        times["d"].append(sec)

        e_dir = root / f"e_{v}"
        e_dir.mkdir()
        (e_dir / "src").mkdir()
        (e_dir / "src" / kernel_name).write_text(kernel_src.format(v=v))
        (e_dir / "src" / "axpby_binding.cpp").write_text(binding)
        e_kw = {} if cuda else dict(extra_cflags=["-O3", "-fopenmp"], extra_ldflags=["-fopenmp"])
        sec, _ = timed(lambda: cpp.load(name=f"bench_load_{v}", build_directory=str(e_dir), verbose=False,
                                        sources=[str(e_dir / "src" / kernel_name),
                                                 str(e_dir / "src" / "axpby_binding.cpp")], **e_kw))
        times["e"].append(sec)
    if not args.no_check:
        check(art_a, "ext", args.target)
        check(art_b, "lib", args.target)

    labels = {
        "a": "(a) cudagym, binding, kernel edited",
        "b": "(b) cudagym, ctypes, kernel edited",
        "c": "(c) cudagym, unchanged (cache hit)",
        "d": "(d) load_inline + torch/extension.h",
        "e": "(e) cpp_extension.load (kernel + binding)",
    }
    med = {k: statistics.median(v) for k, v in times.items()}
    print(f"\ncompile one elementwise kernel, target={args.target}"
          + (f", arch={tc.cuda_arch}, TORCH_CUDA_ARCH_LIST={os.environ['TORCH_CUDA_ARCH_LIST']}" if cuda else "")
          + f", repeats={args.repeats}, cpus={os.cpu_count()}")
    print(f"{'step':44} {'median_s':>9} {'min_s':>8} {'(d)/this':>9} {'(e)/this':>9}")
    for k, label in labels.items():
        print(f"{label:44} {med[k]:9.4f} {min(times[k]):8.4f} {med['d'] / med[k]:8.1f}x {med['e'] / med[k]:8.1f}x")


if __name__ == "__main__":
    main()
