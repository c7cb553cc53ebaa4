"""What one episode's jobs can do to the shared build cache (issue 27, points 1 and 2), tried for
real: precompiled headers and other stray compiler inputs planted by a candidate's job, an object
the size of the disk, a cache past its bound, a cache entry changed after it was stored.

Real compilers, real sandboxed jobs, CPU target; each evaluator here has a cache of its own, so
the attacker's build is the first of its source (a poisoned object would be the one filed)."""

from __future__ import annotations

import ctypes
import shutil
import subprocess
import textwrap
from pathlib import Path

import pytest

from cudagym.rewards.evaluator import Evaluator
from cudagym.sandbox.deps import OUTPUTS_FILE
from cudagym.sandbox.inline import SOURCE_COPY, InlineBuildCache
from cudagym.sandbox.toolchain import CacheBound, Toolchain, ToolchainConfig
from cudagym.sandbox.workspace import Workspace
from cudagym.tasks.model import Target

from conftest import SOLUTIONS, backend_config, solution_workspace, task_of

TASK = task_of("ew_scale_bias_gelu")  # its kernel includes <cmath> and calls std::erf
SOLUTION = SOLUTIONS / TASK.id / "cpu"
KERNEL = "kernels/scale_bias_gelu.cpp"
CXX_FLAGS = ["-O3", "-std=c++17", "-fPIC", "-fopenmp", "-march=native"]  # the toolchain's C++ flags

BACKEND_FIXTURES = ("own_evaluator",)


@pytest.fixture
def own_evaluator(request: pytest.FixtureRequest, tmp_path: Path):
    ev = Evaluator(backend_config(request.param, tmp_path / "cache"))
    try:
        yield ev
    finally:
        ev.close()


def precompiled_headers(out: Path) -> Path:
    """Precompiled <cmath> (std::erf replaced by a function returning 1) and <cstdint>, built with
    the toolchain's flags so that GCC takes them where it finds them."""
    out.mkdir()
    (out / "cmath").write_text("#include_next <cmath>\n"
                               "namespace std { inline float cudagym_erf(float) { return 1.0f; } }\n"
                               "#define erf cudagym_erf\n")
    (out / "cstdint").write_text("#include_next <cstdint>\n")
    for name in ("cmath", "cstdint"):
        subprocess.run(["g++", *CXX_FLAGS, "-x", "c++-header", str(out / name), "-o", str(out / f"{name}.gch")],
                       check=True, capture_output=True, timeout=300)
    return out


# At import, in every job that runs it: plant the precompiled headers in its own kernels/ (one as
# a file, one in a .gch directory) and a FIFO; the rest is the honest solution.
PLANT = '''\
import os as _os
import shutil as _shutil

_K = _os.path.join(_os.path.dirname(_os.path.abspath(__file__)), "kernels")
try:
    _shutil.copy({pch!r} + "/cmath.gch", _K + "/cmath.gch")
    _os.makedirs(_K + "/cstdint.gch", exist_ok=True)
    _shutil.copy({pch!r} + "/cstdint.gch", _K + "/cstdint.gch/x")
    if not _os.path.exists(_K + "/table.inc"):
        _os.mkfifo(_K + "/table.inc")
except OSError:
    pass  # docker: the host's files are out of reach

'''


@pytest.mark.both_backends
def test_planted_precompiled_headers_leave_the_victims_verdict_alone(own_evaluator: Evaluator, tmp_path: Path,
                                                                    request: pytest.FixtureRequest) -> None:
    ev = own_evaluator
    pch = precompiled_headers(tmp_path / "pch")
    attacker = solution_workspace(tmp_path / "attacker", TASK, SOLUTION)  # the victim's exact source
    attacker.write("model_new.py", PLANT.format(pch=str(pch)) + (SOLUTION / "model_new.py").read_text())
    honest = (SOLUTION / KERNEL).read_text()
    attacker.write(KERNEL, honest + "// another version first\n")
    ev.verify(TASK, attacker)  # the candidate's job plants them
    attacker.write(KERNEL, honest)  # then the victim's exact source, never built in this cache
    kernels = attacker.root / "kernels"
    local = "docker" not in request.node.callspec.id
    if local:
        assert (kernels / "cmath.gch").is_file() and (kernels / "cstdint.gch" / "x").is_file()
        # the attack is real: GCC, run in that workspace as the toolchain ran it before, takes the
        # poisoned <cmath> (one precompiled header per compile: the first include's)
        probe = subprocess.run(["g++", *CXX_FLAGS, "-Ikernels", "-H", "-fsyntax-only", KERNEL], cwd=attacker.root,
                               capture_output=True, text=True, timeout=300)
        assert probe.stderr.startswith("! kernels/cmath.gch\n"), probe.stderr
    else:  # a docker job works on a copy of the workspace: nothing it writes comes back
        assert not (kernels / "cmath.gch").exists()

    built = ev.compile(TASK, attacker)  # the first build of this source in this cache
    assert built.ok and built.compiled == [KERNEL], built
    if local:
        assert "kernels/cmath.gch (a precompiled header)" in built.log
        assert "kernels/cstdint.gch/ (precompiled headers)" in built.log
        assert "kernels/table.inc (not a regular file)" in built.log
    attacker_verdict = ev.evaluate(TASK, attacker)
    assert attacker_verdict.correct and attacker_verdict.reward >= 1, attacker_verdict.summary()

    victim = solution_workspace(tmp_path / "victim", TASK, SOLUTION)
    c = ev.compile(TASK, victim)
    assert c.ok and c.compiled == [] and c.reused == [KERNEL]  # the object built in the attacker's workspace
    v = ev.evaluate(TASK, victim)
    assert v.correct and v.reward >= 1, v.summary()
    assert v.reward == attacker_verdict.reward or abs(v.reward - attacker_verdict.reward) <= 1  # timing may differ


def make_ws(root: Path, files: dict[str, str | bytes]) -> Workspace:
    (root / "kernels").mkdir(parents=True, exist_ok=True)
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(text) if isinstance(text, bytes) else path.write_text(textwrap.dedent(text))
    return Workspace(root)


SCALED = 'extern "C" float scaled(float x) { return 2.0f * x; }\n'


def test_a_file_that_only_exists_changes_the_key(tmp_path: Path) -> None:
    # __has_include reads nothing: the build's copy of kernels/ is keyed by its names too
    src = ('#if __has_include("flag.h")\nextern "C" int f() { return 1; }\n'
           '#else\nextern "C" int f() { return 0; }\n#endif\n')
    tc = Toolchain(tmp_path / "cache")
    plain = tc.build(make_ws(tmp_path / "plain", {"kernels/a.cpp": src}), Target.CPU)
    flagged = tc.build(make_ws(tmp_path / "flagged", {"kernels/a.cpp": src, "kernels/flag.h": ""}), Target.CPU)
    assert plain.ok and flagged.ok and flagged.compiled == ["kernels/a.cpp"]
    results = [ctypes.CDLL(str(Path(r.artifact_dir) / "libkernels.so")).f() for r in (plain, flagged)]
    assert results == [0, 1]


def test_an_oversize_object_fails_its_build_only_and_the_cache_stays_small(tmp_path: Path) -> None:
    # the case with the default settings: one initialized 1 GiB array
    tc = Toolchain(tmp_path / "cache")
    big = make_ws(tmp_path / "big", {"kernels/big.cpp": 'static char big[1u << 30] = {1};\n'
                                                          'extern "C" char* get() { return big; }\n'})
    res = tc.build(big, Target.CPU)
    assert not res.ok
    assert res.errors == ["kernels/big.cpp: error: the build's output is over the limit of 256 MiB per file "
                          "(ToolchainConfig.max_output_mb); a large initialized array or table belongs in memory "
                          "allocated at run time"]
    assert tc.bound.total_bytes() < 1 << 20
    assert not [p for p in (tmp_path / "cache").rglob("*") if p.is_file() and p.stat().st_size > 1 << 20]
    assert not list((tmp_path / "cache" / "src").iterdir())  # the build's private copy is gone
    ok = tc.build(make_ws(tmp_path / "ok", {"kernels/a.cpp": SCALED}), Target.CPU)
    assert ok.ok and ctypes.CDLL(str(Path(ok.artifact_dir) / "libkernels.so")).scaled  # the next build is unaffected


def test_a_linked_library_over_the_limit_is_refused(tmp_path: Path) -> None:
    # objects of 6 MiB each link into a library over an 8 MiB limit
    tc = Toolchain(tmp_path / "cache", ToolchainConfig(max_output_mb=8))
    files = {f"kernels/part{i}.cpp": f'static char t{i}[6 << 20] = {{1}};\n'
                                     f'extern "C" char* get{i}() {{ return t{i}; }}\n'
             for i in range(2)}
    res = tc.build(make_ws(tmp_path / "ws", files), Target.CPU)
    assert not res.ok and res.errors[0].startswith("link: error: the build's output is over the limit of 8 MiB")


def sized(i: int, kib: int = 600) -> dict[str, str]:
    """A workspace whose object and library are each about `kib` KiB."""
    return {"kernels/a.cpp": f'extern "C" {{ char table[{kib} << 10] = {{{i + 1}}}; '
                             'int get() { return table[0]; } }\n'}


def test_the_cache_is_bounded_by_evicting_the_least_recently_used(tmp_path: Path) -> None:
    tc = Toolchain(tmp_path / "cache", ToolchainConfig(max_cache_mb=3, evict_grace_s=0))
    build = {i: (lambda i=i: tc.build(make_ws(tmp_path / f"ws{i}", sized(i)), Target.CPU)) for i in range(3)}
    assert build[0]().ok and build[1]().ok  # ~2.4 MiB: both kept
    assert build[0]().cached  # used again: now more recent than 1
    third = build[2]()  # past 3 MiB: the least recently used (1) goes
    assert third.ok and tc.bound.total_bytes() <= 3 << 20
    again0, again1 = build[0](), build[1]()
    assert again0.cached and not again1.cached and again1.compiled == ["kernels/a.cpp"]
    assert tc.bound.total_bytes() <= 3 << 20
    got = ctypes.CDLL(str(Path(again1.artifact_dir) / "libkernels.so")).get()
    assert got == 2


def test_the_bound_spares_entries_in_use(tmp_path: Path) -> None:
    tc = Toolchain(tmp_path / "cache", ToolchainConfig(max_cache_mb=1, evict_grace_s=3600))
    for i in range(3):
        assert tc.build(make_ws(tmp_path / f"ws{i}", sized(i)), Target.CPU).ok
    assert len(tc.bound.entries()) == 6  # all used within the grace period: none evicted
    assert CacheBound(tc.cache_dir, 1 << 20, 0).enforce()  # without it, down to the bound
    assert tc.bound.total_bytes() <= 1 << 20


def test_cache_entries_are_read_only_and_checked_when_used(tmp_path: Path) -> None:
    tc = Toolchain(tmp_path / "cache")
    first = tc.build(make_ws(tmp_path / "ws", {"kernels/a.cpp": SCALED}), Target.CPU)
    assert first.ok
    entries = [p for p in (tmp_path / "cache").rglob("*") if p.is_file()]
    assert entries and all(p.stat().st_mode & 0o222 == 0 for p in entries)
    assert {p.name for p in entries if p.name == OUTPUTS_FILE}
    obj = next((tmp_path / "cache" / "objects").rglob("object.o"))
    obj.chmod(0o644)
    obj.write_bytes(obj.read_bytes().replace(b"\x00\x00\x00\x40", b"\x00\x00\x00\x41"))  # 2.0f -> 2.x
    lib = Path(first.artifact_dir) / "libkernels.so"
    lib.chmod(0o644)
    lib.write_bytes(lib.read_bytes() + b"\0")
    again = tc.build(make_ws(tmp_path / "ws2", {"kernels/a.cpp": SCALED}), Target.CPU)
    assert again.ok and again.compiled == ["kernels/a.cpp"]  # neither changed entry was used
    assert ctypes.CDLL(str(Path(again.artifact_dir) / "libkernels.so")).scaled is not None
    f = ctypes.CDLL(str(Path(again.artifact_dir) / "libkernels.so")).scaled
    f.restype, f.argtypes = ctypes.c_float, [ctypes.c_float]
    assert f(3.0) == 6.0


def test_sources_over_the_bound_are_a_clear_error(tmp_path: Path) -> None:
    tc = Toolchain(tmp_path / "cache", ToolchainConfig(max_source_mb=1, max_source_files=8))
    flood = {f"kernels/junk{i}.txt": b"x" * (300 << 10) for i in range(4)}
    res = tc.build(make_ws(tmp_path / "big", {"kernels/a.cpp": SCALED, **flood}), Target.CPU)
    assert not res.ok and "hold more than 1 MiB" in res.errors[0]
    many = {f"kernels/n{i}.h": "" for i in range(9)}
    res = tc.build(make_ws(tmp_path / "many", {"kernels/a.cpp": SCALED, **many}), Target.CPU)
    assert not res.ok and "more than 8 files" in res.errors[0]


def test_an_inline_build_job_reads_a_clean_copy_of_the_workspace(tmp_path: Path) -> None:
    ws = make_ws(tmp_path / "ws", {"model_new.py": "# uses load()\n", "kernels/ext.cxx": "int f();\n",
                                   "kernels/ext.h": "int g();\n"})
    (ws.root / "kernels" / "cmath.gch").write_bytes(b"gpch+014" + b"\0" * 64)
    (ws.root / "kernels" / "notes.gch.txt").write_bytes(b"gpch" + b"\0" * 8)  # a PCH by its content
    (ws.root / "stray.cpp").write_text("int stray;\n")  # written by a job: outside what is declared
    cache = InlineBuildCache(tmp_path / "cache")
    from cudagym.sandbox.inline import InlineBuild

    build = InlineBuild("load", {"name": "ext", "sources": ["kernels/ext.cxx", "stray.cpp"],
                                 "extra_include_paths": ["kernels", str(ws.root)]}, "model_new.py:1", "k" * 64)
    staging = cache.staging()
    req = cache.job_request(build, ws.root, staging)
    copy = staging / SOURCE_COPY
    assert req["args"]["sources"] == [str(copy / "kernels/ext.cxx"), str(copy / "stray.cpp")]
    assert req["args"]["extra_include_paths"] == [str(copy / "kernels"), str(copy)]
    held = sorted(p.relative_to(copy).as_posix() for p in copy.rglob("*") if p.is_file())
    assert held == ["kernels/ext.cxx", "kernels/ext.h", "model_new.py"]
    shutil.rmtree(staging)


def test_an_inline_request_on_workspace_files_is_keyed_by_their_names(tmp_path: Path) -> None:
    ws = make_ws(tmp_path / "ws", {"model_new.py": "# uses load()\n", "kernels/ext.cxx": "int f();\n"})
    cache = InlineBuildCache(tmp_path / "cache")
    on_files = {"kind": "load", "args": {"name": "ext", "sources": ["kernels/ext.cxx"]}, "site": "model_new.py:1"}
    inline = {"kind": "load_inline", "args": {"name": "ext", "cpp_sources": ["int f();"]}, "site": "model_new.py:1"}

    def keys() -> tuple[str, str]:
        return cache.prepare(on_files, ws.root).key, cache.prepare(inline, ws.root).key

    first = keys()
    (ws.root / "kernels" / "flag.h").write_text("")  # read by nothing: __has_include("flag.h") sees it
    flagged = keys()
    assert flagged[0] != first[0] and flagged[1] == first[1]  # a request on no workspace file is not affected
    (ws.root / "kernels" / "flag.h").unlink()
    (ws.root / "kernels" / "cmath.gch").write_bytes(b"gpch+014")  # never copied, so not in the key either
    (ws.root / "kernels" / "__pycache__").mkdir()
    (ws.root / "kernels" / "__pycache__" / "x.pyc").write_bytes(b"\0")
    assert keys() == first


# -- files whose contents depend on the process that reads them (red team 2, A4 and A8) -------------

VALUE = 'extern "C" float value() {{ return VALUE; }}\n'


def value_of(result) -> float:
    f = ctypes.CDLL(str(Path(result.artifact_dir) / "libkernels.so")).value
    f.restype = ctypes.c_float
    return f()


def test_an_include_through_proc_self_cwd_is_a_compile_error_and_poisons_nothing(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # The compiler reads /proc/self/cwd/... in its own working directory (the build's copy of the
    # workspace); the evaluator would hash it in its own. Run from a directory holding the honest
    # header, as the evaluator might be: once, the attacker's header went unrecorded there.
    tc = Toolchain(tmp_path / "cache")
    src = '#include "/proc/self/cwd/kernels/impl.h"\n' + VALUE.format()
    honest_dir = make_ws(tmp_path / "evaluator_cwd", {"kernels/impl.h": "#define VALUE 1.0f\n"})
    monkeypatch.chdir(honest_dir.root)
    attacker = make_ws(tmp_path / "attacker", {"kernels/a.cpp": src, "kernels/impl.h": "#define VALUE -1.0f\n"})
    res = tc.build(attacker, Target.CPU)
    assert not res.ok
    assert res.errors == ["kernels/a.cpp: error: '/proc/self/cwd/kernels/impl.h': kernels may not include files under "
                          "/proc, /dev or /sys (what such a file holds depends on the process that reads it); include "
                          "headers by a path relative to the source or to kernels/"]
    assert not [p for p in (tmp_path / "cache").rglob("*") if p.is_file()]  # nothing stored
    # a victim with the identical source and an honest header gets the same error, never the
    # attacker's object; with a plain include it builds and computes its own value
    victim = make_ws(tmp_path / "victim", {"kernels/a.cpp": src, "kernels/impl.h": "#define VALUE 1.0f\n"})
    again = tc.build(victim, Target.CPU)
    assert not again.ok and again.compiled == ["kernels/a.cpp"] and "/proc, /dev or /sys" in again.errors[0]
    victim.write("kernels/a.cpp", '#include "impl.h"\n' + VALUE.format())
    ok = tc.build(victim, Target.CPU)
    assert ok.ok and value_of(ok) == 1.0


def test_a_symlink_into_proc_and_a_missing_dependency_are_compile_errors(tmp_path: Path) -> None:
    tc = Toolchain(tmp_path / "cache")
    link = tmp_path / "elsewhere"
    link.symlink_to("/proc/self/cwd")  # outside the workspace: an absolute include through it
    ws = make_ws(tmp_path / "ws", {"kernels/a.cpp": f'#include "{link}/kernels/impl.h"\n' + VALUE.format(),
                                   "kernels/impl.h": "#define VALUE 2.0f\n"})
    res = tc.build(ws, Target.CPU)
    assert not res.ok and "kernels may not include files under /proc, /dev or /sys" in res.errors[0], res.errors
    # a dependency gone before it could be hashed (here: the depfile names a file that is not
    # there) is never left out of the manifest silently
    from cudagym.sandbox.deps import Roots, UnrecordedDependencyError, record

    with pytest.raises(UnrecordedDependencyError, match="could not be recorded"):
        record(["kernels/gone.h"], cwd=ws.root, workspace=ws.root, trusted=Roots(["/usr/include"]))
    assert record([], cwd=ws.root, workspace=ws.root, trusted=Roots(()), assembler=["a.cpp"]) == {}  # as's .file


def test_an_inline_module_including_through_proc_self_cwd_is_refused(tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    # the trusted build job's real load_inline (no torch headers: fast); then the parent's store
    import torch.utils.cpp_extension as cpp

    from cudagym.sandbox.inline import InlineBuild, InlineCompileError, build_extension

    for attr in ("_write_ninja_file", "_import_module_from_library"):  # build_extension replaces them: restored
        monkeypatch.setattr(cpp, attr, getattr(cpp, attr))
    for var in ("CC", "CXX", "PYTORCH_NVCC", "TORCH_EXTENSION_SKIP_NVCC_GEN_DEPENDENCIES"):
        monkeypatch.delenv(var, raising=False)

    ws = make_ws(tmp_path / "ws", {"model_new.py": "# load_inline\n", "kernels/impl.h": "#define VALUE -1.0f\n"})
    cache = InlineBuildCache(tmp_path / "cache")
    src = '#include "/proc/self/cwd/../ws/kernels/impl.h"\n' + VALUE.format()
    build = InlineBuild("load_inline", {"name": "procext", "cpp_sources": [src], "is_python_module": False,
                                        "no_implicit_headers": True, "extra_include_paths": ["kernels"]},
                        "model_new.py:3", "p" * 64)
    staging = cache.staging()
    try:
        build_extension(cache.job_request(build, ws.root, staging), staging / "build")  # it compiles
        with pytest.raises(InlineCompileError, match=r"/proc/self/cwd/\.\./ws/kernels/impl\.h'.*under /proc"):
            cache.store(build, staging, staging / "build", ws.root)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    assert not cache.cached(build, ws.root)
    assert not [p for p in cache.root.rglob("*") if p.is_file()]


# -- one build's output is bounded, and so is what the grace period keeps (red team 2, A1) ---------


def test_one_builds_objects_over_its_limit_fail_it_and_nothing_is_stored(tmp_path: Path) -> None:
    tc = Toolchain(tmp_path / "cache", ToolchainConfig(max_build_output_mb=2, max_jobs=2))
    files = {f"kernels/p{i}.cpp": f'extern "C" {{ char t{i}[700 << 10] = {{{i + 1}}}; }}\n' for i in range(4)}
    res = tc.build(make_ws(tmp_path / "flood", files), Target.CPU)
    assert not res.ok
    assert res.errors[0].startswith("kernels: error: the build's output is over the limit of 2 MiB for one build "
                                    "(ToolchainConfig.max_build_output_mb)"), res.errors
    assert tc.bound.total_bytes() == 0
    assert not [p for p in (tmp_path / "cache").rglob("*") if p.is_file()]
    # objects within the limit whose library takes the build past it: nothing kept either
    two = {k: v for k, v in files.items() if k[-5] in "01"}
    res = tc.build(make_ws(tmp_path / "two", two), Target.CPU)
    assert not res.ok and res.errors[0].startswith("link: error: the build's output is over the limit of 2 MiB"), res
    assert tc.bound.total_bytes() == 0
    ok = tc.build(make_ws(tmp_path / "ok", {"kernels/a.cpp": SCALED}), Target.CPU)
    assert ok.ok


def test_the_grace_period_keeps_the_cache_within_one_builds_output_of_its_bound(tmp_path: Path) -> None:
    tc = Toolchain(tmp_path / "cache", ToolchainConfig(max_cache_mb=1, evict_grace_s=3600, max_build_output_mb=2))
    for i in range(5):  # each ~1.2 MiB, all inside the grace period
        res = tc.build(make_ws(tmp_path / f"ws{i}", sized(i)), Target.CPU)
        assert res.ok
        assert tc.bound.total_bytes() <= (1 + 2) << 20
        assert ctypes.CDLL(str(Path(res.artifact_dir) / "libkernels.so")).get() == i + 1  # its own library kept
    assert len(tc.bound.entries()) < 10


def test_dependency_named_in_a_container_is_read_at_its_host_path() -> None:
    from cudagym.sandbox.deps import host_path

    paths = {"/cudagym/job/w0": "/cache/.staging-1", "/cudagym/job/ws": "/runs/ws"}
    assert host_path("/cudagym/job/w0/src/kernels/a.cuh", paths) == "/cache/.staging-1/src/kernels/a.cuh"
    assert host_path("/cudagym/job/w0", paths) == "/cache/.staging-1"
    assert host_path("/cudagym/job/w01/x.h", paths) == "/cudagym/job/w01/x.h"  # not under w0
    assert host_path("/usr/include/stdio.h", paths) == "/usr/include/stdio.h"
    assert host_path("main.cpp", paths) == "main.cpp"
