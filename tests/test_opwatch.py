"""The op watcher against real torch: the library is compiled with g++ and loaded; nothing is mocked."""

from __future__ import annotations

import ctypes
import json
import os
import subprocess
import sys
import textwrap
import threading
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from cudagym.errors import ToolchainError
from cudagym.core.audit import forbidden_ops
from cudagym.sandbox.worker.integrity import OpRecorder
from cudagym.sandbox.opwatch import OpWatch, build_library

REPO = Path(__file__).resolve().parent.parent

# A stand-in for a candidate's C++: ATen calls through `at::`, and the switches that would blind
# the watcher.
CANDIDATE_CPP = """\
#include <ATen/ops/mul.h>
#include <ATen/ops/ones.h>
#include <ATen/record_function.h>

extern "C" {
long long mul_through_aten() { auto a = at::ones({4}); return at::mul(a, a).numel(); }
void set_record_function(int on) { at::enableRecordFunction(on != 0); }
void clear_callbacks() { at::clearCallbacks(); }
}
"""


@pytest.fixture(scope="session")
def opwatch_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("opwatch-cache")


@pytest.fixture(scope="session")
def watch(opwatch_cache: Path) -> OpWatch:
    return OpWatch.load(opwatch_cache)


@pytest.fixture(scope="session")
def candidate_lib(opwatch_cache: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    src = tmp_path_factory.mktemp("candidate") / "candidate.cpp"
    src.write_text(CANDIDATE_CPP)
    return build_library(opwatch_cache, source=src)


def watched(watch: OpWatch, fn: Callable[[], object]) -> Counter[str]:
    """The counts of one armed call of `fn`."""
    watch.reset()
    watch.arm()
    try:
        fn()
    finally:
        watch.disarm()
    return watch.counts()


def recorded(fn: Callable[[], object]) -> Counter[str]:
    """What the harness's dispatch-mode recorder sees of one call of `fn`."""
    rec = OpRecorder()
    with rec:
        fn()
    return rec.ops


def test_counts_ops_by_the_name_the_dispatch_mode_gives(watch: OpWatch) -> None:
    x, y = torch.randn(4, 4), torch.randn(4, 4)

    def forward() -> None:
        torch.add(x, y)
        torch.add(x, y)
        x.mul_(y)
        F.gelu(x)

    assert watched(watch, forward) == Counter({"aten::add": 2, "aten::mul_": 1, "aten::gelu": 1})
    assert recorded(forward) == Counter({"aten::add": 2, "aten::mul_": 1, "aten::gelu": 1})
    overloads = {(op.name, op.overload) for op in watch.ops()}
    assert overloads == {("aten::add", "Tensor"), ("aten::mul_", "Tensor"), ("aten::gelu", "")}
    assert watch.check_alive() is None


def test_counts_only_while_armed_and_until_reset(watch: OpWatch) -> None:
    x = torch.randn(4)
    watch.reset()
    torch.sin(x)  # disarmed: not counted
    watch.arm()
    torch.cos(x)
    watch.disarm()
    torch.tan(x)
    watch.arm()
    torch.cos(x)
    watch.disarm()
    assert watch.counts() == Counter({"aten::cos": 2})
    watch.reset()
    assert watch.counts() == Counter()
    assert watch.ops() == []
    assert watch.check_alive() is None


def test_counts_every_op_of_every_thread(watch: OpWatch) -> None:
    x = torch.randn(4)
    per_thread, threads = 2000, 4

    def work() -> None:
        for _ in range(per_thread):
            torch.sin(x)

    def forward() -> None:
        pool = [threading.Thread(target=work) for _ in range(threads)]
        for t in pool:
            t.start()
        for t in pool:
            t.join()

    assert watched(watch, forward) == Counter({"aten::sin": per_thread * threads})


def test_counts_aten_calls_from_cpp(watch: OpWatch, candidate_lib: Path) -> None:
    lib = ctypes.CDLL(str(candidate_lib))
    lib.mul_through_aten.restype = ctypes.c_longlong
    counts = watched(watch, lib.mul_through_aten)
    assert counts["aten::mul"] == 1 and counts["aten::ones"] == 1
    assert forbidden_ops(counts) == forbidden_ops(recorded(lib.mul_through_aten)) == ["aten::mul"]


def _honest_forward(x: torch.Tensor) -> Callable[[], object]:
    """What a forward around a candidate's own kernel does with torch: allocate, view, copy."""
    def forward() -> object:
        out = torch.empty_like(x)
        flat = x.contiguous().view(-1)
        scratch = x.new_zeros(x.shape[0]).unsqueeze(1)
        same = x.float()  # already float32: `aten::to` returns x itself
        eval_dropout = F.dropout(x, p=0.5, training=False)
        parts = x.t().contiguous().chunk(2)
        flag = torch.tensor([1.0])  # built on the host (with a device, its copy is `aten::_to_copy`)
        return out, flat, scratch, same, eval_dropout, parts, flag, x[0, 0].item(), x[:, 1:].reshape(-1)
    return forward


def _forwards(x: torch.Tensor, w: torch.Tensor) -> dict[str, Callable[[], object]]:
    def in_no_grad() -> object:
        with torch.no_grad():
            return x * 2

    def on_a_thread() -> object:
        t = threading.Thread(target=lambda: torch.exp(x))
        t.start()
        t.join()

    return {
        "honest": _honest_forward(x),
        "add": lambda: x + w,
        "scalar add": lambda: x + 1,
        "in-place": lambda: x.clone().add_(w),
        "matmul": lambda: torch.matmul(x, w),
        "linear": lambda: F.linear(x, w),
        "gelu": lambda: F.gelu(x),
        "no_grad": in_no_grad,
        "cast": lambda: x.to(torch.float64),
        "thread": on_a_thread,
    }


FORWARD_NAMES = list(_forwards(torch.zeros(1, 1), torch.zeros(1, 1)))


def _classify_like_the_dispatch_mode(watch: OpWatch, device: str, name: str) -> None:
    x = torch.randn(8, 8, device=device)
    w = torch.randn(8, 8, device=device)
    fn = _forwards(x, w)[name]
    mine = forbidden_ops(watched(watch, fn))
    theirs = forbidden_ops(recorded(fn))
    if name == "thread":  # a dispatch mode is per thread: it misses the other thread's op
        assert theirs == [] and mine == ["aten::exp"]
        return
    assert bool(mine) == bool(theirs), (mine, theirs)
    # the watcher also sees ops that kernels call inside themselves: never fewer
    assert set(theirs) <= set(mine), (mine, theirs)
    assert (name == "honest") == (mine == [])


@pytest.mark.parametrize("name", FORWARD_NAMES)
def test_audit_classifies_like_the_dispatch_mode(watch: OpWatch, name: str) -> None:
    _classify_like_the_dispatch_mode(watch, "cpu", name)


@pytest.mark.gpu
@pytest.mark.parametrize("name", FORWARD_NAMES)
def test_audit_classifies_like_the_dispatch_mode_on_cuda(watch: OpWatch, name: str) -> None:
    _classify_like_the_dispatch_mode(watch, "cuda", name)


def test_decomposed_ops_are_left_out_of_the_counts(watch: OpWatch) -> None:
    x = torch.randn(4, 4)
    watched(watch, lambda: (F.dropout(x, training=False), x.t().reshape(-1)))
    ops = {op.name: op for op in watch.ops()}
    # CompositeImplicitAutograd on CPU and CUDA: functions that call other ops (or none)
    assert ops["aten::dropout"].decomposes and ops["aten::reshape"].decomposes
    assert not ops["aten::clone"].decomposes and not ops["aten::_unsafe_view"].decomposes
    counts = watch.counts()
    assert "aten::dropout" not in counts and "aten::reshape" not in counts
    assert counts["aten::clone"] == 1 and counts["aten::_unsafe_view"] == 1


def _run_python(code: str) -> dict:
    """Run `code` in a fresh interpreter (the switches it tries cannot be undone); its JSON line."""
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    r = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                       env=env, timeout=300)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout.strip().splitlines()[-1])


def test_check_alive_names_python_switches(opwatch_cache: Path, watch: OpWatch) -> None:
    out = _run_python(f"""
        import ctypes, json, torch
        from pathlib import Path
        from cudagym.sandbox.opwatch import OpWatch
        w = OpWatch.load(Path({str(opwatch_cache)!r}))
        x = torch.randn(4)
        seen = {{"fresh": w.check_alive()}}
        w.arm()
        torch._C._autograd._enable_record_function(False)
        torch.sin(x)  # unseen
        seen["switched off"] = w.check_alive()
        torch._C._autograd._enable_record_function(True)
        seen["switched on"] = w.check_alive()
        ctypes.CDLL(str(w.library)).opwatch_reset()  # a candidate reaching the library itself
        seen["foreign reset"] = w.check_alive()
        w = OpWatch(w.library)
        seen["reloaded"] = w.check_alive()
        torch._C._autograd._clear_callbacks()
        seen["cleared"] = w.check_alive()
        print(json.dumps(seen))
    """)
    assert out["fresh"] is None and out["switched on"] is None and out["reloaded"] is None
    assert "switched off" in out["switched off"]
    assert "other than the harness" in out["foreign reset"]
    assert "no longer runs" in out["cleared"]


def test_check_alive_names_cpp_switches(opwatch_cache: Path, watch: OpWatch, candidate_lib: Path) -> None:
    out = _run_python(f"""
        import ctypes, json, torch
        from pathlib import Path
        from cudagym.sandbox.opwatch import OpWatch
        w = OpWatch.load(Path({str(opwatch_cache)!r}))
        cand = ctypes.CDLL({str(candidate_lib)!r})
        w.arm()
        cand.set_record_function(0)
        torch.sin(torch.randn(4))
        seen = {{"switched off": w.check_alive(), "counts while off": dict(w.counts())}}
        cand.set_record_function(1)
        seen["switched on"] = w.check_alive()
        cand.clear_callbacks()
        seen["cleared"] = w.check_alive()
        print(json.dumps(seen))
    """)
    assert "switched off" in out["switched off"] and out["counts while off"] == {}
    assert out["switched on"] is None
    assert "no longer runs" in out["cleared"]


def _logging_compiler(tmp_path: Path) -> tuple[Path, Path]:
    """A g++ wrapper that logs each compile (not the `--version` probe) to a file."""
    log = tmp_path / "compiles.log"
    cxx = tmp_path / "logged-g++"
    cxx.write_text(f'#!/bin/sh\n[ "$1" = --version ] || echo "$@" >> {log}\nexec g++ "$@"\n')
    cxx.chmod(0o755)
    return cxx, log


def test_build_is_cached_and_concurrent_builders_agree(tmp_path: Path) -> None:
    src = tmp_path / "tiny.cpp"
    src.write_text('extern "C" int tiny() { return 7; }\n')
    cxx, log = _logging_compiler(tmp_path)
    cache = tmp_path / "cache"
    paths: list[Path] = []
    builders = [threading.Thread(target=lambda: paths.append(build_library(cache, source=src, cxx=str(cxx))))
                for _ in range(3)]
    for t in builders:
        t.start()
    for t in builders:
        t.join()
    assert len(paths) == 3 and len(set(paths)) == 1 and paths[0].name == "libtiny.so"
    assert ctypes.CDLL(str(paths[0])).tiny() == 7
    assert sorted(p.name for p in (cache / "opwatch").iterdir()) == [paths[0].parent.name]  # no leftovers
    compiles = log.read_text().count("\n")
    assert compiles >= 1

    assert build_library(cache, source=src, cxx=str(cxx)) == paths[0]
    assert log.read_text().count("\n") == compiles  # the second load compiled nothing

    src.write_text('extern "C" int tiny() { return 8; }\n')
    rebuilt = build_library(cache, source=src, cxx=str(cxx))
    assert rebuilt != paths[0] and ctypes.CDLL(str(rebuilt)).tiny() == 8


def test_build_errors_raise_with_the_compiler_message(tmp_path: Path) -> None:
    src = tmp_path / "broken.cpp"
    src.write_text("int broken( { return 1; }\n")
    with pytest.raises(ToolchainError, match=r"building broken\.cpp failed(.|\n)*error"):
        build_library(tmp_path / "cache", source=src)
    assert not any((tmp_path / "cache" / "opwatch").iterdir())  # nothing half-built left behind
