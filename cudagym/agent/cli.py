"""`cudagym run` (episodes → trajectory store → results table) and `cudagym report DIR`."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer


def register(app: typer.Typer) -> None:
    """Add the agent commands to the top-level app."""

    @app.command("run")
    def run_cmd(
        tasks: str = typer.Option("bundled", "--tasks", help="Task source: 'bundled', a bundled task id, a task .py file, a KernelBench-style directory or an Ops-6K .parquet."),
        policy: str = typer.Option("scripted", "--policy", help="'scripted' (replays examples/solutions), 'openai' (an OpenAI-compatible server: OPENAI_BASE_URL, OPENAI_API_KEY, CUDAGYM_MODEL) or 'module:function' (a Python callable)."),
        episodes: int = typer.Option(1, "--episodes", min=1, help="Episodes per task."),
        limit: Optional[int] = typer.Option(None, "--limit", min=1, help="Run only the first N tasks of the source."),
        concurrency: int = typer.Option(4, "--concurrency", min=1, help="Episodes running at once (the evaluator queues device work itself)."),
        target: str = typer.Option("auto", "--target", help="Kernel target: 'auto' (CUDA if a GPU is present, else CPU), 'cuda' or 'cpu'."),
        out: Optional[Path] = typer.Option(None, "--out", help="Run directory for trajectories and the report (default runs/<timestamp>). Rerun with the same directory to resume."),
        max_turns: int = typer.Option(30, "--max-turns", min=1, help="Turn budget per episode; at the limit the workspace is scored as it stands."),
        mode: str = typer.Option("strict", "--mode", help="Op audit: 'strict' (only your kernels plus allocation/view ops in forward) or 'permissive' (torch ops allowed, own kernels must carry the work)."),
        atol: Optional[float] = typer.Option(None, "--atol", help="Absolute tolerance of the output check for every task (with --rtol; default: each task's own)."),
        rtol: Optional[float] = typer.Option(None, "--rtol", help="Relative tolerance of the output check for every task (with --atol; default: each task's own)."),
        max_context_tokens: Optional[int] = typer.Option(None, "--max-context-tokens", help="Keep each policy prompt under this many tokens (older tool outputs are elided first)."),
        tokenizer: Optional[Path] = typer.Option(None, "--tokenizer", help="A tokenizer.json (Hugging Face tokenizers) for exact token counts; default: 4 chars per token."),
        solutions: Optional[Path] = typer.Option(None, "--solutions", help="Solutions root of the scripted policy (default: examples/solutions of the repository)."),
        model: Optional[str] = typer.Option(None, "--model", help="Model name for --policy openai (default: $CUDAGYM_MODEL)."),
        base_url: Optional[str] = typer.Option(None, "--base-url", help="Server URL for --policy openai (default: $OPENAI_BASE_URL)."),
        tool_mode: str = typer.Option("native", "--tool-mode", help="For --policy openai: 'native' tool calls or 'hermes' <tool_call> text."),
        seed: int = typer.Option(0, "--seed", help="Seed of the environments' random generators."),
        sandbox: str = typer.Option("local", "--sandbox", help="Sandbox backend of the checks: 'local' (worker processes on this host) or 'docker' (a container per worker; image from `cudagym sandbox image build`)."),
        contrastive: int = typer.Option(0, "--contrastive", min=0, help="Contrastive feedback (CUDA-L1): show each episode the best K earlier measured variants of its task, with their speedups (kept in OUT/variants.jsonl); one task's episodes then run in order. 0: off."),
        require_analysis: bool = typer.Option(False, "--require-analysis", help="Ask for a performance analysis in <analysis>...</analysis> before each turn's tool call."),
        analysis_reward: float = typer.Option(0.0, "--analysis-reward", help="Shaping reward, once per episode, for the first turn with an analysis."),
        backend: str = typer.Option("local", "--backend", help="Where checks run: 'local' (an evaluator in this process, this host's GPUs) or 'ray' (an evaluation pool on a Ray cluster: an actor per GPU, compile actors; needs cudagym[ray])."),
        server_gaps: Optional[str] = typer.Option(None, "--server-gaps", help="Also time every profile in server mode (CUDA-L2): each call after an idle gap drawn from LOW,HIGH ms (e.g. 1,10), reported beside the offline time; the reward stays offline."),
        reward_against: Optional[str] = typer.Option(None, "--reward-against", help="The baselines of the +2 and +3 milestones, A,B among eager, compiled, cublaslt, cublaslt_tuned (default eager,compiled; the cuBLASLt ones exist for GEMM tasks on a GPU, other tasks fall back to the default)."),
        spare_workers: Optional[int] = typer.Option(None, "--spare-workers", min=0, help="Warm worker processes kept per device (default 6 per GPU, 2 on the CPU). Each check takes one; with many episodes at once, more spares keep checks from waiting for workers to start, at the cost of a CUDA context and host memory for each."),
        ray_address: Optional[str] = typer.Option(None, "--ray-address", help="With --backend ray: the cluster to run the pool on (e.g. 'auto' or 'HOST:6379'); default: a local Ray instance started for this run."),
    ) -> None:
        """Run a policy over a task set and print the results table."""
        from rich.console import Console

        from cudagym.agent.report import render_table
        from cudagym.agent.runner import RunConfig, run
        from cudagym.errors import CudagymError
        from cudagym.rewards.milestone import RewardConfig
        from cudagym.sandbox.protocol import TimingConfig
        from cudagym.tasks.model import optional_tolerance

        console = Console()
        try:
            cfg = RunConfig(tasks=tasks, policy=policy, episodes=episodes, limit=limit, concurrency=concurrency,
                            target=target, out=out, max_turns=max_turns, mode=mode,
                            tolerance=optional_tolerance(atol, rtol), max_context_tokens=max_context_tokens,
                            tokenizer=tokenizer, solutions=solutions, model=model, base_url=base_url, tool_mode=tool_mode,
                            seed=seed, contrastive=contrastive, require_analysis=require_analysis,
                            analysis_reward=analysis_reward, backend=backend, ray_address=ray_address,
                            sandbox=sandbox,
                            server_gap_ms=TimingConfig.parse_idle(server_gaps) if server_gaps else None,
                            reward_against=RewardConfig.parse_against(reward_against) if reward_against else None,
                            spare_workers=spare_workers)
            summary = run(cfg, console)
        except (CudagymError, ValueError, ImportError) as e:
            console.print(f"[red]error:[/] {e}")
            raise typer.Exit(2) from None
        console.print(render_table(summary.rows, title=f"cudagym results ({summary.out})"))
        console.print(f"ran {summary.ran} episodes, skipped {summary.skipped} already complete, "
                      f"in {summary.seconds:.1f}s; report: {summary.report_md}; plot: {summary.plot}")

    export = typer.Typer(no_args_is_help=True, help="Export a run's trajectories as training data.")
    app.add_typer(export, name="export")

    @export.command("sft")
    def export_sft_cmd(
        run_dir: Path = typer.Argument(..., exists=True, file_okay=False, help="A run directory written by `cudagym run`."),
        out: Path = typer.Option(..., "--out", help="Output file: .jsonl (JSON lines) or .parquet."),
        min_milestone: str = typer.Option("correct", "--min-milestone", help="Keep episodes whose final verdict reached this: correct, faster_than_eager or faster_than_compile."),
        min_speedup: Optional[float] = typer.Option(None, "--min-speedup", help="Also require at least this speedup over eager PyTorch."),
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
                      f"skipped" + (f", {s.without_conversation} recorded without a conversation" if s.without_conversation
                                    else "") + ")")

    @app.command("report")
    def report_cmd(
        run_dir: Path = typer.Argument(..., exists=True, file_okay=False, help="A run directory written by `cudagym run`."),
    ) -> None:
        """Print the results table of a run directory and write report.md, report.json and speedup.png."""
        from rich.console import Console

        from cudagym.agent.report import render_table, write_report

        console = Console()
        rows, md, png = write_report(run_dir)
        console.print(render_table(rows, title=f"cudagym results ({run_dir})"))
        console.print(f"report: {md}; plot: {png}")
