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
2. **Score** two files by `difflib.SequenceMatcher(autojunk=False).ratio()` of their token
   sequences: 2·M/T where M is the number of tokens in matching blocks and T the total length.
   1.0 means structurally identical after normalization.
3. **Prefilter** (`ReferenceIndex`): MinHash over the set of `SHINGLE`-token shingles and an LSH
   index at Jaccard `lsh_threshold` (default 0.5, well below what a 0.9 ratio implies for
   these short files) find candidate reference files; for each candidate the O(1) and O(n)
   upper bounds `real_quick_ratio`/`quick_ratio` are tried first, and the exact ratio is
   computed only if they reach the cut. A task's `nearest_bench_file`/`bench_similarity` is
   the best exact score over its candidates (None/0.0 when the prefilter finds none: the task
   is then far below the threshold).
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


def normalized_tokens(code: str) -> list[str]:
    """The normalized AST token sequence of `code` (see the module docstring); [] if it does not parse."""
    try:
        tree = ast.parse(code)
    except (SyntaxError, ValueError):
        return []
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

    def visit(node: ast.AST) -> None:
        out.append(type(node).__name__)
        if isinstance(node, ast.Name):
            out.append(ident(node.id))
        elif isinstance(node, ast.Attribute):
            visit(node.value)
            out.append(ident(node.attr) if node.attr in bound else node.attr)
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
    return out


def similarity(a: list[str], b: list[str]) -> float:
    """Sequence-matcher ratio of two normalized token sequences."""
    if not a and not b:
        return 1.0
    return difflib.SequenceMatcher(None, a, b, autojunk=False).ratio()


def code_similarity(code_a: str, code_b: str) -> float:
    """`similarity` of two sources after normalization."""
    return similarity(normalized_tokens(code_a), normalized_tokens(code_b))


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
        self._matchers: dict[str, difflib.SequenceMatcher] = {}
        for name in sorted(files):
            toks = normalized_tokens(files[name])
            if not toks:
                continue
            self.tokens[name] = toks
            self.lsh.insert(name, _minhash(toks))
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
        toks = normalized_tokens(code)
        self.stats["queries"] += 1
        if not toks:
            return Match(file=None, score=0.0)
        best = Match(file=None, score=0.0)
        for name in sorted(self.lsh.query(_minhash(toks))):
            self.stats["candidates"] += 1
            m = self._matcher(name)
            m.set_seq1(toks)
            floor = max(best.score, 0.0)
            if m.real_quick_ratio() <= floor or m.quick_ratio() <= floor:
                continue
            self.stats["exact"] += 1
            score = m.ratio()
            if score > best.score:
                best = Match(file=name, score=round(score, 6))
        return best

    def is_contaminated(self, match: Match) -> bool:
        return match.file is not None and match.score >= self.threshold
