"""The results table of a run (CUDA Agent's metrics) and a plot of the speedup distribution.

Per group (overall, per level, per source), over episodes:
- pass rate: the submission was correct (compiled, matched the reference, passed the audit);
- faster than eager / than compile: correct and speedup > 1.0x against that baseline;
- geomean speedups: geometric mean over the correct episodes that were profiled;
- mean reward: the mean milestone return.
An episode that ended without a verdict (a policy error) counts as failed.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from pydantic import BaseModel

from cudagym.agent.store import TrajectoryStore
from cudagym.sandbox.library import LIBRARY_BASELINES, LIBRARY_TITLES


class GroupStats(BaseModel):
    group: str
    episodes: int
    pass_rate: float
    faster_than_eager: float
    faster_than_compile: float
    geomean_vs_eager: float | None
    geomean_vs_compile: float | None
    n_timed: int  # correct episodes with a speedup against eager (that geomean's population)
    mean_reward: float
    geomean_server_vs_eager: float | None = None  # server-mode timing (when the run asked for it)
    # library baselines (GEMM tasks): geomean over the episodes timed against each
    geomean_vs_library: dict[str, float] = {}
    # correct episodes with a speedup against torch.compile (that geomean's population: a task
    # whose torch.compile baseline failed, as some do on the CPU target, has none)
    n_vs_compile: int = 0


def _geomean(xs: list[float | None]) -> float | None:
    pos = [x for x in xs if x is not None and x > 0]
    return math.exp(sum(math.log(x) for x in pos) / len(pos)) if pos else None


def group_stats(name: str, episodes: list[dict[str, Any]]) -> GroupStats:
    n = len(episodes)
    correct = [e for e in episodes if (e.get("verdict") or {}).get("correct")]
    se = [(e["verdict"].get("speedup_vs_eager")) for e in correct]
    sc = [(e["verdict"].get("speedup_vs_compile")) for e in correct]
    return GroupStats(
        group=name,
        episodes=n,
        pass_rate=len(correct) / n if n else 0.0,
        faster_than_eager=sum(1 for s in se if s is not None and s > 1.0) / n if n else 0.0,
        faster_than_compile=sum(1 for s in sc if s is not None and s > 1.0) / n if n else 0.0,
        geomean_vs_eager=_geomean([s for s in se if s is not None]),
        geomean_vs_compile=_geomean([s for s in sc if s is not None]),
        n_timed=sum(1 for s in se if s is not None),
        n_vs_compile=sum(1 for s in sc if s is not None and s > 0),
        mean_reward=sum(float(e.get("reward", 0.0)) for e in episodes) / n if n else 0.0,
        geomean_server_vs_eager=_geomean([(e["verdict"].get("server") or {}).get("speedup_vs_eager")
                                          for e in correct]),
        geomean_vs_library={name: g for name in LIBRARY_BASELINES if (g := _geomean(
            [(e["verdict"].get("speedup_vs_library") or {}).get(name) for e in correct])) is not None},
    )


def results_table(episodes: list[dict[str, Any]]) -> list[GroupStats]:
    rows = [group_stats("overall", episodes)]
    levels = sorted({(e.get("task") or {}).get("level") for e in episodes}, key=lambda x: (x is None, x))
    for lv in levels:
        rows.append(group_stats(f"level {lv if lv is not None else '-'}",
                                [e for e in episodes if (e.get("task") or {}).get("level") == lv]))
    source = lambda e: (e.get("task") or {}).get("source") or "-"  # noqa: E731
    for src in sorted({source(e) for e in episodes}):
        rows.append(group_stats(f"source {src}", [e for e in episodes if source(e) == src]))
    return rows


def render_table(rows: list[GroupStats], title: str = "cudagym results") -> Any:
    from rich.table import Table

    t = Table(title=title)
    server = any(r.geomean_server_vs_eager is not None for r in rows)
    library = [n for n in LIBRARY_BASELINES if any(n in r.geomean_vs_library for r in rows)]
    for col in ("group", "episodes", "pass rate", "faster than eager", "faster than compile",
                "geomean vs eager", "geomean vs compile", *(["geomean vs eager (server)"] if server else []),
                *(f"geomean vs {LIBRARY_TITLES[n]}" for n in library), "mean reward"):
        t.add_column(col, justify="left" if col == "group" else "right")
    pct = lambda x: f"{x * 100:.1f}%"  # noqa: E731
    gm = lambda x, n: "n/a" if x is None else f"{x:.3f}x (n={n})"  # noqa: E731
    for r in rows:
        extra = ["n/a" if r.geomean_server_vs_eager is None else f"{r.geomean_server_vs_eager:.3f}x"] if server else []
        extra += ["n/a" if n not in r.geomean_vs_library else f"{r.geomean_vs_library[n]:.3f}x" for n in library]
        t.add_row(r.group, str(r.episodes), pct(r.pass_rate), pct(r.faster_than_eager), pct(r.faster_than_compile),
                  gm(r.geomean_vs_eager, r.n_timed), gm(r.geomean_vs_compile, r.n_vs_compile), *extra,
                  f"{r.mean_reward:+.2f}")
    return t


def markdown_table(rows: list[GroupStats]) -> str:
    library = [n for n in LIBRARY_BASELINES if any(n in r.geomean_vs_library for r in rows)]
    head = ("| group | episodes | pass rate | faster than eager | faster than compile | geomean vs eager "
            "| geomean vs compile | "
            + "".join(f"geomean vs {LIBRARY_TITLES[n]} | " for n in library) + "mean reward |")
    lines = [head, "|" + "---|" * (8 + len(library))]
    for r in rows:
        gme = "n/a" if r.geomean_vs_eager is None else f"{r.geomean_vs_eager:.3f}x"
        gmc = "n/a" if r.geomean_vs_compile is None else f"{r.geomean_vs_compile:.3f}x (n={r.n_vs_compile})"
        gml = "".join(("n/a" if n not in r.geomean_vs_library else f"{r.geomean_vs_library[n]:.3f}x") + " | "
                      for n in library)
        lines.append(f"| {r.group} | {r.episodes} | {r.pass_rate:.1%} | {r.faster_than_eager:.1%} | "
                     f"{r.faster_than_compile:.1%} | {gme} | {gmc} | {gml}{r.mean_reward:+.2f} |")
    return "\n".join(lines)


def plot_speedups(episodes: list[dict[str, Any]], path: Path) -> Path:
    """Histogram of per-episode speedups (log scale) vs eager and vs torch.compile, correct episodes."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    correct = [e["verdict"] for e in episodes if (e.get("verdict") or {}).get("correct")]
    fig, ax = plt.subplots(figsize=(7, 4))
    series = [("vs eager", [v.get("speedup_vs_eager") for v in correct]),
              ("vs torch.compile", [v.get("speedup_vs_compile") for v in correct])]
    values = [x for _, xs in series for x in xs if x]
    if values:
        lo, hi = math.log2(min(values)), math.log2(max(values))
        if hi - lo < 0.5:
            lo, hi = lo - 0.25, hi + 0.25
        bins = [2 ** (lo + (hi - lo) * i / 20) for i in range(21)]
        for label, xs in series:
            xs = [x for x in xs if x]
            if xs:
                ax.hist(xs, bins=bins, alpha=0.6, label=f"{label} (n={len(xs)})")
        ax.set_xscale("log", base=2)
        ax.legend()
    else:
        ax.text(0.5, 0.5, "no correct, profiled episodes", ha="center", va="center", transform=ax.transAxes)
    ax.axvline(1.0, color="black", linestyle="--", linewidth=1)
    ax.set_xlabel("speedup (x, log scale)")
    ax.set_ylabel("episodes")
    ax.set_title(f"Speedup distribution ({len(correct)} correct of {len(episodes)} episodes)")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def write_report(run_dir: str | Path) -> tuple[list[GroupStats], Path, Path]:
    """Compute the table of `run_dir`, write report.md, report.json and speedup.png there."""
    run_dir = Path(run_dir)
    episodes = TrajectoryStore(run_dir).summaries()
    rows = results_table(episodes)
    md = run_dir / "report.md"
    md.write_text(f"# cudagym results: {run_dir.name}\n\n{markdown_table(rows)}\n\n"
                  "Faster = correct and speedup > 1.0x; geomeans over correct, profiled episodes.\n")
    (run_dir / "report.json").write_text(json.dumps([r.model_dump() for r in rows], indent=2))
    png = plot_speedups(episodes, run_dir / "speedup.png")
    return rows, md, png
