"""Contamination filtering: how close is a task to any file of a reference benchmark?

The measure
-----------
1. **Normalize** the source's AST (`normalized_tokens`):
   - docstrings and every bare string statement are dropped (comments never reach the AST);
   - module-level imports are sorted and moved to the top, and an import alias is replaced by
     the module it names (`import torch.nn.functional as F` makes `F.relu` read
     `torch.nn.functional.relu`), so import order and alias choice do not matter;
   - every identifier the file *binds* (assigned names, function/class names, arguments,
     attributes stored on `self`) becomes `v0, v1, ...` in order of first appearance, so
     renaming variables, modules or layers changes nothing; free names and attribute names that
     are not bound in the file (`torch`, `relu`, `Conv2d`, `shape`) are kept: they are the
     operators, which is what makes two tasks the same problem;
   - numeric literals become `NUM` and strings `STR`, so sizes and hyper-parameters do not
     matter.
   The result is the pre-order sequence of AST node types, with the (normalized) identifier
   after each `Name`/`Attribute`/`arg`/def node and the literal kind after each `Constant`.
2. **Score** two files by the minimum of two `difflib.SequenceMatcher(autojunk=False).ratio()`
   values (2·M/T: M tokens in matching blocks, T the total length):
   - *structure*: the full normalized token sequences;
   - *operators*: the subsequence of operator tokens — the kept free names and attribute names,
     lower-cased (`conv2d`, `relu`, `softmax`, `randn`; module names such as `torch` are left
     out), so `nn.ReLU()` and `F.relu` agree.
   The structure ratio alone cannot tell a Conv2d→ReLU task from an AvgPool1d→CELU one (the
   shared boilerplate is most of both files: about 0.95); requiring the operator sequences to
   agree as well makes 0.9 mean "the same operators, written nearly the same way".
3. **Prefilter** (`ReferenceIndex`): MinHash over the set of `SHINGLE`-token shingles and an LSH
   index at Jaccard `lsh_threshold` (default 0.5, well below what a 0.9 ratio implies for
   these short files) find candidate reference files; for each candidate the O(1) and O(n)
   upper bounds (operator ratio, length bound, `quick_ratio`) order and prune the candidates
   (branch and bound), so the exact ratio runs on only a few of them. A task's
   `nearest_bench_file`/`bench_similarity` is the best exact score over its candidates
   (None/0.0 when the prefilter finds none: the task is then far below the threshold).
A task is contaminated when its best score is at or above `threshold` (default 0.9).
"""

from __future__ import annotations

import ast
import difflib
import hashlib
from pathlib import Path

from pydantic import BaseModel

SHINGLE = 3
NUM_PERM = 64
_FORMAT_NAMES = {"Model", "forward", "get_inputs", "get_init_inputs", "__init__", "super", "self"}
_NOT_OPERATORS = _FORMAT_NAMES | {"torch", "nn", "F", "math", "np", "numpy", "functional", "Module"}


class Match(BaseModel):
    """The nearest reference file of a task and the similarity ratio (0–1)."""

    file: str | None
    score: float


def _strip_docstrings(tree: ast.AST) -> None:
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        if isinstance(body, list):
            kept = [s for s in body if not (isinstance(s, ast.Expr) and isinstance(s.value, ast.Constant)
                                           and isinstance(s.value.value, str))]
            node.body = kept or [ast.Pass()]  # type: ignore[attr-defined]


def _bound_names(tree: ast.AST) -> set[str]:
    """Identifiers the file defines itself (assigned, defined, parameters, `self.<attr> = ...`)."""
    bound: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            bound.add(node.name)
        elif isinstance(node, ast.arg):
            bound.add(node.arg)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            bound.add(node.id)
        elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
            bound.add(node.attr)
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
              and node.func.attr in ("register_buffer", "register_parameter") and node.args
              and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str)):
            bound.add(node.args[0].value)
    return bound - _FORMAT_NAMES


class Normalized(BaseModel):
    """A source's normalized token sequence and its operator subsequence."""

    tokens: list[str]
    operators: list[str]


def normalized_tokens(code: str) -> list[str]:
    """The normalized AST token sequence of `code` (see the module docstring); [] if it does not parse."""
    return normalize(code).tokens


def normalize(code: str) -> Normalized:
    """Tokens and operators of `code` (see the module docstring); empty if it does not parse."""
    try:
        tree = ast.parse(code)
    except (SyntaxError, ValueError):
        return Normalized(tokens=[], operators=[])
    _strip_docstrings(tree)
    imports = [n for n in tree.body if isinstance(n, (ast.Import, ast.ImportFrom))]
    aliases: dict[str, str] = {}
    for imp in imports:
        for a in imp.names:
            if a.asname:
                aliases[a.asname] = (f"{imp.module}.{a.name}" if isinstance(imp, ast.ImportFrom) else a.name)
            elif isinstance(imp, ast.ImportFrom):
                aliases[a.name] = f"{imp.module}.{a.name}"
    rest = [n for n in tree.body if not isinstance(n, (ast.Import, ast.ImportFrom))]
    import_keys = sorted(f"import {n}" for n in set(aliases.values()) | {
        a.name for imp in imports if isinstance(imp, ast.Import) for a in imp.names if not a.asname})
    bound = _bound_names(ast.Module(body=rest, type_ignores=[])) - set(aliases)
    rename: dict[str, str] = {}

    def ident(name: str) -> str:
        if name in aliases:
            return aliases[name]
        if name in bound:
            if name not in rename:
                rename[name] = f"v{len(rename)}"
            return rename[name]
        return name

    out: list[str] = list(import_keys)
    operators: list[str] = []

    def visit(node: ast.AST) -> None:
        out.append(type(node).__name__)
        if isinstance(node, ast.Name):
            out.append(ident(node.id))
            if node.id not in bound and node.id not in aliases and node.id not in _NOT_OPERATORS:
                operators.append(node.id.lower())
        elif isinstance(node, ast.Attribute):
            visit(node.value)
            if node.attr in bound:
                out.append(ident(node.attr))
            else:
                out.append(node.attr)
                if node.attr not in _NOT_OPERATORS:
                    operators.append(node.attr.lower())
            return
        elif isinstance(node, ast.arg):
            out.append(ident(node.arg))
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            out.append(ident(node.name))
        elif isinstance(node, ast.Constant):
            v = node.value
            out.append("NUM" if isinstance(v, (int, float, complex)) and not isinstance(v, bool)
                       else "STR" if isinstance(v, (str, bytes)) else repr(v))
            return
        elif isinstance(node, (ast.Load, ast.Store, ast.Del)):
            out.pop()  # contexts add nothing
            return
        for child in ast.iter_child_nodes(node):
            visit(child)

    for stmt in rest:
        visit(stmt)
    return Normalized(tokens=out, operators=operators)


def similarity(a: Normalized, b: Normalized) -> float:
    """min(structure ratio, operator ratio) of two normalized sources."""
    if not a.tokens and not b.tokens:
        return 1.0
    ops = difflib.SequenceMatcher(None, a.operators, b.operators, autojunk=False).ratio()
    if ops == 0.0:
        return 0.0
    return min(ops, difflib.SequenceMatcher(None, a.tokens, b.tokens, autojunk=False).ratio())


def code_similarity(code_a: str, code_b: str) -> float:
    """`similarity` of two sources after normalization."""
    return similarity(normalize(code_a), normalize(code_b))


def _shingles(tokens: list[str]) -> list[bytes]:
    if len(tokens) < SHINGLE:
        return [" ".join(tokens).encode()]
    return sorted({" ".join(tokens[i:i + SHINGLE]).encode() for i in range(len(tokens) - SHINGLE + 1)})


def _minhash(tokens: list[str]):  # noqa: ANN202
    from datasketch import MinHash

    m = MinHash(num_perm=NUM_PERM, seed=1)
    m.update_batch(_shingles(tokens))
    return m


class ReferenceIndex:
    """The reference benchmark files, indexed for `nearest` queries (see the module docstring)."""

    def __init__(self, files: dict[str, str], *, threshold: float = 0.9, lsh_threshold: float = 0.5) -> None:
        from datasketch import MinHashLSH

        self.threshold = threshold
        self.lsh = MinHashLSH(threshold=lsh_threshold, num_perm=NUM_PERM)
        self.tokens: dict[str, list[str]] = {}
        self.operators: dict[str, list[str]] = {}
        self._matchers: dict[str, difflib.SequenceMatcher] = {}
        for name in sorted(files):
            norm = normalize(files[name])
            if not norm.tokens:
                continue
            self.tokens[name], self.operators[name] = norm.tokens, norm.operators
            self.lsh.insert(name, _minhash(norm.tokens))
        self.stats = {"queries": 0, "candidates": 0, "exact": 0}

    @classmethod
    def from_dir(cls, path: str | Path, **kw: float) -> ReferenceIndex:
        """Every `*.py` under `path` (recursively); names are paths relative to `path`."""
        root = Path(path)
        if not root.is_dir():
            raise FileNotFoundError(f"{root}: reference benchmark directory not found")
        files = {}
        for p in sorted(root.rglob("*.py")):
            try:
                files[str(p.relative_to(root))] = p.read_text(errors="replace")
            except OSError:
                continue
        return cls(files, **kw)

    def __len__(self) -> int:
        return len(self.tokens)

    @property
    def fingerprint(self) -> str:
        """Identifies the reference set (names and contents), for build resumption."""
        h = hashlib.sha256()
        for name in sorted(self.tokens):
            h.update(name.encode() + b"\0" + " ".join(self.tokens[name]).encode() + b"\0")
        return h.hexdigest()[:16]

    def _matcher(self, name: str) -> difflib.SequenceMatcher:
        m = self._matchers.get(name)
        if m is None:  # seq2 is the side SequenceMatcher indexes: index each reference once
            m = difflib.SequenceMatcher(None, autojunk=False)
            m.set_seq2(self.tokens[name])
            self._matchers[name] = m
        return m

    def nearest(self, code: str) -> Match:
        """The best-scoring reference file among the prefilter's candidates."""
        norm = normalize(code)
        self.stats["queries"] += 1
        if not norm.tokens:
            return Match(file=None, score=0.0)
        # Branch and bound: order candidates by a cheap upper bound (the operator ratio and the
        # length bound of the structure ratio), compute exact ratios until the bound drops to the best.
        la = len(norm.tokens)
        bounded = []
        for name in self.lsh.query(_minhash(norm.tokens)):
            self.stats["candidates"] += 1
            ops = difflib.SequenceMatcher(None, norm.operators, self.operators[name], autojunk=False).ratio()
            lb = len(self.tokens[name])
            bounded.append((min(ops, 2 * min(la, lb) / (la + lb)), name, ops))
        bounded.sort(key=lambda c: (-c[0], c[1]))
        best = Match(file=None, score=0.0)
        for bound, name, ops in bounded:
            if bound <= best.score:
                break
            m = self._matcher(name)
            m.set_seq1(norm.tokens)
            if min(ops, m.quick_ratio()) <= best.score:
                continue
            self.stats["exact"] += 1
            score = min(ops, m.ratio())
            if score > best.score:
                best = Match(file=name, score=round(score, 6))
        return best

    def nearest_many(self, codes: list[str], workers: int = 1) -> list[Match]:
        """`nearest` for each code, in order; `workers` > 1 splits them over forked processes."""
        if workers <= 1 or len(codes) < 2 * workers:
            return [self.nearest(c) for c in codes]
        import multiprocessing as mp

        global _FORK_INDEX
        _FORK_INDEX = self
        chunks = [codes[i::workers] for i in range(workers)]
        try:
            with mp.get_context("fork").Pool(workers) as pool:
                parts = pool.map(_nearest_chunk, chunks)
        finally:
            _FORK_INDEX = None
        out: list[Match] = [Match(file=None, score=0.0)] * len(codes)
        for w, (matches, stats) in enumerate(parts):
            for j, m in enumerate(matches):
                out[w + j * workers] = m
            for k, v in stats.items():
                self.stats[k] += v
        return out

    def is_contaminated(self, match: Match) -> bool:
        return match.file is not None and match.score >= self.threshold


_FORK_INDEX: ReferenceIndex | None = None  # set only around a forked `nearest_many`


def _nearest_chunk(codes: list[str]) -> tuple[list[Match], dict[str, int]]:
    index = _FORK_INDEX
    assert index is not None  # noqa: S101 - set by `nearest_many` before it forks the workers
    before = dict(index.stats)
    matches = [index.nearest(c) for c in codes]
    return matches, {k: index.stats[k] - before[k] for k in before}
