"""`cudagym train CONFIG [KEY=VALUE ...]` (verl) and `cudagym train prepare SRC --out DIR`."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional

import typer
from typer.core import TyperGroup

from cudagym.errors import CudagymError

if TYPE_CHECKING:  # typer >= 0.29 carries its own click (typer._click); only its types are named here
    from typer._click.core import Context
    from typer._click.formatting import HelpFormatter


class _TrainGroup(TyperGroup):
    """``cudagym train`` runs a stage config unless its first word names a subcommand."""

    def parse_args(self, ctx: Context, args: list[str]) -> list[str]:
        if args and args[0] not in self.commands and args[0] not in ("--help", "-h"):
            args = ["launch", *args]
        elif not args:
            args = ["launch", "--help"]
        return super().parse_args(ctx, args)

    def format_usage(self, ctx: Context, formatter: HelpFormatter) -> None:
        formatter.write_usage("cudagym train", "CONFIG [KEY=VALUE ...] [--dry-run] | prepare SRC --out DIR")


app = typer.Typer(cls=_TrainGroup, no_args_is_help=False, add_completion=False, pretty_exceptions_show_locals=False,
                  help="Train a policy on KernelEnv with verl (0.9.1): `cudagym train grpo|ppo|FILE.yaml "
                       "[KEY=VALUE ...] [--dry-run]` launches verl's trainer with a stage config; "
                       "`cudagym train prepare SRC --out DIR` writes its parquet data.")


def _fail(console: Any, e: Exception) -> None:
    console.print(f"[red]error:[/] {e}")
    raise typer.Exit(2)


@app.command("launch", hidden=True,
             help="Run verl's trainer with a stage config: 'grpo', 'ppo', a packaged name, or a .yaml file whose "
                  "defaults name one. KEY=VALUE arguments are Hydra overrides of verl's config "
                  "(e.g. actor_rollout_ref.model.path=/models/qwen trainer.n_gpus_per_node=4).")
def launch_cmd(
    config: str = typer.Argument(..., help="Stage config: grpo, ppo, cudagym_grpo, cudagym_ppo or a path to a .yaml."),
    overrides: Optional[list[str]] = typer.Argument(None, help="Hydra overrides, KEY=VALUE."),
    dry_run: bool = typer.Option(False, "--dry-run", help="Resolve and validate the config with verl's config "
                                                          "classes, print it, and exit."),
) -> None:
    from omegaconf import OmegaConf
    from rich.console import Console

    console = Console()
    bad = [o for o in overrides or [] if "=" not in o]
    if bad:
        _fail(console, CudagymError(f"overrides must be KEY=VALUE, got {' '.join(bad)}"))
    try:
        from cudagym.train.launch import launch, resolve_config, validate_config

        cfg = resolve_config(config, list(overrides or []))
        notes = validate_config(cfg)
    except (CudagymError, ImportError) as e:
        _fail(console, e)
    if dry_run:
        print(OmegaConf.to_yaml(cfg, resolve=True))
        for n in notes:
            console.print(f"[yellow]note:[/] {n}")
        console.print(f"[green]valid[/]: {config} (verl's validate_config and config classes, cudagym's checks)")
        return
    launch(cfg)


@app.command("prepare", help="Write verl-format train/val parquet (one row per task, agent_name cudagym_kernel) "
                             "from a task source, dropping tasks too close to the eval set.")
def prepare_cmd(
    source: str = typer.Argument(..., help="Task source: 'bundled', a bundled task id, a task .py, a KernelBench-style "
                                           "directory, a built corpus directory or an Ops-6K .parquet."),
    out: Path = typer.Option(Path("data/cudagym"), "--out",
                             help="Output directory (train.parquet, val.parquet, prepare.json); the default is "
                                  "where the bundled GRPO config's data.train_files and val_files point."),
    val_fraction: float = typer.Option(0.1, "--val-fraction", min=0.0, max=0.99,
                                       help="Share of the source held out for validation (at least one task "
                                            "when > 0)."),
    val_source: Optional[str] = typer.Option(None, "--val", help="A separate validation task source (then "
                                                                 "--val-fraction is not used)."),
    eval_sources: Optional[list[str]] = typer.Option(None, "--eval",
                                                     help="Eval set for the contamination filter (repeatable), e.g. a "
                                                          "KernelBench checkout's level1/. Train rows are always "
                                                          "checked against the val rows too."),
    threshold: float = typer.Option(0.9, "--threshold", min=0.01, max=1.0,
                                    help="Similarity at or above which a task counts as contaminated (the corpus "
                                         "builder's measure)."),
    target: str = typer.Option("cuda", "--target",
                               help="Target the rows' system prompt is written for: 'cuda' or 'cpu'."),
    mode: str = typer.Option("strict", "--mode",
                             help="Audit mode named in the system prompt: 'strict' or 'permissive'."),
    seed: int = typer.Option(0, "--seed", help="Seed of the train/val split."),
    limit: Optional[int] = typer.Option(None, "--limit", min=1, help="Use only the first N tasks of the source."),
) -> None:
    from rich.console import Console

    from cudagym.tasks.model import Target
    from cudagym.train.prepare import PrepareConfig, prepare

    console = Console()
    if target not in ("cuda", "cpu"):
        _fail(console, CudagymError(f"--target must be 'cuda' or 'cpu', not {target!r}"))
    if mode not in ("strict", "permissive"):
        _fail(console, CudagymError(f"--mode must be 'strict' or 'permissive', not {mode!r}"))
    try:
        summary = prepare(PrepareConfig(source=source, out=out, val_fraction=val_fraction, val_source=val_source,
                                        eval_sources=list(eval_sources or []), threshold=threshold,
                                        target=Target(target), mode=mode, seed=seed, limit=limit))
    except CudagymError as e:
        _fail(console, e)
    console.print(f"train: {summary.train} rows ({summary.files['train']}); val: {summary.val} rows "
                  f"({summary.files['val']}); dropped as contaminated: {len(summary.dropped)}")
    for d in summary.dropped:
        console.print(f"  dropped {d['task_id']} ({d['split']}): {d['score']:.3f} like {d['nearest']}")
