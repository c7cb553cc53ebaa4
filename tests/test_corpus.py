"""The ops corpus: seed catalog, composer, reproducible and resumable builds, the CLI."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from cudagym.tasks.corpus.build import BuildConfig, build_corpus
from cudagym.tasks.corpus.catalog import BLOCK_SOURCES, default_catalog
from cudagym.tasks.corpus.composer import Composer, ComposerConfig
from cudagym.tasks.loaders import check_task_builds, load_parquet
from cudagym.tasks.model import CORPUS_SOURCE, OWN_TOLERANCE, Task, module_constants, validate_reference_source

N = 16


def test_catalog_covers_the_required_operator_families():
    cat = default_catalog()
    ops = [o for o in cat.ops if o.category != "block"]
    blocks = [o for o in cat.ops if o.category == "block"]
    assert len(ops) >= 80 and len(blocks) >= 8
    names = set(cat.names)
    for nd in (1, 2, 3):
        assert {f"nn.Conv{nd}d", f"nn.ConvTranspose{nd}d", f"nn.MaxPool{nd}d", f"nn.AvgPool{nd}d"} <= names
    assert {"nn.Linear", "torch.matmul", "torch.bmm", "nn.LayerNorm", "nn.GroupNorm", "nn.BatchNorm2d",
            "nn.Softmax", "nn.LogSoftmax", "torch.sum", "nn.MSELoss", "F.cross_entropy", "nn.GELU"} <= names
    cats = Counter(o.category for o in ops)
    for c in ("conv", "linear", "pool", "norm", "activation", "reduction", "softmax", "elementwise", "indexing",
              "loss"):
        assert cats[c] >= 3, c
    assert all(o.block in BLOCK_SOURCES for o in blocks)


def test_composer_is_deterministic_and_emits_kernelbench_format():
    c1, c2 = Composer(), Composer()
    tasks = [c1.compose(7, i) for i in range(12)]
    assert [t.code for t in tasks] == [c2.compose(7, i).code for i in range(12)]
    assert tasks[0].code != Composer().compose(8, 0).code
    for t in tasks:
        validate_reference_source(t.code)
        consts = module_constants(t.code)
        assert consts and all(k.isupper() for k in consts)
        assert set(t.cpu_sizes) <= set(consts) and "BATCH" in t.cpu_sizes
        assert "class Model(nn.Module)" in t.code and 1 <= len(t.ops) <= 5


def test_composed_tasks_run_at_cpu_sizes():
    comp = Composer()
    for i in range(6):
        t = comp.compose(1, i)
        check_task_builds(Task(id=f"t{i}", code=t.code, cpu_sizes=t.cpu_sizes))


def test_op_count_distribution_is_configurable():
    comp = Composer(ComposerConfig(op_count_weights={4: 1.0}))
    counts = Counter(len(comp.compose(3, i).ops) for i in range(6))
    assert counts == {4: 6}
    default = Counter(len(t.ops) for t in (Composer().compose(0, i) for i in range(40)))
    assert default[2] >= 25  # ~84% two-op chains


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("corpus") / "a"
    build_corpus(BuildConfig(n=N, seed=0, shard_size=8), out, progress=False)
    return out


def test_build_writes_ops6k_parquet_and_report(built):
    table = pq.read_table(built / "tasks.parquet")
    assert table.num_rows == N
    for col in ("ops", "data_source", "code", "id", "seed", "level", "flops", "bytes", "est_ms",
                "nearest_bench_file", "bench_similarity"):
        assert col in table.column_names
    rows = table.to_pylist()
    assert all(1.0 <= r["est_ms"] <= 100.0 and r["flops"] > 0 and r["level"] == len(r["ops"]) for r in rows)
    report = json.loads((built / "report.json").read_text())
    assert report["n_built"] == N
    assert report["candidates"] == N + sum(report["removed"].values())
    assert sum(report["op_count_histogram"].values()) == N
    tasks = load_parquet(built / "tasks.parquet")
    assert [t.id for t in tasks] == [r["id"] for r in rows] and tasks[0].ops == rows[0]["ops"]
    # our own tasks keep our tolerance (fp32 1e-4), not the KernelBench default of other parquet files
    assert all(t.source == CORPUS_SOURCE and t.effective_tolerance == OWN_TOLERANCE[t.dtype] for t in tasks)


def test_same_seed_gives_identical_parquet(built, tmp_path):
    build_corpus(BuildConfig(n=N, seed=0, shard_size=8), tmp_path / "b", progress=False)
    assert (tmp_path / "b" / "tasks.parquet").read_bytes() == (built / "tasks.parquet").read_bytes()


def test_resume_reuses_finished_shards_and_gives_the_same_parquet(built, tmp_path):
    out = tmp_path / "c"
    out.mkdir()
    (out / "shards").mkdir()
    shards = sorted((built / "shards").glob("shard_*.json"))
    assert len(shards) >= 2
    for s in shards[:-1]:  # a crash after all shards but the last
        (out / "shards" / s.name).write_bytes(s.read_bytes())
    (out / "build.json").write_bytes((built / "build.json").read_bytes())
    report = build_corpus(BuildConfig(n=N, seed=0, shard_size=8), out, progress=False)
    assert report["shards_reused"] == len(shards) - 1
    assert (out / "tasks.parquet").read_bytes() == (built / "tasks.parquet").read_bytes()


def test_parallel_workers_give_the_same_parquet(built, tmp_path):
    build_corpus(BuildConfig(n=N, seed=0, shard_size=8, workers=2), tmp_path / "w", progress=False)
    assert (tmp_path / "w" / "tasks.parquet").read_bytes() == (built / "tasks.parquet").read_bytes()


def test_cli_stats_show_list_and_calibrate_error(built):
    from typer.testing import CliRunner

    from cudagym.cli import app

    runner = CliRunner()
    r = runner.invoke(app, ["tasks", "stats", str(built)])
    assert r.exit_code == 0 and "removed" in r.output and "ops per task" in r.output
    first = pq.read_table(built / "tasks.parquet").column("id")[0].as_py()
    r = runner.invoke(app, ["tasks", "show", str(built), first])
    assert r.exit_code == 0 and "class Model" in r.output
    r = runner.invoke(app, ["tasks", "list", str(built / "tasks.parquet")])
    assert r.exit_code == 0 and first in r.output
    import torch

    if not torch.cuda.is_available():
        r = runner.invoke(app, ["tasks", "build", "--n", "2", "--out", str(built.parent / "x"), "--calibrate"])
        assert r.exit_code == 2 and "CUDA" in r.output and not (built.parent / "x").exists()
    r = runner.invoke(app, ["tasks", "build", "--help"])
    assert r.exit_code == 0 and "--reference-bench" in r.output


def test_selfcheck_verifies_sampled_tasks_through_the_env(built, tmp_path, monkeypatch):
    """The reference as the candidate verifies in permissive mode; strict mode rejects it (torch ops)."""
    from typer.testing import CliRunner

    monkeypatch.setenv("CUDAGYM_CACHE", str(tmp_path / "cache"))

    from cudagym.cli import app
    from cudagym.selfcheck import reference_as_candidate

    r = CliRunner().invoke(app, ["tasks", "selfcheck", str(built), "--sample", "2", "--target", "cpu"])
    assert r.exit_code == 0, r.output
    summary = json.loads((built / "selfcheck.json").read_text())
    assert summary["sampled"] == 2 and summary["passed"] == 2
    r = CliRunner().invoke(app, ["tasks", "selfcheck", str(built), "--sample", "1", "--target", "cpu",
                                 "--mode", "strict"])
    assert r.exit_code == 1
    summary = json.loads((built / "selfcheck.json").read_text())
    assert summary["passed"] == 0 and "strict mode" in summary["rows"][0]["reason"]
    with pytest.raises(ValueError):
        reference_as_candidate("import torch\n")


TINY_TASKS = {
    "1_Tiny_ReLU.py": '''import torch
import torch.nn as nn


class Model(nn.Module):
    def __init__(self):
        super().__init__()

    def forward(self, x):
        return torch.relu(x)


def get_inputs():
    return [torch.randn(64, 32)]


def get_init_inputs():
    return []
''',
    "2_Tiny_Linear_Tanh.py": '''import torch
import torch.nn as nn


class Model(nn.Module):
    def __init__(self, features):
        super(Model, self).__init__()
        self.linear = nn.Linear(features, features)

    def forward(self, x):
        return torch.tanh(self.linear(x))


def get_inputs():
    return [torch.randn(16, 24)]


def get_init_inputs():
    return [24]
''',
}


def test_selfcheck_of_a_kernelbench_directory_runs_concurrently_and_resumes(tmp_path, monkeypatch):
    """A KernelBench-layout directory (level*/ files) self-checks whole (--sample 0), two tasks at
    a time; its rows are kept as they end, and a second run with the same settings runs none again."""
    from typer.testing import CliRunner

    from cudagym.cli import app

    monkeypatch.setenv("CUDAGYM_CACHE", str(tmp_path / "cache"))
    level = tmp_path / "bench" / "level1"
    level.mkdir(parents=True)
    for name, code in TINY_TASKS.items():
        (level / name).write_text(code)
    report = tmp_path / "kb.json"
    args = ["tasks", "selfcheck", str(tmp_path / "bench"), "--sample", "0", "--target", "cpu",
            "--concurrency", "2", "--report", str(report)]
    r = CliRunner().invoke(app, args)
    assert r.exit_code == 0, r.output
    summary = json.loads(report.read_text())
    assert (summary["sampled"], summary["passed"], summary["resumed"]) == (2, 2, 0)
    rows = report.with_suffix(".rows.jsonl").read_text().splitlines()
    assert json.loads(rows[0])["settings"]["mode"] == "permissive" and len(rows) == 3
    r = CliRunner().invoke(app, args)
    assert r.exit_code == 0, r.output
    summary = json.loads(report.read_text())
    assert (summary["sampled"], summary["passed"], summary["resumed"]) == (2, 2, 2)
    assert {row["id"] for row in summary["rows"]} == {"1_Tiny_ReLU", "2_Tiny_Linear_Tanh"}
    # other settings start the rows again: strict mode rejects a reference made of torch ops
    r = CliRunner().invoke(app, [*args[:-2], "--report", str(report), "--mode", "strict"])
    assert r.exit_code == 1
    summary = json.loads(report.read_text())
    assert (summary["passed"], summary["resumed"]) == (0, 0)
    r = CliRunner().invoke(app, ["tasks", "selfcheck", str(tmp_path / "nothing-here")])
    assert r.exit_code != 0
