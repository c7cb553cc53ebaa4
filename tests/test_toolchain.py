"""The compile tool against the real compilers (g++, nvcc, torch's ninja): nothing is mocked."""

from __future__ import annotations

import asyncio
import ctypes
import shutil
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import pytest

from cudagym.errors import ToolchainError
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


# -- single-file solutions: load_inline through install_inline_loader -------------------------

INLINE_CPP = """
torch::Tensor twice_plus(torch::Tensor x, double c) {
    return x * 2 + c;  // CONSTANT
}
"""

# what a harness worker does: install the loader, import the candidate (here: call load_inline)
INLINE_SCRIPT = """
import json, sys
from pathlib import Path
import torch
from cudagym.sandbox.inline import install_inline_loader
cache, build_root, source = sys.argv[1], sys.argv[2], sys.argv[3]
rec = install_inline_loader(Path(cache), Path(build_root) if build_root else None)
from torch.utils.cpp_extension import load_inline
try:
    mod = load_inline(name="twice_ext", cpp_sources=source, functions=["twice_plus"])
except Exception as e:
    print(json.dumps({"error": type(e).__name__ + ": " + str(e)}))
    sys.exit(0)
print(json.dumps({"built": rec.built, "loaded": rec.loaded,
                  "value": mod.twice_plus(torch.tensor([1.0, 2.0]), 0.5).tolist()}))
"""


def run_inline(cache: Path, build_root: Path | None, source: str) -> dict:
    import json

    out = subprocess.run([sys.executable, "-c", INLINE_SCRIPT, str(cache), str(build_root or ""), source],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def inline_cache(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, dict]:
    """One load_inline build shared by the tests of this module: (cache, build_root, result)."""
    root = tmp_path_factory.mktemp("inline")
    cache, build_root = root / "cache", root / "ws" / ".build" / "inline"
    return cache, build_root, run_inline(cache, build_root, INLINE_CPP)


@pytest.mark.slow
def test_inline_first_call_builds_into_the_cache(inline_cache: tuple[Path, Path, dict]) -> None:
    cache, build_root, first = inline_cache
    assert first["value"] == [2.5, 4.5]
    assert [name for name, _ in first["built"]] == ["twice_ext"] and first["loaded"] == []
    key = first["built"][0][1]
    assert list((cache / "inline" / key).glob("*.so"))
    assert (build_root / "twice_ext" / "build.ninja").is_file()  # torch's build dir persists


@pytest.mark.slow
def test_inline_cached_module_loads_in_a_fresh_process_without_compiling(
        inline_cache: tuple[Path, Path, dict]) -> None:
    cache, build_root, first = inline_cache
    ninja_log = build_root / "twice_ext" / ".ninja_log"
    before = ninja_log.stat().st_mtime_ns
    again = run_inline(cache, None, INLINE_CPP)
    assert again["value"] == [2.5, 4.5]
    assert again["built"] == [] and again["loaded"] == first["built"]
    assert ninja_log.stat().st_mtime_ns == before


def test_inline_module_that_was_not_compiled_is_a_clear_error(tmp_path: Path) -> None:
    from cudagym.sandbox.inline import install_inline_loader
    import torch.utils.cpp_extension as cpp

    original = cpp.load_inline
    rec = install_inline_loader(tmp_path / "cache", None)
    try:
        with pytest.raises(RuntimeError, match="load_inline module 'never_built' was not compiled: run the "
                                               "compile tool first"):
            cpp.load_inline(name="never_built", cpp_sources="int f() { return 1; }", functions=["f"])
    finally:
        rec.uninstall()
    assert cpp.load_inline is original


@pytest.mark.slow
def test_inline_compile_error_is_readable(inline_cache: tuple[Path, Path, dict]) -> None:
    cache, build_root, _ = inline_cache
    broken = INLINE_CPP.replace("return x * 2 + c;", "return x * 2 + undefined_c;")
    res = run_inline(cache, build_root, broken)
    msg = res["error"]
    assert msg.startswith("InlineCompileError: load_inline module 'twice_ext' failed to compile:")
    assert "cpp_sources:3: error: 'undefined_c' was not declared in this scope" in msg, msg
    assert str(build_root) not in msg and str(cache) not in msg
