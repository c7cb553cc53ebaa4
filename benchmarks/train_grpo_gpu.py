"""A real GRPO run through KernelEnv: TRL's GRPOTrainer, a small random causal LM, rollouts with real
compile, verify and profile, the policy updated on the GPU (issue 14, part 6).

It proves the loop, not learning: the model (`cudagym.train.tiny`, a Llama of random weights built
from a config) and its tokenizer (a BPE trained here on the tasks' prompts and solutions) have
learned nothing, and a few steps teach them nothing. Each group of `--group-size` episodes holds
one played by the scripted policy (a guided episode: the stored solution through compile, verify,
profile and submit) and the rest sampled from the model, so the rewards within a group differ and
each step has a gradient; the shaping reward (0.1 per well-formed turn, capped at 0.3) is on.

Per step: the rollout's wall seconds (generation and env steps, episodes concurrent), the env's
seconds (the tool calls' own times summed over the step's episodes: they overlap), the update's
seconds (the rest of the step: log-probabilities, loss, backward, optimizer), the policy
process's peak GPU memory (the evaluator's workers are other processes), and the rewards with
their reasons. A table at the end; every number in `--out` (JSON), written after each step.

    python benchmarks/train_grpo_gpu.py [--steps 3] [--tasks ew_scale_bias_gelu,red_row_sum]
        [--group-size 2] [--max-completion-length 3000] [--target auto|cuda|cpu] [--out FILE.json]

Needs the dev extra's TRL and datasets (`pip install -e ".[dev]"`). On our lent GPU machine, where
nothing can be installed from an index, the package goes on PYTHONPATH and TRL 1.16.0, datasets
5.2.0, dill and multiprocess travel as wheels, installed with `pip install --no-index --no-deps
--target DIR` and put on PYTHONPATH too.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
import warnings
from collections import Counter
from pathlib import Path
from typing import Any

import torch
from rich.console import Console
from rich.table import Table

from cudagym.agent.scripted import ScriptedPolicy
from cudagym.env.kernel_env import EnvConfig, ShapingConfig
from cudagym.rewards.evaluator import Evaluator, EvaluatorConfig, resolve_target
from cudagym.tasks.loaders import bundled_task
from cudagym.train.tiny import kernel_texts, tiny_causal_lm, tiny_tokenizer
from cudagym.train.trl import KernelRollout, RolloutConfig


def progress(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


class Steps:
    """The rollout function TRL calls, timed, and the step boundaries (a TrainerCallback)."""

    def __init__(self, rollout: KernelRollout, cuda: bool, on_step: Any = lambda: None) -> None:
        self.rollout, self.cuda, self.on_step = rollout, cuda, on_step
        self.rows: list[dict[str, Any]] = []
        self._t0 = 0.0
        self._row: dict[str, Any] = {}

    def __call__(self, prompts: list[Any], trainer: Any) -> dict[str, Any]:
        t0 = time.perf_counter()
        out = self.rollout(prompts, trainer)
        episodes = out["episode"]
        self._row.update({
            "rollout_s": time.perf_counter() - t0,
            "env_s": sum(sum(e["tool_seconds"].values()) for e in episodes),
            "tool_s": {k: sum(e["tool_seconds"].get(k, 0.0) for e in episodes)
                       for k in sorted({k for e in episodes for k in e["tool_seconds"]})},
            "episodes": episodes,
            "milestone_reward": out["milestone_reward"], "shaping_reward": out["shaping_reward"]})
        return out

    def callback(self) -> Any:
        from transformers import TrainerCallback

        steps = self

        class _Timer(TrainerCallback):
            def on_step_begin(self, args, state, control, **kwargs) -> None:  # noqa: ANN001
                steps._t0, steps._row = time.perf_counter(), {}
                if steps.cuda:
                    torch.cuda.reset_peak_memory_stats()

            def on_step_end(self, args, state, control, **kwargs) -> None:  # noqa: ANN001
                row = steps._row
                row["step"] = state.global_step
                row["step_s"] = time.perf_counter() - steps._t0
                row["update_s"] = row["step_s"] - row.get("rollout_s", 0.0)
                row["peak_gpu_mib"] = torch.cuda.max_memory_allocated() / 2**20 if steps.cuda else None
                steps.rows.append(row)
                steps.on_step()
                progress(f"[grpo] step {row['step']}: {row['step_s']:.1f} s (rollout {row.get('rollout_s', 0):.1f}, "
                         f"update {row['update_s']:.1f}), rewards {row.get('milestone_reward')}")

        return _Timer()


def reasons(row: dict[str, Any]) -> str:
    """Each episode's milestone (guided or sampled) and how it ended, counted."""
    seen = Counter()
    for e in row["episodes"]:
        end = (e["milestone"] or "no verdict") + (f", ended by {e['truncated_by']}" if e["truncated_by"] else "")
        seen[f"{'guided' if e['guided'] else 'sampled'}: {end}"] += 1
    return "; ".join(f"{n}× {k}" for k, n in sorted(seen.items()))


def table(rows: list[dict[str, Any]], device: str) -> Table:
    t = Table(title=f"GRPO through KernelEnv on {device} (a random model: the loop, not learning)")
    for c in ("step", "rollout s", "env s (summed)", "update s", "peak GPU MiB", "milestone reward mean (min..max)",
              "shaping mean", "episodes: outcome"):
        t.add_column(c)
    for r in rows:
        m = r.get("milestone_reward") or [0.0]
        t.add_row(str(r["step"]), f"{r.get('rollout_s', 0):.1f}", f"{r.get('env_s', 0):.1f}", f"{r['update_s']:.1f}",
                  "-" if r["peak_gpu_mib"] is None else f"{r['peak_gpu_mib']:.0f}",
                  f"{statistics.fmean(m):+.2f} ({min(m):+.1f}..{max(m):+.1f})",
                  f"{statistics.fmean(r.get('shaping_reward') or [0.0]):.2f}", reasons(r) if "episodes" in r else "-")
    return t


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=3, help="GRPO steps (default 3)")
    ap.add_argument("--tasks", default="ew_scale_bias_gelu,red_row_sum", help="comma-separated bundled task ids")
    ap.add_argument("--group-size", type=int, default=2, help="episodes per prompt (GRPO's num_generations; default 2)")
    ap.add_argument("--groups", type=int, default=2, help="prompts per step (default 2)")
    ap.add_argument("--max-completion-length", type=int, default=3000,
                    help="tokens an episode may add to its prompt (model turns and observations; default 3000)")
    ap.add_argument("--turn-tokens", type=int, default=64, help="tokens the model generates per turn (default 64)")
    ap.add_argument("--layers", type=int, default=2, help="the model's layers (default 2)")
    ap.add_argument("--hidden", type=int, default=128, help="the model's width (default 128)")
    ap.add_argument("--target", choices=("auto", "cuda", "cpu"), default="auto")
    ap.add_argument("--out", type=Path, help="write every number to this JSON file (after each step)")
    args = ap.parse_args()
    if args.steps < 1 or args.group_size < 2 or args.groups < 1:
        ap.error("--steps and --groups must be at least 1, --group-size at least 2 (one guided, one sampled)")
    task_ids = [t.strip() for t in args.tasks.split(",") if t.strip()]
    try:
        tasks = [bundled_task(t) for t in task_ids]
    except Exception as e:  # noqa: BLE001 - the loader names the bad id
        ap.error(str(e))
    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
    warnings.filterwarnings("ignore", category=FutureWarning)  # transformers' renames, TRL's notices: not ours
    from transformers import PrinterCallback, ProgressCallback
    from transformers.utils import logging as hf_logging
    from trl import GRPOConfig, GRPOTrainer

    hf_logging.set_verbosity_error()

    target = resolve_target(args.target)
    cuda = target == "cuda"
    device = torch.cuda.get_device_name() if cuda else "the CPU target"
    progress(f"[grpo] {device}; tasks {', '.join(task_ids)}; "
             f"{args.steps} steps of {args.groups} groups × {args.group_size}")
    tok = tiny_tokenizer(kernel_texts(task_ids, target), vocab_size=2000, eos="<|end|>")
    tok.padding_side = "left"
    model = tiny_causal_lm(tok, layers=args.layers, hidden=args.hidden)
    report: dict[str, Any] = {"device": device, "target": target, "torch": torch.__version__,
                              "args": vars(args) | {"out": str(args.out)},
                              "parameters": sum(p.numel() for p in model.parameters()), "steps": []}

    def save() -> None:
        if args.out:
            args.out.parent.mkdir(parents=True, exist_ok=True)
            args.out.write_text(json.dumps(report, indent=1, default=str))

    env_config = EnvConfig(target=target, max_turns=40,
                           shaping=ShapingConfig(well_formed_turn=0.1, well_formed_cap=0.3))
    with tempfile.TemporaryDirectory(prefix="cudagym-grpo-") as work, \
            Evaluator(EvaluatorConfig(target=target, mode=env_config.mode, cache_dir=Path(work) / "cache")) as ev:
        rollout = KernelRollout(tasks, tokenizer=tok, env_config=env_config, evaluator=ev,
                                config=RolloutConfig(guided_per_group=1), guide=ScriptedPolicy())
        steps = Steps(rollout, cuda, on_step=save)
        report["steps"] = steps.rows
        batch = args.groups * args.group_size
        config = GRPOConfig(output_dir=str(Path(work) / "grpo"), max_steps=args.steps,
                            per_device_train_batch_size=batch,
                            num_generations=args.group_size, max_completion_length=args.max_completion_length,
                            generation_kwargs={"max_new_tokens": args.turn_tokens}, learning_rate=1e-3, beta=0.0,
                            use_cpu=not cuda, report_to=[], save_strategy="no", logging_steps=1,
                            dataloader_num_workers=0, seed=0)
        trainer = GRPOTrainer(model=model, args=config, processing_class=tok, train_dataset=rollout.dataset(repeat=64),
                              reward_funcs=rollout.reward_funcs(), rollout_func=steps, callbacks=[steps.callback()])
        for quiet in (PrinterCallback, ProgressCallback):  # the table and stderr's lines say it all
            trainer.remove_callback(quiet)
        report["policy_device"] = str(next(trainer.model.parameters()).device)
        t0 = time.perf_counter()
        trainer.train()
        report["train_s"] = time.perf_counter() - t0
        report["log_history"] = trainer.state.log_history
        rollout.close()
    save()
    console = Console(width=200)
    console.print(table(steps.rows, device))
    console.print(
        f"policy on {report['policy_device']}, {report['parameters']:,} parameters; {len(steps.rows)} steps in "
        f"{report['train_s']:.0f} s. A random model: this run proves the loop (rollouts through real compile, "
        f"verify and profile; the policy updated), not learning."
    )


if __name__ == "__main__":
    main()
