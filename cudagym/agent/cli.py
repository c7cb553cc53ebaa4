"""`cudagym run` (episodes → trajectory store → results table) and `cudagym report DIR`."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from cudagym.agent.runner import RunConfig
from cudagym.options import option
from cudagym.rewards.evaluator import EvaluatorConfig
from cudagym.rewards.milestone import RewardConfig
from cudagym.sandbox.config import SpareWorkerConfig


def register(app: typer.Typer) -> None:
    """Add the agent commands to the top-level app."""

    @app.command("run")
    def run_cmd(
        tasks: str = option(RunConfig, "tasks", "--tasks"),
        policy: str = option(RunConfig, "policy", "--policy"),
        episodes: int = option(RunConfig, "episodes", "--episodes"),
        limit: Optional[int] = option(RunConfig, "limit", "--limit"),
        concurrency: int = option(RunConfig, "concurrency", "--concurrency"),
        target: str = option(EvaluatorConfig, "target", "--target"),
        out: Optional[Path] = option(RunConfig, "out", "--out"),
        max_turns: int = option(RunConfig, "max_turns", "--max-turns"),
        mode: str = option(EvaluatorConfig, "mode", "--mode"),
        atol: Optional[float] = typer.Option(None, "--atol", help="Absolute tolerance of the output check for every "
                                             "task (with --rtol; default: each task's own)."),
        rtol: Optional[float] = typer.Option(None, "--rtol", help="Relative tolerance of the output check for every "
                                             "task (with --atol; default: each task's own)."),
        max_context_tokens: Optional[int] = option(RunConfig, "max_context_tokens", "--max-context-tokens"),
        tokenizer: Optional[Path] = option(RunConfig, "tokenizer", "--tokenizer"),
        solutions: Optional[Path] = option(RunConfig, "solutions", "--solutions"),
        model: Optional[str] = option(RunConfig, "model", "--model"),
        base_url: Optional[str] = option(RunConfig, "base_url", "--base-url"),
        tool_mode: str = option(RunConfig, "tool_mode", "--tool-mode"),
        seed: int = option(RunConfig, "seed", "--seed"),
        sandbox: str = option(EvaluatorConfig, "sandbox", "--sandbox"),
        contrastive: int = option(RunConfig, "contrastive", "--contrastive"),
        require_analysis: bool = option(RunConfig, "require_analysis", "--require-analysis"),
        analysis_reward: float = option(RunConfig, "analysis_reward", "--analysis-reward"),
        backend: str = option(RunConfig, "backend", "--backend"),
        server_gaps: Optional[str] = option(EvaluatorConfig, "server_gap_ms", "--server-gaps"),
        reward_against: Optional[str] = option(RewardConfig, "against", "--reward-against", default=None),
        spare_workers: Optional[int] = option(SpareWorkerConfig, "spare_workers", "--spare-workers"),
        ray_address: Optional[str] = option(RunConfig, "ray_address", "--ray-address"),
    ) -> None:
        """Run a policy over a task set and print the results table."""
        from rich.console import Console

        from cudagym.agent.report import render_table
        from cudagym.agent.runner import run
        from cudagym.errors import CudagymError
        from cudagym.sandbox.protocol import TimingConfig
        from cudagym.tasks.model import optional_tolerance

        console = Console()
        try:
            evaluator = EvaluatorConfig.model_validate({
                "target": target, "mode": mode, "sandbox": {"backend": sandbox, "spare_workers": spare_workers},
                "server_gap_ms": TimingConfig.parse_idle(server_gaps) if server_gaps else None,
                **({"reward": {"against": RewardConfig.parse_against(reward_against)}} if reward_against else {})})
            # validated as the evaluator's options are: the choices of --tool-mode and --backend come as str
            cfg = RunConfig.model_validate(dict(
                tasks=tasks, policy=policy, episodes=episodes, limit=limit, concurrency=concurrency,
                evaluator=evaluator, out=out, max_turns=max_turns, tolerance=optional_tolerance(atol, rtol),
                max_context_tokens=max_context_tokens, tokenizer=tokenizer, solutions=solutions, model=model,
                base_url=base_url, tool_mode=tool_mode, seed=seed, contrastive=contrastive,
                require_analysis=require_analysis, analysis_reward=analysis_reward, backend=backend,
                ray_address=ray_address))
            summary = run(cfg, console)
        except (CudagymError, ValueError, ImportError) as e:
            console.print(f"[red]error:[/] {e}")
            raise typer.Exit(2) from None
        except KeyboardInterrupt:
            console.print("interrupted: the complete episodes are kept in the run's directory; "
                          "the same command goes on from them")
            raise typer.Exit(130) from None
        console.print(render_table(summary.rows, title=f"cudagym results ({summary.out})"))
        console.print(f"ran {summary.ran} episodes, skipped {summary.skipped} already complete, "
                      f"in {summary.seconds:.1f}s; report: {summary.report_md}; plot: {summary.plot}")

    export = typer.Typer(no_args_is_help=True, help="Export a run's trajectories as training data.")
    app.add_typer(export, name="export")

    @export.command("sft")
    def export_sft_cmd(
        run_dir: Path = typer.Argument(..., exists=True, file_okay=False,
                                       help="A run directory written by `cudagym run`."),
        out: Path = typer.Option(..., "--out", help="Output file: .jsonl (JSON lines) or .parquet."),
        min_milestone: str = typer.Option("correct", "--min-milestone",
                                          help="Keep episodes whose final verdict reached this: correct, "
                                               "faster_than_eager or faster_than_compile."),
        min_speedup: Optional[float] = typer.Option(None, "--min-speedup",
                                                    help="Also require at least this speedup over eager PyTorch."),
    ) -> None:
        """Write the episodes whose final verdict passed the threshold as chat-format SFT data (TRL's
        SFTTrainer reads it), one row per distinct solution."""
        from rich.console import Console

        from cudagym.agent.export import ExportFilter, export_sft
        from cudagym.errors import CudagymError

        console = Console()
        try:
            s = export_sft(run_dir, out, ExportFilter(min_milestone=min_milestone, min_speedup=min_speedup))
        except CudagymError as e:
            console.print(f"[red]error:[/] {e}")
            raise typer.Exit(2) from None
        console.print(f"exported {s.kept} of {s.episodes} episodes to {s.out} ({s.duplicates} duplicate solutions "
                      f"skipped" + (f", {s.without_conversation} recorded without a conversation"
                                    if s.without_conversation else "") + ")")

    @app.command("report")
    def report_cmd(
        run_dir: Path = typer.Argument(..., exists=True, file_okay=False,
                                       help="A run directory written by `cudagym run`."),
    ) -> None:
        """Print the results table of a run directory and write report.md, report.json and speedup.png."""
        from rich.console import Console

        from cudagym.agent.report import render_table, write_report

        console = Console()
        rows, md, png = write_report(run_dir)
        console.print(render_table(rows, title=f"cudagym results ({run_dir})"))
        console.print(f"report: {md}; plot: {png}")
