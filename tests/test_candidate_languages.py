"""Candidates written in the kernel languages people use beside CUDA C++: Triton (KernelBench's
Triton format), CuPy (`cupy.RawKernel`), and `torch.compile` inside `forward`. Their JIT caches
live in the job's own writable scratch (the workers' HOME is read-only), so they build and run in
the sandbox. On the GPU, permissive mode counts a Triton kernel compiled from the candidate's own
file, and a CuPy kernel whose source is a string or file of the candidate's, as its own kernel
(`cudagym.sandbox.jit`); torch.compile's kernels stay foreign, and so does one of them copied into
the candidate's own library and loaded from there (the red team's g2); strict mode counts no
kernel loaded from memory as own.

CuPy is not installed on the GPU machine: `benchmarks/stage_cupy.sh` brings its wheel there (the
CuPy tests skip, saying so, where it cannot be imported)."""

from __future__ import annotations

import hashlib
import json
import textwrap
from pathlib import Path
from typing import Any

import pytest

from cudagym.rewards.evaluator import Evaluator, EvaluatorConfig
from cudagym.core.verdict import ErrorKind, VerifyResult
from cudagym.sandbox.jit import (JIT_CACHES, cupy_kernels, jit_cache_env, own_cupy_kernels, own_jit_images,
                                 workspace_scratch, workspace_texts)
from cudagym.sandbox.origin import memory_digest, records_from_counts
from cudagym.sandbox.workspace import Workspace
from cudagym.tasks.loaders import bundled_task
from cudagym.tasks.model import module_constants
from test_jit_origin import fake_cubin

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
CUPY = (SOLUTIONS / TASK / "cupy" / "model_new.py").read_text()  # the bundled CuPy example

# The red team's g2, in our own code: torch.compile's generated Triton kernel, its cubin copied
# into this workspace's own library (.bss) and loaded from there each time Triton loads one
# (Triton's CompiledKernel is patched before inductor compiles anything). The kernel watcher must
# name the copy by its bytes, never by the library.
#
# Why it compiles in __init__ and calls inductor's compiled graph directly: verify runs forward
# under the harness's `OpRecorder`, a TorchDispatchMode, and Dynamo compiles no frame while a
# non-infra dispatch mode is active ("non-infra torch dispatch mode present", in convert_frame;
# a graph compiled before is not run either), so a torch.compile'd function called in forward
# runs eagerly there: ATen's kernels, no Triton load, nothing to launder (the first GPU run failed
# so). __init__ runs under no mode: it compiles for the task's shapes through a backend that keeps
# inductor's compiled graph (`compile_fx`), and forward calls that graph with its inputs, which
# launches the Triton kernel through inductor's launcher (the laundered handle), no Dynamo frame.
#
# Each step is recorded in `laundered.json` beside model_new.py (the workspace, also the worker's
# cwd), so a run where the attack did not mount says where it stopped.
LAUNDER_CU = r"""
#include <cstddef>
#include <cstring>
#include <cuda_runtime.h>

namespace {
constexpr size_t kSlots = 16;
constexpr size_t kSlotBytes = 1 << 20;
alignas(4096) char slots[kSlots][kSlotBytes];  // .bss: inside this library's mapping, writable
size_t used = 0;
int last_error = 0;
}  // namespace

extern "C" void* load_from_bss(const void* image, size_t size, const char* name) {
    if (used >= kSlots || size > kSlotBytes) { last_error = -1; return nullptr; }
    char* copy = slots[used++];
    std::memcpy(copy, image, size);
    cudaLibrary_t lib = nullptr;
    cudaError_t err = cudaLibraryLoadData(&lib, copy, nullptr, nullptr, 0, nullptr, nullptr, 0);
    if (err != cudaSuccess) { last_error = static_cast<int>(err); return nullptr; }
    cudaKernel_t kernel = nullptr;  // a CUkernel: Triton's launcher takes it where a CUfunction goes
    err = cudaLibraryGetKernel(&kernel, lib, name);
    if (err != cudaSuccess) { last_error = static_cast<int>(err); return nullptr; }
    return reinterpret_cast<void*>(kernel);
}

extern "C" int launder_error() { return last_error; }
"""
LAUNDERED_COMPILE = textwrap.dedent('''
    import ctypes
    import json
    import os

    import torch
    import torch.nn as nn
    import torch.nn.functional as F

    ROWS = 0  # the task's batch (the test writes it in): inductor compiles for static shapes
    MARKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "laundered.json")
    REPORT = {"pid": os.getpid(), "steps": [], "laundered": [], "init_handles": 0, "forward": None}


    def _step(name, detail="ok"):
        REPORT["steps"].append([name, str(detail)[:800]])
        try:
            with open(MARKER, "w") as f:
                json.dump(REPORT, f)
        except OSError as e:
            REPORT["marker_error"] = f"{type(e).__name__}: {e}"


    try:
        from cudagym.runtime import kernel_library

        _lib = kernel_library()
        _lib.load_from_bss.argtypes = [ctypes.c_char_p, ctypes.c_size_t, ctypes.c_char_p]
        _lib.load_from_bss.restype = ctypes.c_void_p
        _lib.launder_error.restype = ctypes.c_int
        _step("library")
    except Exception as e:  # noqa: BLE001 - recorded
        _lib = None
        _step("library", f"{type(e).__name__}: {e}")


    def _launder(kernel):
        """A handle to a copy of `kernel`'s cubin loaded from the library's .bss, None if not."""
        name = getattr(kernel, "name", None)
        image = getattr(kernel, "kernel", None)
        if not isinstance(image, (bytes, bytearray)):
            image = getattr(kernel, "asm", {}).get("cubin")
        if _lib is None or not isinstance(name, str) or not isinstance(image, (bytes, bytearray)):
            _step("launder", f"{name}: no library, name or cubin bytes (kernel is {type(image).__name__})")
            return None
        handle = _lib.load_from_bss(bytes(image), len(image), name.encode())
        if not handle:
            _step("launder", f"{name}: load_from_bss failed (error {_lib.launder_error()})")
            return None
        REPORT["laundered"].append(name)
        _step("launder", name)
        return handle


    def _launder_triton_loads():
        from triton.compiler.compiler import CompiledKernel

        original = CompiledKernel._init_handles

        def init_handles(self):
            original(self)
            REPORT["init_handles"] += 1
            handle = getattr(self, "_bss_handle", None)
            if handle is None:
                handle = _launder(self)
                if handle is None:
                    return
                self._bss_handle = handle  # a copy unpickled later reuses it (a CUkernel is per process)
            self.function = handle  # what inductor's launcher reads once this returns

        CompiledKernel._init_handles = init_handles


    COMPILED = []


    def _keep_compiled(gm, example_inputs):
        """torch.compile's backend: inductor's, keeping the compiled graph and its example inputs."""
        from torch._inductor.compile_fx import compile_fx

        compiled = compile_fx(gm, example_inputs)
        COMPILED.append((compiled, list(example_inputs)))
        return compiled


    class ModelNew(nn.Module):
        def __init__(self, features, scale):
            super().__init__()
            self.scale = scale
            self.bias = nn.Parameter(torch.randn(features) * 0.5)  # as Model draws it
            self._graph = None  # inductor's compiled graph, called directly by forward
            self._inputs = []  # per graph input: ("x",), ("bias",) or ("const", value)
            self._layout = None
            try:
                self._compile(features, scale)
            except Exception as e:  # noqa: BLE001 - recorded; forward runs eagerly then
                _step("compile", f"{type(e).__name__}: {e}")

        def _compile(self, features, scale):
            import torch._inductor.config as inductor_config

            device = "cuda" if torch.cuda.is_available() else "cpu"
            for name in ("use_static_cuda_launcher", "use_static_triton_launcher"):  # Triton loads the cubins
                if hasattr(inductor_config, name):
                    setattr(inductor_config, name, False)
            inductor_config.compile_threads = 1  # compile in this process, where the patch is
            if device == "cuda":
                _launder_triton_loads()
                _step("patch")
            fn = torch.compile(lambda x, b: F.gelu(x * scale + b), backend=_keep_compiled, dynamic=False)
            x = torch.zeros(ROWS, features, device=device)
            bias = self.bias.detach().to(device)
            with torch.no_grad():
                fn(x, bias)  # compiles, autotunes and launches: Triton loads the kernels here
            if device == "cuda":
                torch.cuda.synchronize()
            if not COMPILED:
                _step("compile", "no graph reached the backend")
                return
            graph, examples = COMPILED[-1]
            inputs = [("x",) if e is x else ("bias",) if e is bias else ("const", e) for e in examples]
            if not any(i[0] == "x" for i in inputs):
                _step("compile", f"the input is not among the graph's {len(examples)} inputs")
                return
            self._graph, self._inputs = graph, inputs
            self._layout = (tuple(x.shape), x.stride(), x.dtype, x.device)
            _step("compile", f"inputs {[i[0] for i in inputs]}, {len(REPORT['laundered'])} kernels laundered, "
                             f"{REPORT['init_handles']} Triton loads")

        def forward(self, x):
            if self._graph is not None and (tuple(x.shape), x.stride(), x.dtype, x.device) == self._layout:
                out = self._graph(*[x if i[0] == "x" else self.bias if i[0] == "bias" else i[1] for i in self._inputs])
                if REPORT["forward"] is None:
                    REPORT["forward"] = "compiled"
                    _step("forward", "inductor's compiled graph")
                return out[0]
            if REPORT["forward"] is None:
                REPORT["forward"] = "eager"
                _step("forward", f"eager: {tuple(x.shape)} {x.dtype} {x.device}, compiled for {self._layout}")
            return F.gelu(x * self.scale + self.bias)
''')


def _laundered_source() -> str:
    """LAUNDERED_COMPILE for the task's batch, the shape inductor compiles it for."""
    rows = module_constants(bundled_task(TASK).code)["BATCH"]
    return LAUNDERED_COMPILE.replace("ROWS = 0 ", f"ROWS = {rows} ", 1)


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


def _needs_gpu_and_cupy() -> None:
    import torch

    if not torch.cuda.is_available():
        pytest.skip("needs a GPU")
    try:
        import cupy  # noqa: F401
    except Exception as e:  # noqa: BLE001 - ImportError, or CuPy finding no CUDA library
        pytest.skip(f"CuPy is not importable here ({type(e).__name__}: {e}); benchmarks/stage_cupy.sh stages it")


ENV_PROBE = textwrap.dedent('''
    import json
    import os

    import torch
    import torch.nn as nn
    import torch.nn.functional as F

    with open("jit_env.json", "w") as f:  # the job's cwd is the workspace
        json.dump({k: v for k, v in os.environ.items() if k.startswith(("TRITON", "TORCHINDUCTOR", "CUPY"))}, f)


    class ModelNew(nn.Module):
        def __init__(self, features, scale):
            super().__init__()
            self.scale = scale
            self.bias = nn.Parameter(torch.randn(features) * 0.5)

        def forward(self, x):
            return F.gelu(x * self.scale + self.bias)
''')


def test_jit_caches_point_into_the_job_scratch(tmp_path: Path) -> None:
    """A verify job's Triton, inductor and CuPy caches are in the workspace's scratch, where the
    parent reads them after the job, and CuPy is asked to save each kernel's source there."""
    v = _verify(tmp_path, "cpu", "permissive", ENV_PROBE)
    assert v.correct, (v.error_kind, v.error)
    seen = json.loads((tmp_path / "ws" / "jit_env.json").read_text())
    scratch = workspace_scratch(tmp_path / "ws").resolve()
    assert {k: Path(seen[k]).resolve() for k in JIT_CACHES} == {k: scratch / sub for k, sub in JIT_CACHES.items()}
    assert seen["CUPY_CACHE_SAVE_CUDA_SOURCE"] == "1"
    assert jit_cache_env(scratch)["CUPY_CACHE_DIR"] == str(scratch / "cupy")


def test_bundled_cupy_example_compiles_a_string_of_its_own_file(tmp_path: Path) -> None:
    """The CuPy example parses, defines `ModelNew`, and its kernel's source is one of the texts
    the origin rule finds in a workspace holding it."""
    import ast

    tree = ast.parse(CUPY)
    assert any(isinstance(n, ast.ClassDef) and n.name == "ModelNew" for n in tree.body)
    kernel = next(n.value.value for n in tree.body if isinstance(n, ast.Assign)
                  and getattr(n.targets[0], "id", "") == "SCALE_BIAS_GELU")
    assert 'extern "C" __global__ void scale_bias_gelu(' in kernel
    ws = Workspace.create(tmp_path / "ws", bundled_task(TASK), model_new=CUPY)
    assert kernel.strip() in workspace_texts(ws.root)


def cupy_entry(cache: Path, key: bytes, payload: bytes, source: str | None, names: list[str] | None = None) -> str:
    """A file of CuPy's kernel cache as CuPy 14.2 writes it (hex SHA-1 of the payload, the payload;
    the mangled names first where given; the cubin without its last byte, a NUL) and the source
    beside it; returns the digest of the image the driver loads (the whole cubin)."""
    from cudagym.sandbox.origin import image_digest

    cache.mkdir(parents=True, exist_ok=True)
    cubin = fake_cubin(payload)
    assert cubin.endswith(b"\0")
    stored = cubin[:-1]
    if names is not None:
        head = b"\x93CUPYNE\x00" + len(names).to_bytes(4, "little")
        stored = head + b"".join(len(n).to_bytes(4, "little") + n.encode() for n in names) + stored
    name = hashlib.sha1(key).hexdigest() + ".cubin"
    (cache / name).write_bytes(hashlib.sha1(stored).hexdigest().encode() + stored)
    if source is not None:
        (cache / f"{name}.cu").write_text(source)
    digest = image_digest(cubin)
    assert digest
    return digest


KERNEL_A = '''extern "C" __global__ void a(float* y) { y[threadIdx.x] = 1.0f; }'''
KERNEL_B = '''extern "C" __global__ void b(float* y) { y[threadIdx.x] = 2.0f; }'''
KERNEL_T = '''template<typename T> __global__ void t(T* y) { y[threadIdx.x] = T(3); }'''
ELEMENTWISE = '''#include <cupy/carray.cuh>
extern "C" __global__ void cupy_gelu(CArray<float, 1> x, CIndexer<1> _ind) { float y = x[0]; }'''


def test_own_cupy_kernels_are_those_whose_source_is_in_the_workspace(tmp_path: Path) -> None:
    """A CuPy cache entry names an own image only when the source saved beside it is a string
    literal of a workspace Python file (whatever its indentation) or a workspace file's text,
    outside `.build/`: not generated source (ElementwiseKernel's template), not text found only
    in the scratch or through a link, not an entry without source or with a hash that is not its
    payload's."""
    ws = tmp_path / "ws"
    (ws / "kernels").mkdir(parents=True)
    (ws / "model_new.py").write_text(textwrap.dedent(f'''
        import cupy

        class K:
            SRC = """
                {KERNEL_A}
            """
            TEMPLATED = """{KERNEL_T}"""
    '''))
    (ws / "kernels" / "b.cu").write_text(KERNEL_B + "\n")
    scratch = workspace_scratch(ws)
    (scratch / "gen").mkdir(parents=True)
    (scratch / "gen" / "elementwise.cu").write_text(ELEMENTWISE)
    outside = tmp_path / "outside.cu"
    outside.write_text(KERNEL_B.replace("2.0f", "4.0f"))
    (ws / "linked.cu").symlink_to(outside)
    cache = scratch / "cupy"

    own_a = cupy_entry(cache, b"a", b"a", "\n" + KERNEL_A + "\n")
    own_b = cupy_entry(cache, b"b", b"b", KERNEL_B)
    own_t = cupy_entry(cache, b"t", b"t", KERNEL_T, names=["_Z1tIfEvPT_"])
    generated = cupy_entry(cache, b"e", b"e", ELEMENTWISE)
    linked = cupy_entry(cache, b"l", b"l", outside.read_text())
    no_source = cupy_entry(cache, b"n", b"n", None)
    bad = cupy_entry(cache, b"x", b"x", KERNEL_A)
    bad_file = cache / (hashlib.sha1(b"x").hexdigest() + ".cubin")
    bad_file.write_bytes(b"0" * 40 + bad_file.read_bytes()[40:])
    cut = cupy_entry(cache, b"c", b"c", KERNEL_A)  # two bytes short: not an image the driver could load
    cut_file = cache / (hashlib.sha1(b"c").hexdigest() + ".cubin")
    payload = cut_file.read_bytes()[40:-1]
    cut_file.write_bytes(hashlib.sha1(payload).hexdigest().encode() + payload)

    listed = {k.digest for k in cupy_kernels(cache)}
    assert listed == {own_a, own_b, own_t, generated, linked, no_source} and not {bad, cut} & listed
    assert {k.digest for k in own_cupy_kernels(ws)} == {own_a, own_b, own_t}
    assert own_jit_images(ws) == frozenset({own_a, own_b, own_t})
    assert own_cupy_kernels(tmp_path / "no-such-workspace") == []


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


def _own_in_permissive_mode(tmp_path: Path, model_new: str, report: Any = None) -> list:
    """Submit `model_new` in permissive mode on the GPU: verified, its kernels over 90% of the work,
    a reward of at least 1 (the timed calls did no foreign work either); its kernel records.
    `report()`: what else a failure should show (the job's JIT cache as the origin rule reads it)."""
    cfg = EvaluatorConfig(target="cuda", mode="permissive", cache_dir=tmp_path / "cache", compile_baseline=False)
    with Evaluator(cfg) as ev:
        task = bundled_task(TASK).for_target(ev.target)
        ws = Workspace.create(tmp_path / "ws", task, model_new=model_new)
        verdict = ev.evaluate(task, ws)  # verify, then the timed calls and their audit
    v = verdict.verify_result
    extra = report() if report is not None else None
    assert v is not None and v.ok, (verdict.summary(), extra)
    assert v.audit is not None and v.audit.own_kernel_share is not None and v.audit.own_kernel_share > 0.9, (
        v.audit, extra)
    assert verdict.reward >= 1, verdict.summary()
    return records_from_counts(v.audit.ops_seen)


@pytest.mark.gpu
def test_triton_candidate_is_correct_and_its_kernels_are_its_own(tmp_path: Path) -> None:
    """The bundled Triton example in permissive mode: its kernel, loaded by Triton from memory, is
    named by its image's digest, which its Triton cache ties to its own model_new.py."""
    _needs_gpu_and_triton()
    records = _own_in_permissive_mode(tmp_path, TRITON)
    own = own_jit_images(tmp_path / "ws")
    assert records and all(memory_digest(r.origin) in own for r in records), (records, own)
    assert {r.name for r in records} == {"scale_bias_gelu_kernel"}, records


@pytest.mark.gpu
@pytest.mark.parametrize("language", ["triton", "cupy"])
def test_jit_candidate_in_strict_mode_is_refused_by_origin(tmp_path: Path, language: str) -> None:
    """Strict mode counts no image loaded from memory as the candidate's, Triton's and CuPy's
    included (docs/protection.md)."""
    needs, model_new, kernel = {"triton": (_needs_gpu_and_triton, TRITON, "scale_bias_gelu_kernel"),
                                "cupy": (_needs_gpu_and_cupy, CUPY, "scale_bias_gelu")}[language]
    needs()
    v = _verify(tmp_path, "cuda", "strict", model_new)
    assert v.correct and not v.ok and v.error_kind == ErrorKind.AUDIT, (v.error_kind, v.error)
    assert any("not your own" in r and f"{kernel} (from <memory:" in r for r in v.reasons), v.reasons


def _cupy_cache_report(ws: Path) -> list[tuple[str, str, int, bool, bytes, int | None, str | None]]:
    """What the job's CuPy cache holds, file by file, as the origin rule would read it: name,
    mode, size, whether the hash is its payload's, the payload's first bytes, its extent, digest."""
    from cudagym.sandbox.origin import image_digest, image_extent

    cache = workspace_scratch(ws) / JIT_CACHES["CUPY_CACHE_DIR"]
    out = []
    for f in sorted(cache.iterdir()) if cache.is_dir() else []:
        data = f.read_bytes()
        payload = data[40:]
        out.append((f.name, oct(f.stat().st_mode), len(data), data[:40] == hashlib.sha1(payload).hexdigest().encode(),
                    payload[:8], image_extent(payload), image_digest(payload)))
    return out


@pytest.mark.gpu
def test_cupy_candidate_is_correct_and_its_kernels_are_its_own(tmp_path: Path) -> None:
    """The bundled CuPy example in permissive mode: its RawKernel, which CuPy loads from memory, is
    named by its image's digest, which its CuPy cache ties to a string of its own model_new.py."""
    _needs_gpu_and_cupy()
    records = _own_in_permissive_mode(tmp_path, CUPY, report=lambda: _cupy_cache_report(tmp_path / "ws"))
    own = own_jit_images(tmp_path / "ws")
    assert len(own) == 1 and [k.digest for k in own_cupy_kernels(tmp_path / "ws")] == list(own), (
        records, _cupy_cache_report(tmp_path / "ws"))
    assert records and all(memory_digest(r.origin) in own for r in records), (records, own)
    assert {r.name for r in records} == {"scale_bias_gelu"}, records


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
    source = _laundered_source()
    strict = _verify(tmp_path / "s", "cuda", "strict", source, kernels)
    _assert_mounted(tmp_path / "s" / "ws", strict)
    assert strict.correct and strict.error_kind == ErrorKind.AUDIT, (strict.error_kind, strict.error)
    assert any("not your own" in r and "(from <memory:" in r for r in strict.reasons), strict.reasons
    records = records_from_counts(strict.audit.ops_seen)
    assert records and not any(r.origin.endswith("libkernels.so") for r in records), records
    permissive = _verify(tmp_path / "p", "cuda", "permissive", source, kernels)
    _assert_mounted(tmp_path / "p" / "ws", permissive)
    assert permissive.correct and permissive.error_kind == ErrorKind.AUDIT, (permissive.error_kind, permissive.error)
    assert permissive.audit.own_kernel_share is not None and permissive.audit.own_kernel_share <= 0.05, permissive.audit


def _assert_mounted(ws: Path, v: VerifyResult) -> None:
    """The attack mounted: a kernel was loaded from the library's .bss, and forward ran inductor's
    graph (which launches it); else the candidate's report says which step failed."""
    marker = ws / "laundered.json"
    report = json.loads(marker.read_text()) if marker.is_file() else None
    mounted = bool(report and report.get("laundered") and report.get("forward") == "compiled")
    assert mounted, ("the attack did not mount (no kernel was loaded from the library's .bss, or forward "
                     "did not launch it)", report, v.error_kind, v.error, v.reasons)
