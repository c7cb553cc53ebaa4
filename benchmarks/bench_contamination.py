"""Contamination filter throughput: N tasks against a reference directory of R files.

    python benchmarks/bench_contamination.py [--tasks 6000] [--refs 250] [--parquet OUT/tasks.parquet]

Tasks come from a built corpus (`--parquet`) or are composed (seed 0). The reference set is R
files: 80% composed from another seed (unrelated problems, same format) and 20% near-variants
(renamed variables, changed sizes, reordered imports, comments) of corpus tasks, which must be
caught. Prints a table: index build time, query time, candidates from the LSH prefilter, exact
comparisons, removed tasks, and how many planted variants were caught.
"""

from __future__ import annotations

import argparse
import re
import tempfile
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

from cudagym.tasks.corpus.composer import Composer
from cudagym.tasks.corpus.contamination import ReferenceIndex


def variant(code: str, k: int) -> str:
    code = re.sub(r"\bx\b", "renamed_input_", code)
    code = re.sub(r"^([A-Z_]+) = (\d+)$", lambda m: f"{m.group(1)} = {int(m.group(2)) + k + 1}", code, flags=re.M)
    code = code.replace("import torch\nimport torch.nn as nn\n", "import torch.nn as nn\nimport torch\n")
    return f"# reference file {k}\n" + code


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tasks", type=int, default=6000)
    ap.add_argument("--refs", type=int, default=250)
    ap.add_argument("--parquet", type=Path, default=None)
    ap.add_argument("--workers", type=int, default=2, help="processes for the queries (default: 2 cores)")
    args = ap.parse_args()
    console = Console()
    t0 = time.perf_counter()
    if args.parquet:
        import pyarrow.parquet as pq

        codes = pq.read_table(args.parquet, columns=["code"]).column("code").to_pylist()[: args.tasks]
    else:
        comp = Composer()
        codes = [c.code for c in (comp.compose(0, i) for i in range(args.tasks)) if c]
    t_tasks = time.perf_counter() - t0
    n_var = args.refs // 5
    comp = Composer()
    unrelated = [c.code for c in (comp.compose(1234, i) for i in range(args.refs - n_var)) if c]
    step = max(1, len(codes) // n_var)
    planted = list(range(0, len(codes), step))[:n_var]
    with tempfile.TemporaryDirectory() as d:
        root = Path(d)
        for i, code in enumerate(unrelated):
            (root / f"u{i:04d}.py").write_text(code)
        for k, i in enumerate(planted):
            (root / f"v{k:04d}.py").write_text(variant(codes[i], k))
        t1 = time.perf_counter()
        index = ReferenceIndex.from_dir(root)
        t_index = time.perf_counter() - t1
        t2 = time.perf_counter()
        matches = index.nearest_many(codes, workers=args.workers)
        t_query = time.perf_counter() - t2
    removed = [i for i, m in enumerate(matches) if index.is_contaminated(m)]
    caught = len(set(planted) & set(removed))
    table = Table(title=f"contamination filter: {len(codes)} tasks vs {len(index)} reference files")
    for col in ("stage", "value"):
        table.add_column(col)
    rows = [
        ("tasks loaded/composed (s, not part of the filter)", f"{t_tasks:.1f}"),
        ("index build (s)", f"{t_index:.2f}"),
        (f"queries (s, {args.workers} processes)", f"{t_query:.2f}"),
        ("filter total (s)", f"{t_index + t_query:.2f}"),
        ("per task (ms)", f"{1e3 * t_query / max(1, len(codes)):.2f}"),
        ("LSH candidates", str(index.stats["candidates"])),
        ("exact comparisons", str(index.stats["exact"])),
        ("all pairs", str(len(codes) * len(index))),
        ("removed (>= threshold)", str(len(removed))),
        ("planted variants caught", f"{caught}/{len(planted)}"),
    ]
    for r in rows:
        table.add_row(*r)
    console.print(table)


if __name__ == "__main__":
    main()
