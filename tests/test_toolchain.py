"""The compile tool against the real compilers (g++, nvcc, torch's ninja): nothing is mocked."""

from __future__ import annotations

import asyncio
import ctypes
import os
import shutil
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import pytest

from cudagym.errors import ToolchainError
from cudagym.core.verdict import ErrorKind
from cudagym.sandbox.deps import VariantStore
from cudagym.sandbox.toolchain import Toolchain, ToolchainConfig, parse_diagnostics
from cudagym.sandbox.workspace import Workspace
from cudagym.tasks.model import Target

needs_nvcc = pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc is not installed")

ADD_CPP = """\
#include "scale.h"
extern "C" void add_scaled(const float* a, const float* b, float* out, int n) {
    #pragma omp parallel for
    for (int i = 0; i < n; ++i) out[i] = a[i] + scale() * b[i];
}
"""
SCALE_H = "float scale();\n"
SCALE_CPP = 'float scale() { return 2.0f; }\n'

SCALE_CU = """\
#include <cuda_runtime.h>
__global__ void scale_kernel(float* x, float s, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) x[i] *= s;
}
extern "C" void launch_scale(float* x, float s, int n, cudaStream_t stream) {
    scale_kernel<<<(n + 255) / 256, 256, 0, stream>>>(x, s, n);
}
"""


def make_ws(root: Path, files: dict[str, str]) -> Workspace:
    (root / "kernels").mkdir(parents=True, exist_ok=True)
    for rel, text in files.items():
        (root / rel).write_text(textwrap.dedent(text))
    return Workspace(root)


def two_file_ws(root: Path) -> Workspace:
    return make_ws(root, {"kernels/add.cpp": ADD_CPP, "kernels/scale.cpp": SCALE_CPP,
                          "kernels/scale.h": SCALE_H})


@pytest.fixture
def toolchain(tmp_path: Path) -> Toolchain:
    return Toolchain(tmp_path / "cache", ToolchainConfig(max_jobs=2))


def call_add_scaled(lib_path: Path) -> list[float]:
    lib = ctypes.CDLL(str(lib_path))
    n = 4
    arr = ctypes.c_float * n
    a, b, out = arr(1, 2, 3, 4), arr(10, 20, 30, 40), arr()
    lib.add_scaled(a, b, out, n)
    return list(out)


# -- the workspace format, CPU target ----------------------------------------------------------


def test_cpu_build_links_a_callable_library(toolchain: Toolchain, tmp_path: Path) -> None:
    ws = two_file_ws(tmp_path / "ws")
    res = toolchain.build(ws, Target.CPU)
    assert res.ok, res.errors
    assert not res.cached
    assert sorted(res.compiled) == ["kernels/add.cpp", "kernels/scale.cpp"]
    lib = Path(res.artifact_dir) / "libkernels.so"
    assert lib.is_file()
    assert call_add_scaled(lib) == [21.0, 42.0, 63.0, 84.0]


def test_unchanged_rebuild_is_cached(toolchain: Toolchain, tmp_path: Path) -> None:
    ws = two_file_ws(tmp_path / "ws")
    first = toolchain.build(ws, Target.CPU)
    # rewriting identical bytes changes the mtime, not the content: still a cache hit
    (ws.root / "kernels/add.cpp").write_text(ADD_CPP)
    second = toolchain.build(ws, Target.CPU)
    assert second.ok and second.cached
    assert second.compiled == []
    assert sorted(second.reused) == ["kernels/add.cpp", "kernels/scale.cpp"]
    assert second.artifact_dir == first.artifact_dir


def test_edit_recompiles_only_the_edited_file(toolchain: Toolchain, tmp_path: Path) -> None:
    ws = two_file_ws(tmp_path / "ws")
    first = toolchain.build(ws, Target.CPU)
    ws.edit("kernels/scale.cpp", "2.0f", "3.0f")
    second = toolchain.build(ws, Target.CPU)
    assert second.ok and not second.cached
    assert second.compiled == ["kernels/scale.cpp"]
    assert second.reused == ["kernels/add.cpp"]
    assert second.artifact_dir != first.artifact_dir
    assert call_add_scaled(Path(second.artifact_dir) / "libkernels.so") == [31.0, 62.0, 93.0, 124.0]
    # going back to the first content needs neither a compile nor a link
    ws.edit("kernels/scale.cpp", "3.0f", "2.0f")
    third = toolchain.build(ws, Target.CPU)
    assert third.cached and third.artifact_dir == first.artifact_dir


def test_header_edit_recompiles_only_its_includers(toolchain: Toolchain, tmp_path: Path) -> None:
    ws = two_file_ws(tmp_path / "ws")
    toolchain.build(ws, Target.CPU)
    ws.write("kernels/scale.h", SCALE_H + "// edited\n")
    res = toolchain.build(ws, Target.CPU)
    assert res.ok and res.compiled == ["kernels/add.cpp"] and res.reused == ["kernels/scale.cpp"]


def test_identical_sources_in_another_workspace_reuse_the_cache(toolchain: Toolchain, tmp_path: Path) -> None:
    first = toolchain.build(two_file_ws(tmp_path / "episode1"), Target.CPU)
    # a new Toolchain on the same cache: the cache lives on disk, not in the object
    other = Toolchain(toolchain.cache_dir)
    second = other.build(two_file_ws(tmp_path / "episode2"), Target.CPU)
    assert second.ok and second.cached and second.compiled == []
    assert second.artifact_dir == first.artifact_dir


def test_concurrent_builds_of_one_key_are_safe(toolchain: Toolchain, tmp_path: Path) -> None:
    workspaces = [two_file_ws(tmp_path / f"ws{i}") for i in range(4)]
    results = []
    threads = [threading.Thread(target=lambda w=w: results.append(toolchain.build(w, Target.CPU)))
               for w in workspaces]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert all(r.ok for r in results)
    assert len({r.artifact_dir for r in results}) == 1
    assert call_add_scaled(Path(results[0].artifact_dir) / "libkernels.so") == [21.0, 42.0, 63.0, 84.0]
    assert not list((toolchain.cache_dir / "objects").glob(".tmp-*"))


def test_abuild_runs_the_build(toolchain: Toolchain, tmp_path: Path) -> None:
    ws = two_file_ws(tmp_path / "ws")
    res = asyncio.run(toolchain.abuild(ws, Target.CPU))
    assert res.ok and res.artifact_dir


def test_empty_kernels_dir_is_ok_without_artifact(toolchain: Toolchain, tmp_path: Path) -> None:
    res = toolchain.build(make_ws(tmp_path / "ws", {}), Target.CPU)
    assert res.ok and res.artifact_dir is None and res.compiled == []


def test_syntax_error_is_readable_and_relative(toolchain: Toolchain, tmp_path: Path) -> None:
    ws = make_ws(tmp_path / "ws", {"kernels/ok.cpp": SCALE_CPP, "kernels/x.cpp": """\
        extern "C" int f(int a) {
            int b = a + 1
            return b;
        }
        """})
    res = toolchain.build(ws, Target.CPU)
    assert not res.ok
    assert res.errors and res.errors[0].startswith("kernels/x.cpp:3: error:"), res.errors
    for text in (*res.errors, res.log):
        assert str(tmp_path) not in text and str(toolchain.cache_dir) not in text
    assert res.compiled == ["kernels/ok.cpp", "kernels/x.cpp"]
    # the good file was cached even though the build failed
    ws.edit("kernels/x.cpp", "a + 1\n", "a + 1;\n")
    fixed = toolchain.build(ws, Target.CPU)
    assert fixed.ok and fixed.compiled == ["kernels/x.cpp"] and fixed.reused == ["kernels/ok.cpp"]


def test_template_errors_drop_instantiation_noise(toolchain: Toolchain, tmp_path: Path) -> None:
    ws = make_ws(tmp_path / "ws", {"kernels/t.cpp": """\
        #include <vector>
        template <typename T> int size_of(const T& x) { return x.length(); }
        template <typename T> int outer(const T& x) { return size_of(x); }
        extern "C" int g() { std::vector<int> v(3); return outer(v); }
        """})
    res = toolchain.build(ws, Target.CPU)
    assert not res.ok
    assert any(e.startswith("kernels/t.cpp:2: error:") and "length" in e for e in res.errors), res.errors
    assert not any("required from" in e or "In instantiation" in e for e in res.errors + [res.log])


def test_cu_source_on_cpu_target_is_a_clear_error(toolchain: Toolchain, tmp_path: Path) -> None:
    res = toolchain.build(make_ws(tmp_path / "ws", {"kernels/k.cu": SCALE_CU}), Target.CPU)
    assert not res.ok and res.errors[0].startswith("kernels/k.cu: error: .cu sources need the CUDA target")


def test_compile_timeout_kills_the_compiler(tmp_path: Path) -> None:
    # deep template recursion keeps cc1plus busy for seconds; the limit is a small fraction of that
    heavy = """\
        template <int N> struct F { static constexpr long v = F<N - 1>::v + F<N - 2>::v % 7 + N; };
        template <> struct F<0> { static constexpr long v = 0; };
        template <> struct F<1> { static constexpr long v = 1; };
        #include <regex>
        #include <iostream>
        #include <map>
        extern "C" long h() { std::regex r("a+"); std::map<int, int> m; return F<800>::v + m.size(); }
        """
    tc = Toolchain(tmp_path / "cache", ToolchainConfig(timeout_s=0.3))
    res = tc.build(make_ws(tmp_path / "ws", {"kernels/heavy.cpp": heavy}), Target.CPU)
    assert not res.ok
    assert res.errors == ["kernels/heavy.cpp: error: compile timed out after 0.3 s"]
    assert not list((tc.cache_dir / "objects").iterdir())


def test_missing_compiler_raises_toolchain_error(tmp_path: Path) -> None:
    tc = Toolchain(tmp_path / "cache", ToolchainConfig(cxx="no-such-g++-7"))
    with pytest.raises(ToolchainError, match="no-such-g\\+\\+-7"):
        tc.build(two_file_ws(tmp_path / "ws"), Target.CPU)


# -- the CUDA target, compiled with the local nvcc (no GPU needed) ----------------------------


@needs_nvcc
def test_cuda_build_exports_the_launcher(tmp_path: Path) -> None:
    tc = Toolchain(tmp_path / "cache", ToolchainConfig(cuda_arch="sm_90a"))
    ws = make_ws(tmp_path / "ws", {"kernels/scale.cu": SCALE_CU, "kernels/host.cpp": SCALE_CPP})
    res = tc.build(ws, Target.CUDA)
    assert res.ok, res.errors
    assert sorted(res.compiled) == ["kernels/host.cpp", "kernels/scale.cu"]
    lib = Path(res.artifact_dir) / "libkernels.so"
    symbols = subprocess.run(["nm", "-D", "--defined-only", str(lib)], capture_output=True, text=True,
                             check=True).stdout
    assert " T launch_scale" in symbols
    needed = subprocess.run(["readelf", "-d", str(lib)], capture_output=True, text=True, check=True).stdout
    assert "libcudart.so" in needed  # the shared runtime, the one torch loads too
    again = tc.build(ws, Target.CUDA)
    assert again.cached and again.artifact_dir == res.artifact_dir


@needs_nvcc
def test_cuda_compile_error_is_readable(tmp_path: Path) -> None:
    tc = Toolchain(tmp_path / "cache", ToolchainConfig(cuda_arch="sm_90a"))
    ws = make_ws(tmp_path / "ws", {"kernels/bad.cu": """\
        __global__ void k(float* x) {
            x[threadIdx.x] = undefined_value;
        }
        extern "C" void launch(float* x) { k<<<1, 32>>>(x); }
        """})
    res = tc.build(ws, Target.CUDA)
    assert not res.ok
    assert res.errors[0] == 'kernels/bad.cu:2: error: identifier "undefined_value" is undefined', res.errors
    assert str(tmp_path) not in res.log


def test_parse_diagnostics_formats() -> None:
    out = textwrap.dedent("""\
        In file included from kernels/a.cpp:1:
        kernels/a.h: In instantiation of 'int f(T) [with T = int]':
        kernels/a.cpp:9:12:   required from here
        kernels/a.h:3:14: error: request for member 'x' in 'v', which is of non-class type 'int'
        kernels/a.h:3:20: note: candidate is ...
        kernels/k.cu(7): error: expected a ";"
        kernels/k.cu(8): warning #177-D: variable "q" was declared but never referenced
        ptxas error   : Entry function '_Z1kPf' uses too much shared data (0x20000 bytes, 0xc000 max)
        nvcc fatal   : Unsupported gpu architecture 'compute_99'
        /usr/bin/ld: kernels/a.cpp.o: in function `g': a.cpp:(.text+0x5): undefined reference to `h'
        collect2: error: ld returned 1 exit status
        """)
    assert parse_diagnostics(out, 10) == [
        "kernels/a.h:3: error: request for member 'x' in 'v', which is of non-class type 'int'",
        'kernels/k.cu:7: error: expected a ";"',
        "ptxas: error: Entry function '_Z1kPf' uses too much shared data (0x20000 bytes, 0xc000 max)",
        "nvcc: error: Unsupported gpu architecture 'compute_99'",
        "link: error: undefined reference to `h'",
    ]
    assert len(parse_diagnostics(out, 2)) == 2


# -- torch bindings (compile against torch/extension.h: tens of seconds) ----------------------

BINDING_CPP = """\
#include <torch/extension.h>
extern "C" void add_scaled(const float* a, const float* b, float* out, int n);

torch::Tensor add_scaled_op(torch::Tensor a, torch::Tensor b) {
    auto out = torch::empty_like(a);
    add_scaled(a.data_ptr<float>(), b.data_ptr<float>(), out.data_ptr<float>(), a.numel());
    return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) { m.def("add_scaled", &add_scaled_op); }
"""


@pytest.mark.slow
def test_cpu_binding_builds_an_importable_extension(tmp_path: Path) -> None:
    tc = Toolchain(tmp_path / "cache")
    ws = make_ws(tmp_path / "ws", {"kernels/add.cpp": ADD_CPP, "kernels/scale.cpp": SCALE_CPP,
                                   "kernels/scale.h": SCALE_H, "kernels/ops_binding.cpp": BINDING_CPP})
    res = tc.build(ws, Target.CPU)
    assert res.ok, res.errors
    ext = list(Path(res.artifact_dir).glob("kernel_ext*.so"))
    assert len(ext) == 1 and not (Path(res.artifact_dir) / "libkernels.so").exists()
    script = (
        "import sys, torch; sys.path.insert(0, sys.argv[1]); import kernel_ext; "
        "print(kernel_ext.add_scaled(torch.tensor([1., 2.]), torch.tensor([10., 20.])).tolist())"
    )
    out = subprocess.run([sys.executable, "-c", script, res.artifact_dir], capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[21.0, 42.0]"
    # an edit of a kernel recompiles that kernel only, never the binding, and relinks
    ws.edit("kernels/scale.cpp", "2.0f", "3.0f")
    edited = tc.build(ws, Target.CPU)
    assert edited.ok and edited.compiled == ["kernels/scale.cpp"]
    assert "kernels/ops_binding.cpp" in edited.reused


# -- dependencies the cache must see (class 5: an object credited to a workspace it was not built from)

SCALED_CPP = """\
#include "table.inc"
extern "C" float scaled(float x) { return SCALE * x; }
"""


def call_scaled(artifact_dir: str) -> float:
    lib = ctypes.CDLL(str(Path(artifact_dir) / "libkernels.so"))
    lib.scaled.restype, lib.scaled.argtypes = ctypes.c_float, [ctypes.c_float]
    return lib.scaled(2.0)


def test_included_file_that_differs_gets_its_own_object(toolchain: Toolchain, tmp_path: Path) -> None:
    one = make_ws(tmp_path / "one", {"kernels/a.cpp": SCALED_CPP,
                                     "kernels/table.inc": "static const float SCALE = 1.0f;\n"})
    zero = make_ws(tmp_path / "zero", {"kernels/a.cpp": SCALED_CPP,
                                       "kernels/table.inc": "static const float SCALE = 0.0f;\n"})
    first, second = toolchain.build(one, Target.CPU), toolchain.build(zero, Target.CPU)
    assert first.ok and second.ok and second.compiled == ["kernels/a.cpp"]
    assert (call_scaled(first.artifact_dir), call_scaled(second.artifact_dir)) == (2.0, 0.0)
    # both variants stay in the cache: each workspace finds its own
    again = toolchain.build(make_ws(tmp_path / "one-again",
                                    {"kernels/a.cpp": SCALED_CPP,
                                     "kernels/table.inc": "static const float SCALE = 1.0f;\n"}),
                            Target.CPU)
    assert again.cached and again.artifact_dir == first.artifact_dir


@pytest.mark.parametrize("hide", ["#pragma GCC system_header\n", '# 1 "kernels/hide.h" 3\n'])
def test_header_the_source_marks_as_a_system_header_is_still_tracked(toolchain: Toolchain, tmp_path: Path,
                                                                      hide: str) -> None:
    # `-MMD` would not list table.inc: it is included from what the source declared a system header
    files = {"kernels/a.cpp": '#include "hide.h"\nextern "C" float scaled(float x) { return SCALE * x; }\n',
             "kernels/hide.h": hide + '#include "table.inc"\n'}
    one = toolchain.build(make_ws(tmp_path / "one",
                                  {**files, "kernels/table.inc": "static const float SCALE = 1.0f;\n"}),
                          Target.CPU)
    zero = toolchain.build(make_ws(tmp_path / "zero",
                                   {**files, "kernels/table.inc": "static const float SCALE = 0.0f;\n"}),
                           Target.CPU)
    assert one.ok and zero.ok and zero.compiled == ["kernels/a.cpp"]
    assert (call_scaled(one.artifact_dir), call_scaled(zero.artifact_dir)) == (2.0, 0.0)


def test_file_embedded_by_the_assembler_is_tracked(toolchain: Toolchain, tmp_path: Path) -> None:
    src = """\
        asm(".section .rodata\\n.globl table\\ntable:\\n.incbin \\"kernels/table.bin\\"\\n.text");
        extern "C" const unsigned char table[];
        extern "C" int first_byte() { return table[0]; }
        """
    results = []
    for i, byte in enumerate((b"A", b"B")):
        ws = make_ws(tmp_path / f"ws{i}", {"kernels/a.cpp": src})
        (ws.root / "kernels" / "table.bin").write_bytes(byte * 4)
        res = toolchain.build(ws, Target.CPU)
        assert res.ok and res.compiled == ["kernels/a.cpp"], res
        results.append(ctypes.CDLL(str(Path(res.artifact_dir) / "libkernels.so")).first_byte())
    assert results == [ord("A"), ord("B")]


def test_a_fifo_is_never_opened(tmp_path: Path) -> None:
    # A dependency that became a FIFO (a candidate can make one) must not block the build: the
    # build's copy of kernels/ holds regular files only, so the compiler reports it missing.
    tc = Toolchain(tmp_path / "cache", ToolchainConfig(timeout_s=60))
    files = {"kernels/a.cpp": SCALED_CPP}
    assert tc.build(make_ws(tmp_path / "one", {**files, "kernels/table.inc": "static const float SCALE = 1.0f;\n"}),
                    Target.CPU).ok
    fifo_ws = make_ws(tmp_path / "fifo", files)
    os.mkfifo(fifo_ws.root / "kernels" / "table.inc")
    res = tc.build(fifo_ws, Target.CPU)
    assert not res.ok and res.errors == ["kernels/a.cpp:1: fatal error: table.inc: No such file or directory"]
    assert "kernels/table.inc (not a regular file)" in res.log


def test_a_variant_is_never_overwritten(tmp_path: Path) -> None:
    store = VariantStore(tmp_path / "objects")
    first = store.store("k", {"kernels/t.inc": "0" * 64}, lambda d: (d / "out").write_text("first"))
    second = store.store("k", {"kernels/t.inc": "0" * 64}, lambda d: (d / "out").write_text("second"))
    assert first == second and (first / "out").read_text() == "first"
    assert [p.name for p in (tmp_path / "objects").iterdir()] == ["k"]  # no temporaries left


CPU_SCALED_KERNEL = """\
#include <cstdint>
#include "table.inc"
extern "C" void residual_relu_clamp(const float* x, const float* r, float* out, int64_t n, float hi) {
    for (int64_t i = 0; i < n; ++i) {
        float v = x[i] + r[i];
        v = v > 0.0f ? v : 0.0f;
        out[i] = SCALE * (v < hi ? v : hi);
    }
}
"""


@pytest.mark.slow
def test_workspace_whose_included_file_zeroes_the_output_is_not_credited(evaluator, build_ws) -> None:
    from conftest import SOLUTIONS, task_of

    task = task_of("ew_residual_relu_clamp")
    model = (SOLUTIONS / task.id / "cpu" / "model_new.py").read_text()
    good = build_ws(task, model, {"kernels/a.cpp": CPU_SCALED_KERNEL,
                                  "kernels/table.inc": "static const float SCALE = 1.0f;\n"})
    zeros = build_ws(task, model, {"kernels/a.cpp": CPU_SCALED_KERNEL,
                                   "kernels/table.inc": "static const float SCALE = 0.0f;\n"})
    assert evaluator.compile(task, good).ok
    c = evaluator.compile(task, zeros)
    assert c.ok and c.compiled == ["kernels/a.cpp"], c
    v = evaluator.evaluate(task, zeros)
    assert v.reward < 0 and v.error_kind == ErrorKind.MISMATCH, v.summary()


# -- the loader in a candidate's process ------------------------------------------------------

# what a compile/verify worker does: install the loader, then run the candidate's code
LOADER_SCRIPT = """
import json, os, sys
from pathlib import Path
from cudagym.sandbox.inline import ExtensionNotBuilt, inline_problems, install_inline_loader
cache, workspace = Path(sys.argv[1]), Path(sys.argv[2])
os.chdir(workspace)
loader = install_inline_loader(cache, workspace)
raised = []
try:
    exec(compile((workspace / "model_new.py").read_text(), str(workspace / "model_new.py"), "exec"), {})
except ExtensionNotBuilt as e:
    raised.append(str(e))
print(json.dumps({"missing": loader.missing, "problems": inline_problems(), "raised": raised}))
"""

LOADER_MODEL = """\
from torch.utils.cpp_extension import load_inline

try:
    swallowed = load_inline(name="first", cpp_sources="int f() { return 1; }", extra_include_paths=["kernels"])
except:  # noqa: E722 - as candidates write it
    swallowed = None
second = load_inline(name="second", cpp_sources=["int g() { return 2; }"], functions="g")
"""


def test_uncached_call_is_recorded_before_the_candidate_sees_the_exception(tmp_path: Path) -> None:
    import json

    ws = make_ws(tmp_path / "ws", {"model_new.py": LOADER_MODEL})
    out = subprocess.run([sys.executable, "-c", LOADER_SCRIPT, str(tmp_path / "cache"), str(ws.root)],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout.strip().splitlines()[-1])
    assert [(r["kind"], r["args"]["name"], r["site"]) for r in report["missing"]] == [
        ("load_inline", "first", "model_new.py:4"), ("load_inline", "second", "model_new.py:7")]
    first, second = (r["args"] for r in report["missing"])
    assert first["extra_include_paths"] == ["kernels"] and first["cpp_sources"] == ["int f() { return 1; }"]
    assert second["functions"] == ["g"] and "build_directory" not in second
    assert report["raised"] == ["load_inline module 'second' (model_new.py:7) is not in the build cache: the compile "
                                "tool builds the extensions a solution asks for"]
    assert report["problems"] == ["load_inline module 'first' (model_new.py:4) was not built by the compile step",
                                  "load_inline module 'second' (model_new.py:7) was not built by the compile step"]
    assert not (tmp_path / "cache").exists()  # a lookup writes nothing
