"""Single-file solutions through the evaluator: load_inline/load extensions built by trusted jobs.

Real compiler, real sandboxed workers, CPU target. Most extensions here are small Python C-API
modules built with `load_inline(..., no_implicit_headers=True)` (a second or two each), each
under its own name so that every test makes the compile step build it: a cached module would
let a test pass without the build it is about. The one `torch/extension.h` build (a minute on
two cores) is the example solution, shared by the session's cache.
"""

from __future__ import annotations

import hashlib
import shutil
import subprocess
import uuid
from pathlib import Path

import pytest

from cudagym.rewards.evaluator import Evaluator
from cudagym.core.verdict import ErrorKind
from cudagym.sandbox.inline import InlineBuildCache, InlineCompileError

from conftest import SOLUTIONS, solution_workspace, task_of

TASK = task_of("ew_residual_relu_clamp")  # min(relu(x + residual), clamp_max)

# A Python C-API module whose name is the build's TORCH_EXTENSION_NAME: one source, many names.
EXT_CPP = r"""
#include <Python.h>
#define CAT2(a, b) a##b
#define CAT(a, b) CAT2(a, b)
#define STR2(x) #x
#define STR(x) STR2(x)
static PyObject* residual_relu_clamp(PyObject*, PyObject* args) {
    unsigned long long x, r, o; long long n; double hi;
    if (!PyArg_ParseTuple(args, "KKKLd", &x, &r, &o, &n, &hi)) return nullptr;
    const float* xp = reinterpret_cast<const float*>(x);
    const float* rp = reinterpret_cast<const float*>(r);
    float* op = reinterpret_cast<float*>(o);
    for (long long i = 0; i < n; ++i) {
        float v = xp[i] + rp[i];
        v = v > 0.0f ? v : 0.0f;
        op[i] = v < hi ? v : static_cast<float>(hi);
    }
    Py_RETURN_NONE;
}
static PyMethodDef methods[] = {{"residual_relu_clamp", residual_relu_clamp, METH_VARARGS, ""},
                                {nullptr, nullptr, 0, nullptr}};
static PyModuleDef module = {PyModuleDef_HEAD_INIT, STR(TORCH_EXTENSION_NAME), nullptr, -1, methods};
PyMODINIT_FUNC CAT(PyInit_, TORCH_EXTENSION_NAME)(void) { return PyModule_Create(&module); }
"""

# The helpers every solution below shares; `build()` is where load_inline is called.
HEADER = '''\
import os
import torch
import torch.nn as nn
from torch.utils.cpp_extension import load_inline

CPP = {cpp!r}


def build():
    return load_inline(name="{name}", cpp_sources=CPP, no_implicit_headers=True, extra_cflags=["-O2"])


def fallback(x, residual, clamp_max):
    return torch.clamp(torch.relu(x + residual), max=clamp_max)


def own(ext, x, residual, clamp_max):
    x, residual = x.contiguous(), residual.contiguous()
    out = torch.empty_like(x)
    ext.residual_relu_clamp(x.data_ptr(), residual.data_ptr(), out.data_ptr(), x.numel(), clamp_max)
    return out
'''

BUILT_IN_INIT = HEADER + '''

class ModelNew(nn.Module):
    def __init__(self, clamp_max):
        super().__init__()
        self.clamp_max = clamp_max
        try:
            self.ext = build()
        except Exception:
            self.ext = None

    def forward(self, x, residual):
        if self.ext is None:
            return fallback(x, residual, self.clamp_max)
        return own(self.ext, x, residual, self.clamp_max)
'''

BUILT_ON_FIRST_FORWARD = HEADER + '''

class ModelNew(nn.Module):
    def __init__(self, clamp_max):
        super().__init__()
        self.clamp_max = clamp_max
        self.ext = None
        self.tried = False

    def forward(self, x, residual):
        if not self.tried:
            self.tried = True
            try:
                self.ext = build()
            except Exception:
                pass
        if self.ext is None:
            return fallback(x, residual, self.clamp_max)
        return own(self.ext, x, residual, self.clamp_max)
'''

BUILT_AT_IMPORT = HEADER + '''
try:
    EXT = build()
except Exception:
    EXT = None


class ModelNew(nn.Module):
    def __init__(self, clamp_max):
        super().__init__()
        self.clamp_max = clamp_max

    def forward(self, x, residual):
        if EXT is None:
            return fallback(x, residual, self.clamp_max)
        return own(EXT, x, residual, self.clamp_max)
'''

# Builds only where a file exists that the test writes after the compile step (a code path the
# compile job cannot reach, the way a verify-only shape would be).
BUILT_WHEN_FLAGGED = HEADER + '''

class ModelNew(nn.Module):
    def __init__(self, clamp_max):
        super().__init__()
        self.clamp_max = clamp_max
        self.ext = None
        if os.path.exists(os.path.join(os.path.dirname(__file__), "late.flag")):
            try:
                self.ext = build()
            except Exception:
                pass

    def forward(self, x, residual):
        if self.ext is None:
            return fallback(x, residual, self.clamp_max)
        return own(self.ext, x, residual, self.clamp_max)
'''


def unique(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex[:8]}"


def line_of(source: str, needle: str) -> int:
    """1-based line of the first line of `source` containing `needle`."""
    return next(i for i, line in enumerate(source.splitlines(), 1) if needle in line)


# -- extensions built wherever a solution builds them ---------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("template", [BUILT_IN_INIT, BUILT_ON_FIRST_FORWARD, BUILT_AT_IMPORT],
                         ids=["in_init_with_fallback", "on_first_forward_with_fallback", "at_import_with_fallback"])
def test_extension_is_built_wherever_the_solution_builds_it(evaluator: Evaluator, build_ws, template: str) -> None:
    name = unique("ext")
    ws = build_ws(TASK, template.format(cpp=EXT_CPP, name=name))
    c = evaluator.compile(TASK, ws)
    assert c.ok, c.errors
    assert c.inline_modules == [name] and not c.cached
    v = evaluator.evaluate(TASK, ws)
    # strict mode: the torch fallback would fail the op audit, so a reward means the extension ran
    assert v.reward >= 1, v.summary()
    assert v.audit is not None and v.audit.passed


@pytest.mark.slow
def test_extension_that_does_not_compile_is_a_compile_error_not_a_fallback(evaluator: Evaluator, build_ws) -> None:
    broken = EXT_CPP.replace("float v = xp[i] + rp[i];", "float v = xp[i] + undeclared_r[i];")
    ws = build_ws(TASK, BUILT_IN_INIT.format(cpp=broken, name=unique("broken")))
    v = evaluator.evaluate(TASK, ws)
    assert v.reward < 0 and v.compile_result is not None and not v.compile_result.ok
    errors = v.compile_result.errors
    line = line_of(broken, "undeclared_r")
    assert f"cpp_sources:{line}: error: 'undeclared_r' was not declared in this scope" in errors, errors
    assert not any(str(ws.root) in e for e in errors)


@pytest.mark.slow
def test_extension_that_fails_to_load_is_named_at_compile(evaluator: Evaluator, build_ws) -> None:
    # links (a shared library may leave symbols undefined) but cannot be imported
    unresolved = EXT_CPP.replace("static PyObject* residual_relu_clamp",
                                 'extern "C" float cudagym_no_such_helper(float);\n'
                                 "static PyObject* residual_relu_clamp").replace(
        "op[i] = v < hi ? v : static_cast<float>(hi);", "op[i] = cudagym_no_such_helper(v);")
    name = unique("unresolved")
    source = BUILT_IN_INIT.format(cpp=unresolved, name=name)
    ws = build_ws(TASK, source)
    c = evaluator.compile(TASK, ws)
    assert not c.ok
    site = f"model_new.py:{line_of(source, 'return load_inline(')}"
    assert any(e.startswith(f"extension '{name}' ({site}) failed to load: ImportError")
               and "cudagym_no_such_helper" in e
               and e.endswith("the solution fell back to torch") for e in c.errors), c.errors


@pytest.mark.slow
def test_extension_first_requested_in_verify_is_named_with_its_call_site(evaluator: Evaluator, build_ws) -> None:
    name = unique("late")
    source = BUILT_WHEN_FLAGGED.format(cpp=EXT_CPP, name=name)
    ws = build_ws(TASK, source)
    c = evaluator.compile(TASK, ws)
    assert c.ok and c.inline_modules == [], c
    (ws.root / "late.flag").touch()  # now ModelNew builds the extension: only verify sees it
    v = evaluator.verify(TASK, ws)
    assert not v.ok and v.error_kind == ErrorKind.COMPILE
    site = f"model_new.py:{line_of(source, 'return load_inline(')}"
    assert f"load_inline module '{name}' ({site}) was not built by the compile step" in (v.error or ""), v.error


def test_refused_compiler_flag_is_a_compile_error_naming_it(evaluator: Evaluator, build_ws) -> None:
    source = BUILT_AT_IMPORT.format(cpp=EXT_CPP, name=unique("plugin")).replace(
        'extra_cflags=["-O2"]', 'extra_cflags=["-O2", "-fplugin=./kernels/evil.so"]')
    ws = build_ws(TASK, source)
    c = evaluator.compile(TASK, ws)
    assert not c.ok
    assert any("'-fplugin=./kernels/evil.so' is refused: it loads a plugin into the compiler" in e
               for e in c.errors), c.errors


@pytest.mark.parametrize("field,flags,named", [
    ("extra_cflags", ["-fplugin=/tmp/p.so"], "-fplugin=/tmp/p.so"),
    ("extra_cflags", ["--plugin=/tmp/p.so"], "--plugin=/tmp/p.so"),  # GCC reads --x as -fx
    ("extra_cflags", ["-specs=/tmp/s"], "-specs=/tmp/s"),
    ("extra_cflags", ["-B/tmp/bin"], "-B/tmp/bin"),
    ("extra_cflags", ["-wrapper", "/tmp/w"], "-wrapper"),
    ("extra_cflags", ["-isystem", "kernels"], "-isystem 'kernels'"),
    ("extra_cflags", ["-idirafter/tmp/inc"], "-idirafter '/tmp/inc'"),
    ("extra_cflags", ["-MF", "/dev/null"], "-MF"),
    ("extra_cflags", ["-Wp,-MMD,/tmp/d"], "-Wp,-MMD,/tmp/d"),
    ("extra_cflags", ["kernels/table.o"], "kernels/table.o"),
    ("extra_cflags", ["@/tmp/options"], "@/tmp/options"),
    ("extra_cflags", ["-O3; touch /tmp/pwned"], "-O3; touch /tmp/pwned"),
    ("extra_cuda_cflags", ["-ccbin", "/tmp/cc"], "-ccbin"),
    ("extra_cuda_cflags", ["--compiler-bindir=/tmp"], "--compiler-bindir=/tmp"),
    ("extra_cuda_cflags", ["-Xcompiler", "-fplugin=/tmp/p.so"], "-fplugin=/tmp/p.so"),
    ("extra_cuda_cflags", ["--run"], "--run"),
    ("extra_ldflags", ["-L/tmp/lib"], "-L '/tmp/lib'"),
    ("extra_ldflags", ["-Wl,-rpath,/tmp/lib"], "-Wl,-rpath,/tmp/lib"),
    ("extra_ldflags", ["-Wl,--script=/tmp/x.ld"], "-Wl,--script=/tmp/x.ld"),
    ("extra_ldflags", ["/tmp/evil.a"], "/tmp/evil.a"),
    ("extra_ldflags", ["-l:../evil.a"], "-l:../evil.a"),
])
def test_flags_that_escape_the_manifest_are_refused(tmp_path: Path, field: str, flags: list[str], named: str) -> None:
    cache = InlineBuildCache(tmp_path / "cache")
    request = {"kind": "load_inline", "site": "model_new.py:7",
               "args": {"name": "ext", "cpp_sources": "int f() { return 1; }", field: flags}}
    with pytest.raises(InlineCompileError, match="is refused") as e:
        cache.prepare(request, tmp_path)
    assert str(e.value).startswith("load_inline module 'ext' (model_new.py:7): ") and named in str(e.value)


def test_ordinary_flags_are_accepted(tmp_path: Path) -> None:
    cache = InlineBuildCache(tmp_path / "cache")
    args = {"name": "ext", "cpp_sources": "int f() { return 1; }", "extra_include_paths": ["kernels"],
            "extra_cflags": ["-O3", "-march=native -ffast-math", "-fopenmp", "-DTILE=16", "-Ikernels", "--std=c++17"],
            "extra_cuda_cflags": ["-O3", "--use_fast_math", "-Xptxas", "-v", "-Xcompiler=-fopenmp,-O3",
                                  "-gencode=arch=compute_90a,code=sm_90a", "--expt-relaxed-constexpr", "-lineinfo"],
            "extra_ldflags": ["-lgomp", "-Wl,--no-as-needed", "-fopenmp"]}
    build = cache.prepare({"kind": "load_inline", "site": "model_new.py:3", "args": args}, tmp_path)
    # the key sees what changes the module and only that
    again = cache.prepare({"kind": "load_inline", "site": "model_new.py:9",
                           "args": {**args, "verbose": True, "build_directory": "/tmp/elsewhere"}}, tmp_path)
    other = cache.prepare({"kind": "load_inline", "site": "model_new.py:3",
                           "args": {**args, "extra_cflags": ["-O2"]}}, tmp_path)
    assert build.key == again.key != other.key


# -- the cache: keyed by every file the build read; not writable by candidate code ---------------


LOAD_CXX = r"""
#include "table.inc"
""" + EXT_CPP.replace("op[i] = v < hi ? v : static_cast<float>(hi);",
                      "op[i] = SCALE * (v < hi ? v : static_cast<float>(hi));")

LOAD_MODEL = '''\
import torch
import torch.nn as nn
from torch.utils.cpp_extension import load

# a .cxx file: torch's loader compiles it; the compile tool's kernels/ build (.cpp/.cc/.c/.cu) does not
EXT = load(name="{name}", sources=["kernels/ext.cxx"], extra_cflags=["-O2"])


class ModelNew(nn.Module):
    def __init__(self, clamp_max):
        super().__init__()
        self.clamp_max = clamp_max

    def forward(self, x, residual):
        x, residual = x.contiguous(), residual.contiguous()
        out = torch.empty_like(x)
        EXT.residual_relu_clamp(x.data_ptr(), residual.data_ptr(), out.data_ptr(), x.numel(), self.clamp_max)
        return out
'''


def check_included_file_gets_its_own_module(evaluator: Evaluator, build_ws) -> None:
    """The same load() call over another included file builds again, and its wrong output is a
    mismatch (shared with the docker backend's test)."""
    model = LOAD_MODEL.format(name=unique("scaled"))
    good = build_ws(TASK, model, {"kernels/ext.cxx": LOAD_CXX,
                                  "kernels/table.inc": "static const float SCALE = 1.0f;\n"})
    zeros = build_ws(TASK, model, {"kernels/ext.cxx": LOAD_CXX,
                                   "kernels/table.inc": "static const float SCALE = 0.0f;\n"})
    first = evaluator.compile(TASK, good)
    assert first.ok and not first.cached, first.errors
    second = evaluator.compile(TASK, zeros)
    assert second.ok and not second.cached, second.errors  # built again: same call, other table.inc
    v = evaluator.evaluate(TASK, zeros)
    assert v.reward < 0 and v.error_kind == ErrorKind.MISMATCH, v.summary()


@pytest.mark.slow
def test_load_source_whose_included_file_differs_gets_its_own_module(evaluator: Evaluator, build_ws) -> None:
    check_included_file_gets_its_own_module(evaluator, build_ws)


ATTACKER = '''\
import json
import os
import torch
import torch.nn as nn
from torch.utils.cpp_extension import load_inline  # noqa: F401 - the compile step runs this file

INLINE = {inline!r}


def attack():
    """Replace every cached file, plant a variant under every key and a new key; log each refusal."""
    outcomes = []

    def attempt(what, action):
        try:
            action()
            outcomes.append(f"{{what}}: done")
        except OSError as e:
            outcomes.append(f"{{what}}: {{type(e).__name__}}")

    def overwrite(path):
        with open(path, "w") as out:
            out.write(json.dumps({{"name": "evil", "file": "evil.so", "python_module": True}}))

    def plant(key_dir):
        os.makedirs(os.path.join(key_dir, "0" * 32))  # sorts before every real variant
        with open(os.path.join(key_dir, "0" * 32, "deps.json"), "w") as out:
            out.write(json.dumps({{"deps": {{}}}}))

    for root, dirs, files in list(os.walk(INLINE)):
        for f in files:
            path = os.path.join(root, f)
            attempt(f"write {{f}}", lambda: overwrite(path))
            attempt(f"replace {{f}}", lambda: os.replace(path, path + ".old"))
        if root.count(os.sep) == INLINE.count(os.sep) + 1:
            attempt("plant a variant", lambda: plant(root))
    attempt("plant a key", lambda: os.makedirs(os.path.join(INLINE, "f" * 64, "0" * 32)))
    with open(os.path.join(os.path.dirname(__file__), "attack.log"), "a") as log:  # its own workspace
        log.write("\\n".join(outcomes) + "\\n")


attack()


class ModelNew(nn.Module):
    def __init__(self, clamp_max):
        super().__init__()
        attack()
        self.clamp_max = clamp_max

    def forward(self, x, residual):
        return torch.clamp(torch.relu(x + residual), max=self.clamp_max)
'''


def snapshot(root: Path) -> dict[str, str]:
    return {p.relative_to(root).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest() if p.is_file() else "dir"
            for p in sorted(root.rglob("*"))}


@pytest.mark.slow
def test_candidate_code_cannot_write_the_inline_cache(evaluator: Evaluator, build_ws, tmp_path: Path) -> None:
    victim = solution_workspace(tmp_path / "victim", TASK, SOLUTIONS / TASK.id / "cpu_inline")
    c = evaluator.compile(TASK, victim)  # torch/extension.h: built once per session's cache
    assert c.ok and c.inline_modules == ["residual_relu_clamp_cpu"], c.errors
    inline = Path(evaluator.config.cache_dir) / "build" / "inline"
    before = snapshot(inline)
    assert any(k.endswith("residual_relu_clamp_cpu.so") for k in before)
    attacker = build_ws(TASK, ATTACKER.format(inline=str(inline)))
    evaluator.compile(TASK, attacker)  # runs the attack at import and in __init__
    v = evaluator.verify(TASK, attacker)  # and again in verify's worker
    assert not v.ok
    log = (attacker.root / "attack.log").read_text().splitlines()
    assert any(line.startswith("write meta.json") for line in log) and any("plant a variant" in line for line in log)
    assert all(line.endswith(": PermissionError") for line in log), log  # the sandbox refused each one
    assert snapshot(inline) == before  # nothing written, replaced or planted
    assert evaluator.evaluate(TASK, victim).reward >= 1


# -- the build file of torch's loader, rewritten to record every dependency ---------------------


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc is not installed")
def test_rewritten_build_file_records_every_dependency_of_cxx_and_nvcc_compiles(tmp_path: Path,
                                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """torch's own writer makes the build file (its nvcc taken from PYTORCH_NVCC, as this CPU-only
    torch has no CUDA_HOME); after the rewrite, ninja's compiles leave .d and .asd files naming a
    header hidden behind a system-header pragma and a file the assembler embeds."""
    import torch.utils.cpp_extension as cpp

    from cudagym.sandbox.deps import parse_depfile
    from cudagym.sandbox.inline.job import _track_all_dependencies

    ws = tmp_path / "ws"
    (ws / "kernels").mkdir(parents=True)
    (ws / "kernels" / "hide.h").write_text('#pragma GCC system_header\n#include "table.inc"\n')
    (ws / "kernels" / "table.inc").write_text("static const int T = 3;\n")
    (ws / "kernels" / "blob.bin").write_bytes(b"\x01\x02")
    embed = f'asm(".section .rodata\\n.incbin \\"{ws}/kernels/blob.bin\\"\\n.text");\n'
    (ws / "kernels" / "a.cpp").write_text('#include "hide.h"\n' + embed + "int host() { return T; }\n")
    (ws / "kernels" / "k.cu").write_text('#include "hide.h"\n' + embed + "__global__ void k(int* x) { *x = T; }\n")
    build = tmp_path / "build"
    build.mkdir()
    monkeypatch.setenv("PYTORCH_NVCC", shutil.which("nvcc"))
    cpp._write_ninja_file(path=str(build / "build.ninja"), cflags=["-O2"], post_cflags=None,
                          cuda_cflags=["-O2", "-arch=sm_90a", "--compiler-options", "'-fPIC'"], cuda_post_cflags=None,
                          cuda_dlink_post_cflags=None, sycl_cflags=None, sycl_post_cflags=None,
                          sycl_dlink_post_cflags=None,
                          sources=[str(ws / "kernels" / "a.cpp"), str(ws / "kernels" / "k.cu")],
                          objects=["a.o", "k.cuda.o"], ldflags=[], library_target=None, with_cuda=True, with_sycl=False)
    _track_all_dependencies(build / "build.ninja", gnu_as=True)
    run = subprocess.run(["ninja", "-C", str(build)], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout + run.stderr
    for obj in ("a.o", "k.cuda.o"):
        deps = parse_depfile((build / f"{obj}.d").read_text()) + parse_depfile((build / f"{obj}.asd").read_text())
        assert {str(ws / "kernels" / f) for f in ("table.inc", "blob.bin")} <= set(deps), (obj, deps)


REWRITES_ITS_INPUT = '''\
import time
import torch.nn as nn
from torch.utils.cpp_extension import load

with open("kernels/table.inc", "w") as f:  # a new value on every run, the compile step's included
    f.write(f"static const float SCALE = {{time.time_ns() % 1000}}.5f;\\n")
EXT = load(name="{name}", sources=["kernels/ext.cxx"])


class ModelNew(nn.Module):
    def __init__(self, clamp_max):
        super().__init__()

    def forward(self, x, residual):
        return x
'''


@pytest.mark.slow
def test_extension_whose_inputs_change_while_compiling_is_a_compile_error(evaluator: Evaluator, build_ws) -> None:
    name = unique("moving")
    ws = build_ws(TASK, REWRITES_ITS_INPUT.format(name=name), {"kernels/ext.cxx": LOAD_CXX})
    c = evaluator.compile(TASK, ws)
    assert not c.ok
    assert c.errors == [f"load module '{name}' (model_new.py:7) is in the build cache, but model_new.py did not "
                        "find it there: the files it is built from changed while the compile step ran"], c.errors
