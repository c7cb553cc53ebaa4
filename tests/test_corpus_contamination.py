"""Contamination: copies and near-variants of reference files are removed, the rest kept."""

from __future__ import annotations

import json
import re

import pyarrow.parquet as pq
import pytest

from cudagym.tasks.corpus.build import BuildConfig, build_corpus
from cudagym.tasks.corpus.composer import Composer
from cudagym.tasks.corpus.contamination import ReferenceIndex, code_similarity, normalized_tokens

UNRELATED = {
    "notes.py": "# just notes\nprint('hello')\n",
    "resnet_like.py": '''
import torch
import torch.nn as nn


class Block(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.a = nn.Conv2d(c, c, 3, padding=1)
        self.b = nn.BatchNorm2d(c)
        self.c = nn.Conv2d(c, c, 3, padding=1)
        self.d = nn.BatchNorm2d(c)

    def forward(self, x):
        y = torch.relu(self.b(self.a(x)))
        return torch.relu(x + self.d(self.c(y)))


class Model(nn.Module):
    def __init__(self, c, classes):
        super().__init__()
        self.stem = nn.Conv2d(3, c, 7, stride=2, padding=3)
        self.blocks = nn.Sequential(*[Block(c) for _ in range(4)])
        self.head = nn.Linear(c, classes)

    def forward(self, x):
        x = self.blocks(torch.relu(self.stem(x)))
        return self.head(x.mean(dim=(2, 3)))


def get_inputs():
    return [torch.randn(8, 3, 224, 224)]


def get_init_inputs():
    return [64, 1000]
''',
    "broken.py": "def (:\n",
}


def _variant(code: str, kind: str) -> str:
    """A near-copy: renamed variables, changed constants, reordered imports, extra comments."""
    if kind == "renamed":
        for old, new in (("x", "hidden"), ("conv", "layer"), ("linear", "proj"), ("block", "blk"), ("y", "other")):
            code = re.sub(rf"\b{old}\b", new, code)
        return code
    if kind == "constants":
        out = []
        for line in code.splitlines():
            if line and line.split(" = ")[0].isupper() and " = " in line:
                name, val = line.split(" = ")
                line = f"{name} = {int(val) * 2 + 1}"
            out.append(line)
        return "\n".join(out)
    if kind == "imports":
        return code.replace("import torch\nimport torch.nn as nn\nimport torch.nn.functional as F\n",
                            "import torch.nn.functional as F\nimport torch.nn as nn\nimport torch\n")
    if kind == "comments":
        return "# Copyright someone\n" + code.replace(
            "class Model(nn.Module):", "class Model(nn.Module):\n    \"\"\"A model.\"\"\"\n    # the layers")
    raise ValueError(kind)


def test_normalization_ignores_names_constants_imports_comments():
    code = Composer().compose(0, 3).code
    base = normalized_tokens(code)
    for kind in ("renamed", "constants", "imports", "comments"):
        v = _variant(code, kind)
        assert v != code
        assert normalized_tokens(v) == base, kind
    other = Composer().compose(0, 4).code
    assert code_similarity(code, other) < 0.9


@pytest.fixture(scope="module")
def corpus():
    comp = Composer()
    return [comp.compose(11, i) for i in range(40)]


def test_index_removes_copies_and_near_variants_keeps_the_rest(corpus, tmp_path):
    kinds = ["renamed", "constants", "imports", "comments"]
    in_ref = corpus[:12]
    ref = tmp_path / "ref"
    (ref / "level1").mkdir(parents=True)
    for i, t in enumerate(in_ref):
        code = t.code if i < 4 else _variant(t.code, kinds[i % 4])
        (ref / "level1" / f"{i}_task.py").write_text(code)
    for name, text in UNRELATED.items():
        (ref / name).write_text(text)
    index = ReferenceIndex.from_dir(ref)
    assert len(index) == 12 + 1 + 1  # broken.py does not parse
    for i, t in enumerate(in_ref):
        m = index.nearest(t.code)
        assert index.is_contaminated(m), (i, m)
        assert m.file == f"level1/{i}_task.py" or m.score == 1.0
    ref_ops = {tuple(t.ops) for t in in_ref}
    rest = [t for t in corpus[12:] if tuple(t.ops) not in ref_ops]
    assert len(rest) >= 20
    for t in rest:
        m = index.nearest(t.code)
        assert not index.is_contaminated(m), (t.ops, m)
    assert index.stats["exact"] < index.stats["queries"] * len(index)  # the prefilter prunes


def test_build_removes_reference_tasks_and_records_nearest(tmp_path):
    cfg = BuildConfig(n=10, seed=5, shard_size=8)
    first = build_corpus(cfg, tmp_path / "a", progress=False)
    assert first["removed"]["contamination"] == 0
    rows = pq.read_table(tmp_path / "a" / "tasks.parquet").to_pylist()
    ref = tmp_path / "ref"
    ref.mkdir()
    leaked = rows[:3]
    (ref / "copy.py").write_text(leaked[0]["code"])
    (ref / "renamed.py").write_text(_variant(leaked[1]["code"], "renamed"))
    (ref / "consts.py").write_text(_variant(_variant(leaked[2]["code"], "constants"), "comments"))
    (ref / "resnet_like.py").write_text(UNRELATED["resnet_like.py"])
    # same output dir: per-task shards are reused, only the cross-task filters rerun
    report = build_corpus(cfg.model_copy(update={"reference_bench": str(ref)}), tmp_path / "a", progress=False)
    assert report["shards_reused"] >= 1
    assert report["removed"]["contamination"] >= 3
    kept = pq.read_table(tmp_path / "a" / "tasks.parquet").to_pylist()
    assert len(kept) == 10
    leaked_ids = {r["id"] for r in leaked}
    assert not leaked_ids & {r["id"] for r in kept}
    assert all(r["bench_similarity"] is None or r["bench_similarity"] < 0.9 for r in kept)
    assert json.loads((tmp_path / "a" / "report.json").read_text())["reference"]["files"] == 4


def test_parallel_queries_match_serial(corpus):
    index = ReferenceIndex({f"r{i}.py": t.code for i, t in enumerate(corpus[:10])})
    codes = [t.code for t in corpus]
    assert index.nearest_many(codes, workers=2) == [index.nearest(c) for c in codes]
