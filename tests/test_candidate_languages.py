"""Candidates written in the kernel languages people use beside CUDA C++: Triton (KernelBench's
Triton format), and `torch.compile` inside `forward`. Their JIT caches live in the job's own
writable scratch (the workers' HOME is read-only), so they build and run in the sandbox. On the
GPU, permissive mode counts a Triton kernel compiled from the candidate's own file as its own
kernel (`cudagym.sandbox.jit`); torch.compile's kernels stay foreign, and so does one of them
copied into the candidate's own library and loaded from there (the red team's g2); strict mode
counts no kernel loaded from memory as own.

CuPy is not tested: it is not installed on the GPU machine (its CUDA 13 wheel is larger than one
device call can carry); its cache directory (`CUPY_CACHE_DIR`) is set the same way, and its
kernels (NVRTC from strings, no source location in its cache) count as foreign."""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import pytest

from cudagym.rewards.evaluator import Evaluator, EvaluatorConfig
from cudagym.core.verdict import ErrorKind
from cudagym.sandbox.jit import own_jit_images
from cudagym.sandbox.origin import memory_digest, records_from_counts
from cudagym.sandbox.workspace import Workspace
from cudagym.tasks.loaders import bundled_task

TASK = "ew_scale_bias_gelu"

COMPILED_FORWARD = textwrap.dedent('''
    import torch
    import torch.nn as nn
    import torch.nn.functional as F


    def _fused(x, scale, bias):
        return F.gelu(x * scale + bias)


    class ModelNew(nn.Module):
        def __init__(self, features, scale):
            super().__init__()
            self.scale = scale
            self.bias = nn.Parameter(torch.randn(features) * 0.5)
            self._fn = torch.compile(_fused, dynamic=False)

        def forward(self, x):
            return self._fn(x, self.scale, self.bias)
''')

SOLUTIONS = Path(__file__).resolve().parent.parent / "examples" / "solutions"
TRITON = (SOLUTIONS / TASK / "triton" / "model_new.py").read_text()  # the bundled Triton example

# The red team's g2, in our own code: torch.compile's generated Triton kernel, its cubin copied
# into this workspace's own library (.bss) and loaded from there each time Triton loads one
# (Triton's CompiledKernel is patched before inductor compiles anything); forward runs the
# compiled function. The kernel watcher must name the copy by its bytes, never by the library.
LAUNDER_CU = r"""
#include <cstddef>
#include <cstring>
#include <cuda_runtime.h>

namespace {
alignas(4096) char slots[8][1 << 20];  // .bss: inside this library's mapping, writable
int used = 0;
}  // namespace

extern "C" void* load_from_bss(const void* image, size_t size, const char* name) {
    if (used >= 8 || size > sizeof slots[0]) return nullptr;
    char* copy = slots[used++];
    std::memcpy(copy, image, size);
    cudaLibrary_t lib = nullptr;
    if (cudaLibraryLoadData(&lib, copy, nullptr, nullptr, 0, nullptr, nullptr, 0) != cudaSuccess) return nullptr;
    cudaKernel_t kernel = nullptr;
    if (cudaLibraryGetKernel(&kernel, lib, name) != cudaSuccess) return nullptr;
    return reinterpret_cast<void*>(kernel);
}
"""
LAUNDERED_COMPILE = textwrap.dedent('''
    import ctypes
    import json
    import os

    import torch
    import torch.nn as nn
    import torch.nn.functional as F
    from cudagym.runtime import kernel_library

    _lib = kernel_library()
    _lib.load_from_bss.argtypes = [ctypes.c_char_p, ctypes.c_size_t, ctypes.c_char_p]
    _lib.load_from_bss.restype = ctypes.c_void_p
    LAUNDERED = []


    def _launder_triton_loads():
        from triton.compiler.compiler import CompiledKernel

        original = CompiledKernel._init_handles

        def init_handles(self):
            original(self)
            image = getattr(self, "kernel", None)
            if isinstance(image, bytes) and not getattr(self, "_laundered", False):
                handle = _lib.load_from_bss(image, len(image), self.name.encode())
                if handle:
                    self.function = handle
                    self._laundered = True
                    LAUNDERED.append(self.name)
                    with open(os.path.join(os.getcwd(), "laundered.json"), "w") as f:
                        json.dump(LAUNDERED, f)

        CompiledKernel._init_handles = init_handles


    def _fused(x, scale, bias):
        return F.gelu(x * scale + bias)


    class ModelNew(nn.Module):
        def __init__(self, features, scale):
            super().__init__()
            self.scale = scale
            self.bias = nn.Parameter(torch.randn(features) * 0.5)
            import torch._inductor.config as inductor_config

            for name in ("use_static_cuda_launcher", "use_static_triton_launcher"):  # Triton loads the cubins
                if hasattr(inductor_config, name):
                    setattr(inductor_config, name, False)
            inductor_config.compile_threads = 1
            _launder_triton_loads()
            self._fn = torch.compile(_fused, dynamic=False)

        def forward(self, x):
            return self._fn(x, self.scale, self.bias)
''')


def _verify(tmp_path: Path, target: str, mode: str, source: str, kernels: dict[str, str] | None = None):
    cfg = EvaluatorConfig(target=target, mode=mode, cache_dir=tmp_path / "cache", compile_baseline=False)
    with Evaluator(cfg) as ev:
        task = bundled_task(TASK).for_target(ev.target)
        ws = Workspace.create(tmp_path / "ws", task, model_new=source)
        for rel, text in (kernels or {}).items():
            ws.write(rel, text)
        return ev.verify(task, ws)


def _needs_gpu_and_triton() -> None:
    import torch

    if not torch.cuda.is_available():
        pytest.skip("needs a GPU")
    pytest.importorskip("triton")


@pytest.mark.slow
def test_torch_compile_inside_forward_builds_in_the_sandbox(tmp_path: Path) -> None:
    """inductor writes its cache in the job's scratch, so the compiled forward runs and is correct;
    the rules then judge it as torch's work: no own kernel carries it (permissive), torch compute
    (strict)."""
    permissive = _verify(tmp_path / "p", "cpu", "permissive", COMPILED_FORWARD)
    assert permissive.correct and permissive.trials_passed == permissive.trials >= 5, (permissive.error,
                                                                                      permissive.reasons)
    assert permissive.error_kind == ErrorKind.AUDIT and permissive.audit.own_kernel_share == 0, permissive.audit
    strict = _verify(tmp_path / "s", "cpu", "strict", COMPILED_FORWARD)
    assert not strict.ok and strict.error_kind == ErrorKind.AUDIT, (strict.error_kind, strict.error)


@pytest.mark.gpu
def test_triton_candidate_is_correct_and_its_kernels_are_its_own(tmp_path: Path) -> None:
    """The bundled Triton example in permissive mode: its kernel, loaded by Triton from memory, is
    named by its image's digest, which its Triton cache ties to its own model_new.py."""
    _needs_gpu_and_triton()
    cfg = EvaluatorConfig(target="cuda", mode="permissive", cache_dir=tmp_path / "cache", compile_baseline=False)
    with Evaluator(cfg) as ev:
        task = bundled_task(TASK).for_target(ev.target)
        ws = Workspace.create(tmp_path / "ws", task, model_new=TRITON)
        verdict = ev.evaluate(task, ws)  # verify, then the timed calls and their audit
    v = verdict.verify_result
    assert v is not None and v.ok, verdict.summary()
    assert v.audit is not None and v.audit.own_kernel_share is not None and v.audit.own_kernel_share > 0.9, v.audit
    assert verdict.reward >= 1, verdict.summary()  # the timed calls did no foreign work either
    records = records_from_counts(v.audit.ops_seen)
    own = own_jit_images(tmp_path / "ws")
    assert records and all(memory_digest(r.origin) in own for r in records), (records, own)
    assert {r.name for r in records} == {"scale_bias_gelu_kernel"}, records


@pytest.mark.gpu
def test_triton_candidate_in_strict_mode_is_refused_by_origin(tmp_path: Path) -> None:
    """Strict mode counts no image loaded from memory as the candidate's (docs/protection.md)."""
    _needs_gpu_and_triton()
    v = _verify(tmp_path, "cuda", "strict", TRITON)
    assert v.correct and not v.ok and v.error_kind == ErrorKind.AUDIT, (v.error_kind, v.error)
    assert any("not your own" in r and "scale_bias_gelu_kernel (from <memory:" in r for r in v.reasons), v.reasons


@pytest.mark.gpu
def test_torch_compile_candidate_on_the_gpu(tmp_path: Path) -> None:
    """inductor's kernels run and are correct, and are torch's: its generated Triton source lies in
    the job's scratch, not among the candidate's files, so the own-kernel share is nil."""
    _needs_gpu_and_triton()
    v = _verify(tmp_path, "cuda", "permissive", COMPILED_FORWARD)
    assert v.correct and v.trials_passed == v.trials >= 5, (v.error_kind, v.error, v.reasons)
    assert v.error_kind == ErrorKind.AUDIT and v.audit is not None, (v.error_kind, v.error)
    assert v.audit.own_kernel_share is not None and v.audit.own_kernel_share <= 0.05, v.audit


@pytest.mark.gpu
def test_inductor_kernel_copied_into_the_own_library_stays_foreign(tmp_path: Path) -> None:
    """g2: torch.compile's kernel, copied into the .bss of the candidate's own library and loaded
    from there, is named `<memory:DIGEST>`, not by the library: strict names it as not the
    candidate's, and permissive does not count it (its digest is a cubin of inductor's source)."""
    _needs_gpu_and_triton()
    kernels = {"kernels/launder.cu": LAUNDER_CU}
    strict = _verify(tmp_path / "s", "cuda", "strict", LAUNDERED_COMPILE, kernels)
    laundered = tmp_path / "s" / "ws" / "laundered.json"
    assert laundered.is_file() and json.loads(laundered.read_text()), (
        "the attack did not mount (no kernel was loaded from the library's .bss)", strict.error, strict.reasons)
    assert strict.correct and strict.error_kind == ErrorKind.AUDIT, (strict.error_kind, strict.error)
    assert any("not your own" in r and "(from <memory:" in r for r in strict.reasons), strict.reasons
    records = records_from_counts(strict.audit.ops_seen)
    assert records and not any(r.origin.endswith("libkernels.so") for r in records), records
    permissive = _verify(tmp_path / "p", "cuda", "permissive", LAUNDERED_COMPILE, kernels)
    assert json.loads((tmp_path / "p" / "ws" / "laundered.json").read_text())
    assert permissive.correct and permissive.error_kind == ErrorKind.AUDIT, (permissive.error_kind, permissive.error)
    assert permissive.audit.own_kernel_share is not None and permissive.audit.own_kernel_share <= 0.05, permissive.audit
