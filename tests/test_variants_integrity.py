"""The contrastive variant book against a candidate whose jobs write its workspace (issue 27,
points 5 and 6), tried for real through KernelEnv on the CPU target: a profile that rewrites
model_new.py once measured, and a profile that floods kernels/. The book records what was
measured, and it, its file and the prompt's excerpt stay bounded."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from cudagym.env.kernel_env import KernelEnv
from cudagym.env.variants import BookLimits, ContrastiveConfig, Variant, VariantBook
from cudagym.rewards.evaluator import Evaluator
from cudagym.tasks.loaders import bundled_task

from conftest import SOLUTIONS, backend_config

TASK = "ew_scale_bias_gelu"
SOLUTION = SOLUTIONS / TASK / "cpu"
KERNEL = "kernels/scale_bias_gelu.cpp"

BACKEND_FIXTURES = ("own_evaluator",)


@pytest.fixture(scope="module")
def own_evaluator(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    ev = Evaluator(backend_config(request.param, tmp_path_factory.mktemp("variants-cache")))
    try:
        yield ev
    finally:
        ev.close()


def call(name: str, **arguments: object) -> str:
    return f'<tool_call>{json.dumps({"name": name, "arguments": arguments})}</tool_call>'


def write_solution(env: KernelEnv, model_new: str) -> None:
    kernel = (SOLUTION / KERNEL).read_text()
    obs, *_ = env.step(call("write_file", path="model_new.py", content=model_new)
                       + call("write_file", path=KERNEL, content=kernel))
    assert obs.count("[write_file] Wrote") == 2, obs


# Once it runs in a job (verify, profile), the honest solution replaces its own model_new.py with
# code that was never measured (the marker is assembled at run time: it is not in this source).
REWRITE = '''\
import os as _os

_me = _os.path.abspath(__file__)
with open(_me, "w") as _f:
    _f.write("# " + "FA" + "KE: never measured\\n" + "import torch\\nclass ModelNew(torch.nn.Module):\\n"
             "    def __init__(self, *a):\\n        super().__init__()\\n"
             "    def forward(self, x):\\n        return x\\n")

'''


@pytest.mark.both_backends
def test_the_book_records_the_files_the_profile_measured(own_evaluator: Evaluator, tmp_path: Path,
                                                         request: pytest.FixtureRequest) -> None:
    book = VariantBook(tmp_path / "variants.jsonl")
    env = KernelEnv(tasks=[bundled_task(TASK)], evaluator=own_evaluator, workspace_root=tmp_path / "ws",
                    variant_book=book, contrastive=ContrastiveConfig(keep=3))
    env.reset(options={"task": TASK})
    honest = REWRITE + (SOLUTION / "model_new.py").read_text()
    write_solution(env, honest)
    obs, *_ = env.step(call("profile"))
    assert "[profile] ModelNew:" in obs and "Speedup vs eager" in obs, obs
    local = "docker" not in request.node.callspec.id
    ws_now = (env.workspace.root / "model_new.py").read_text()
    if local:  # the job rewrote it; a docker job works on a copy, which never comes back
        assert ws_now.startswith("# FAKE") and "changed files of the workspace while it ran (model_new.py)" in obs
    else:
        assert ws_now == honest
    [variant] = book.best(TASK, 5)
    assert variant.files == {"model_new.py": honest, KERNEL: (SOLUTION / KERNEL).read_text()}
    assert variant.correct and variant.speedup_vs_eager
    env.close()
    # the next round's prompt shows what was measured, never the rewrite
    again = VariantBook(tmp_path / "variants.jsonl")
    nxt = KernelEnv(tasks=[bundled_task(TASK)], evaluator=own_evaluator, workspace_root=tmp_path / "ws2",
                    variant_book=again, contrastive=ContrastiveConfig(keep=3))
    prompt, _ = nxt.reset(options={"task": TASK})
    assert '"KE: never measured' in prompt and "# FAKE" not in prompt
    nxt.close()


# Every job that runs it floods kernels/ (the book's limits are far below what it writes; the
# build's, 64 MiB, are not reached, so the solution still compiles and is measured).
FLOOD = '''\
import os as _os

_k = _os.path.join(_os.path.dirname(_os.path.abspath(__file__)), "kernels")
for _i in range(24):
    with open(_os.path.join(_k, f"flood{_i:03d}.txt"), "w") as _f:
        _f.write("x" * (1 << 20))
for _i in range(80):
    with open(_os.path.join(_k, f"note{_i:03d}.txt"), "w") as _f:
        _f.write("n" * 1000)

'''


def test_a_profile_that_floods_kernels_leaves_the_book_and_prompt_bounded(evaluator: Evaluator,
                                                                           tmp_path: Path) -> None:
    limits = BookLimits()
    book_file = tmp_path / "variants.jsonl"
    con = ContrastiveConfig(keep=3, book=book_file)
    env = KernelEnv(tasks=[bundled_task(TASK)], evaluator=evaluator, workspace_root=tmp_path / "ws", contrastive=con)
    env.reset(options={"task": TASK})
    write_solution(env, FLOOD + (SOLUTION / "model_new.py").read_text())
    for _ in range(3):  # the first measures the files as written; the next ones the flood too
        obs, *_ = env.step(call("profile"))
        assert "[profile] ModelNew:" in obs, obs
    assert len(list((env.workspace.root / "kernels").iterdir())) == 105  # the flood is there
    variants = env.variants.best(TASK, 10)
    assert len(variants) == 2  # the same files measured again keep one entry
    flooded = next(v for v in variants if v.left_out)
    assert len(flooded.files) <= limits.max_files
    assert sum(len(t.encode()) for t in flooded.files.values()) <= limits.max_variant_bytes
    assert "model_new.py" in flooded.files and KERNEL in flooded.files
    assert any("flood000.txt (over the limit of 65536 bytes per file)" in x for x in flooded.left_out)
    assert flooded.left_out[-1].startswith("and ") and len(flooded.left_out) <= 11
    assert env.variants.total_bytes <= 2 * limits.max_variant_bytes
    assert book_file.stat().st_size <= 4 * 2 * limits.max_variant_bytes  # JSON of two bounded variants
    block = env.variants.render(TASK, 3, con.max_variant_chars)
    assert len(block) <= 3 * (con.max_variant_chars + 4000)
    assert "(not recorded: " in block
    env.close()


def _variant(i: int, speed: float, size: int = 10, task: str = "t") -> Variant:
    return Variant(task_id=task, episode="e", files={"model_new.py": f"# {i}\n" + "y" * size}, correct=True,
                   speedup_vs_eager=speed, reasons=["r" * 5000])


def test_the_book_keeps_the_best_within_its_limits(tmp_path: Path) -> None:
    limits = BookLimits(max_variants_per_task=5, max_book_bytes=40_000, max_variant_bytes=10_000,
                        max_file_bytes=9_000)
    book = VariantBook(tmp_path / "v.jsonl", limits)
    for i in range(20):
        book.add(_variant(i, speed=float(i % 7)))
    kept = book.best("t", 50)
    assert len(kept) == 5 and sorted(v.speedup_vs_eager for v in kept) == [5.0, 5.0, 5.0, 6.0, 6.0]
    assert all(len(r) <= limits.max_reason_chars + 4 for v in kept for r in v.reasons)
    for i in range(10):  # big variants of other tasks: the book's total stays under its bound
        book.add(_variant(i, speed=1.0, size=8_000, task=f"u{i}"))
    assert book.total_bytes <= limits.max_book_bytes
    big = _variant(99, 9.0, size=20_000)
    book.add(big)
    assert book.best("t", 1)[0].files == {} and book.best("t", 1)[0].left_out == [
        "model_new.py (over the book's limits)"]
    assert (tmp_path / "v.jsonl").stat().st_size <= 2 * limits.max_book_bytes + 20_000  # rewritten as it grew
    again = VariantBook(tmp_path / "v.jsonl", limits)
    assert [v.digest for v in again.best("t", 5)] == [v.digest for v in book.best("t", 5)]


def test_a_book_file_with_an_oversize_line_is_read_without_it(tmp_path: Path) -> None:
    path = tmp_path / "v.jsonl"
    ok = _variant(1, 2.0).model_dump_json()
    huge = _variant(2, 3.0, size=8 << 20).model_dump_json()  # written before the book had limits
    path.write_text(huge + "\n" + ok + "\n")
    book = VariantBook(path)
    assert [v.files["model_new.py"][:4] for v in book.best("t", 5)] == ["# 1\n"]
    assert path.stat().st_size < 1 << 20  # rewritten with what it keeps


def test_a_snapshot_never_opens_a_fifo_or_follows_a_symlink(tmp_path: Path) -> None:
    import os

    from cudagym.env.variants import snapshot_files
    from cudagym.sandbox.workspace import Workspace

    ws = Workspace.create(tmp_path / "ws", bundled_task(TASK))
    ws.write("model_new.py", "import torch\n")
    os.mkfifo(ws.root / "kernels" / "a.h")  # a job can make one; reading it would block the env
    (tmp_path / "secret").write_text("outside the workspace\n")
    os.symlink(tmp_path / "secret", ws.root / "kernels" / "b.h")
    snap = snapshot_files(ws)
    assert snap.files == {"model_new.py": "import torch\n"}
    assert snap.left_out == ["kernels/b.h (not a regular file)"]  # the FIFO is not even listed
    os.unlink(ws.root / "kernels" / "b.h")
    (ws.root / "kernels" / "b.h").write_text("now a file\n")
    assert snap.changed_in(ws) == ["kernels/b.h"]
