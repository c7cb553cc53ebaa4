"""Corpus build throughput: build N tasks with W workers, report time per task and a 6K projection.

    python benchmarks/bench_corpus_build.py [--n 200] [--workers 2] [--seed 0]
"""

from __future__ import annotations

import argparse
import tempfile
import time

from rich.console import Console
from rich.table import Table

from cudagym.tasks.corpus.build import BuildConfig, build_corpus


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--n", type=int, default=200)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as d:
        t0 = time.perf_counter()
        report = build_corpus(BuildConfig(n=args.n, seed=args.seed, workers=args.workers), d, progress=False)
        wall = time.perf_counter() - t0
    table = Table(title=f"corpus build: n={args.n}, workers={args.workers}")
    table.add_column("metric")
    table.add_column("value", justify="right")
    for k, v in (("wall (s)", f"{wall:.1f}"), ("candidates", str(report["candidates"])),
                 ("kept share", f"{report['n_built'] / max(1, report['candidates']):.1%}"),
                 ("s per kept task", f"{wall / max(1, report['n_built']):.3f}"),
                 ("projected 6000-task build (min)", f"{wall / max(1, report['n_built']) * 6000 / 60:.1f}")):
        table.add_row(k, v)
    for f, k in report["removed"].items():
        table.add_row(f"removed: {f}", str(k))
    Console().print(table)


if __name__ == "__main__":
    main()
