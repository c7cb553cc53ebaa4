"""`cudagym tasks ...`: list task sets, build the synthetic ops corpus, inspect a build, generate
the half-precision GEMM family."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import typer

from cudagym.errors import CudagymError

app = typer.Typer(no_args_is_help=True, help="List, build and inspect task corpora.")


def _fail(e: Exception) -> None:
    typer.secho(f"error: {e}", fg="red", err=True)
    raise typer.Exit(2)


def _parse_weights(text: str | None) -> dict[int, float] | None:
    if not text:
        return None
    out = {}
    for part in text.split(","):
        k, _, v = part.partition(":")
        out[int(k)] = float(v)
    if not out or any(k < 1 or k > 5 for k in out) or sum(out.values()) <= 0:
        raise typer.BadParameter("expected e.g. '1:0.04,2:0.84,3:0.08,4:0.03,5:0.01' (op counts 1-5)")
    return out


@app.command("build")
def build(
    out: Path = typer.Option(..., "--out",
                             help="Output directory (parquet, report.json, shards/); a rerun resumes it."),
    n: int = typer.Option(6000, "--n", help="Number of tasks to keep."),
    seed: int = typer.Option(0, "--seed", help="Seed of the candidate stream: same seed, same corpus."),
    reference_bench: Optional[Path] = typer.Option(
        None, "--reference-bench", help="Directory of reference benchmark files (e.g. a KernelBench checkout); "
                                        "tasks too similar to any *.py under it are removed."),
    target_gpu: str = typer.Option("h100", "--target-gpu",
                                   help="GPU whose peak figures set the workload estimate "
                                        "(h100, h200, b200, a100, l40s, l4, a10g, rtx4090, v100)."),
    workers: int = typer.Option(1, "--workers", help="Worker processes for composing and checking."),
    calibrate: bool = typer.Option(False, "--calibrate", help="After building, time a sample of tasks on the GPU "
                                                              "(needs CUDA) and store measured ms."),
    calibrate_sample: int = typer.Option(200, "--calibrate-sample", help="Tasks to time with --calibrate."),
    min_ms: float = typer.Option(1.0, "--min-ms", help="Lower end of the eager-time window (ms, target GPU)."),
    max_ms: float = typer.Option(100.0, "--max-ms", help="Upper end of the eager-time window (ms, target GPU)."),
    threshold: float = typer.Option(0.9, "--contamination-threshold", help="Remove tasks whose similarity to a "
                                                                           "reference file is at least this."),
    op_counts: Optional[str] = typer.Option(None, "--op-counts",
                                            help="Distribution of ops per task, e.g. "
                                                 "'1:0.04,2:0.84,3:0.08,4:0.03,5:0.01' (default)."),
    compile_backend: str = typer.Option("auto", "--compile-backend",
                                        help="torch.compile backend of the compile "
                                             "filter (auto: inductor with CUDA, else eager)."),
    shard_size: int = typer.Option(50, "--shard-size", help="Candidates per shard (the unit of resumption)."),
    quiet: bool = typer.Option(False, "--quiet", help="No progress bars."),
) -> None:
    """Build the synthetic fused-operator corpus (Ops-6K style) with every filter, resumably."""
    from rich.console import Console

    from cudagym.tasks.corpus.build import BuildConfig, build_corpus, print_report
    from cudagym.tasks.corpus.composer import ComposerConfig
    from cudagym.tasks.corpus.estimate import gpu_spec
    from cudagym.tasks.corpus.filters import FilterConfig

    try:
        gpu_spec(target_gpu)
        if calibrate:
            from cudagym.tasks.corpus.calibrate import require_cuda

            require_cuda()  # fail before spending the build
        composer = ComposerConfig()
        weights = _parse_weights(op_counts)
        if weights:
            composer = ComposerConfig(op_count_weights=weights)
        cfg = BuildConfig(n=n, seed=seed, target_gpu=target_gpu.lower(), workers=workers, shard_size=shard_size,
                          reference_bench=str(reference_bench) if reference_bench else None, composer=composer,
                          filters=FilterConfig(min_ms=min_ms, max_ms=max_ms, contamination_threshold=threshold,
                                               compile_backend=compile_backend))
        report = build_corpus(cfg, out, progress=not quiet)
    except CudagymError as e:
        _fail(e)
        return
    print_report(report, Console())
    typer.echo(f"wrote {out / 'tasks.parquet'} and {out / 'report.json'}")
    if calibrate:
        _run_calibration(out, calibrate_sample, seed)


def _run_calibration(out: Path, sample: int, seed: int) -> None:
    from rich.console import Console

    from cudagym.tasks.corpus.calibrate import calibrate_dir, print_calibration

    try:
        summary = calibrate_dir(out, sample=sample, seed=seed)
    except CudagymError as e:
        _fail(e)
        return
    print_calibration(summary, Console())
    typer.echo(f"wrote {out / 'calibration.json'} and measured_ms in {out / 'tasks.parquet'}")


@app.command("calibrate")
def calibrate_cmd(
    out: Path = typer.Argument(..., help="A built corpus directory."),
    sample: int = typer.Option(200, "--sample", help="Number of tasks to time."),
    seed: int = typer.Option(0, "--seed", help="Seed of the sample."),
) -> None:
    """Time a sample of a built corpus on the GPU and compare with the estimate (needs CUDA)."""
    if not (out / "tasks.parquet").exists():
        _fail(FileNotFoundError(f"{out}: no tasks.parquet (build it first)"))
    _run_calibration(out, sample, seed)


@app.command("stats")
def stats(out: Path = typer.Argument(..., help="A built corpus directory (with report.json).")) -> None:
    """Print the build report of a corpus: removed per filter, op and op-count histograms."""
    from rich.console import Console

    from cudagym.tasks.corpus.build import print_report

    path = out / "report.json"
    if not path.exists():
        _fail(FileNotFoundError(f"{path}: no build report"))
    print_report(json.loads(path.read_text()), Console())
    if (out / "calibration.json").exists():
        from cudagym.tasks.corpus.calibrate import print_calibration

        print_calibration(json.loads((out / "calibration.json").read_text()), Console())


@app.command("show")
def show(
    out: Path = typer.Argument(..., help="A built corpus directory or a parquet file."),
    task_id: str = typer.Argument(..., help="Task id (e.g. ops_s0_000012)."),
) -> None:
    """Print one task of a corpus: its metadata and source."""
    import pyarrow.parquet as pq
    from rich.console import Console
    from rich.syntax import Syntax

    path = out / "tasks.parquet" if out.is_dir() else out
    if not path.exists():
        _fail(FileNotFoundError(f"{path}: not found"))
    rows = [r for r in pq.read_table(path).to_pylist() if r.get("id") == task_id]
    if not rows:
        _fail(KeyError(f"no task {task_id!r} in {path}"))
    row = rows[0]
    console = Console()
    for k, v in row.items():
        if k != "code":
            console.print(f"[bold]{k}[/]: {v}")
    console.print(Syntax(row["code"], "python"))


@app.command("gemm")
def gemm_cmd(
    out: Path = typer.Option(..., "--out", help="Output directory: gemm.parquet (the tasks) and configs.json."),
    configs: int = typer.Option(1000, "--configs", help="Number of (M, N, K, dtype) configurations."),
    seed: int = typer.Option(0, "--seed", help="Same seed, same configurations."),
    dtypes: str = typer.Option("float16,bfloat16", "--dtypes", help="Comma-separated: float16, bfloat16."),
) -> None:
    """Generate the half-precision GEMM task family (small, skinny, square, large and deep shapes,
    aligned and unaligned). Load it with e.g. `cudagym run --tasks OUT/gemm.parquet`."""
    from rich.console import Console

    from cudagym.tasks.gemm import config_rows, gemm_configs, gemm_tasks, write_gemm_parquet

    try:
        chosen = gemm_configs(configs, seed, tuple(d.strip() for d in dtypes.split(",") if d.strip()))
        path = write_gemm_parquet(gemm_tasks(chosen), out / "gemm.parquet")
    except CudagymError as e:
        _fail(e)
        return
    (out / "configs.json").write_text(json.dumps({"seed": seed, "configs": config_rows(chosen)}, indent=1))
    by_class: dict[str, int] = {}
    for c in chosen:
        by_class[c.shape_class] = by_class.get(c.shape_class, 0) + 1
    Console().print(f"{len(chosen)} GEMM tasks in {path} ("
                    + ", ".join(f"{k} {v}" for k, v in by_class.items()) + ")")


@app.command("list")
def list_cmd(src: str = typer.Argument("bundled", help="'bundled', a bundled id, a .py file, a directory or a "
                                                       ".parquet file.")) -> None:
    """List the tasks of a bundled set, file, directory or parquet file."""
    from rich.console import Console
    from rich.table import Table

    from cudagym.tasks.loaders import load_tasks

    try:
        tasks = load_tasks(src)
    except CudagymError as e:
        _fail(e)
        return
    t = Table(title=f"{len(tasks)} tasks in {src}")
    for c in ("id", "source", "level", "dtype", "ops"):
        t.add_column(c)
    for task in tasks:
        t.add_row(task.id, task.source, "" if task.level is None else str(task.level), task.dtype,
                  ", ".join(task.ops))
    Console().print(t)
