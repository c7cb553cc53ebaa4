"""The CUDA-L1 recipe's pieces: contrastive feedback (earlier variants and their speedups in the
next round's prompt, an analysis section with its shaping reward) and the SFT export of a run,
read back through TRL's own SFT data path."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from cudagym.agent.export import ExportFilter, export_sft, solution_hash, tool_calls
from cudagym.agent.runner import RunConfig, arun
from cudagym.agent.store import TrajectoryStore
from cudagym.env.kernel_env import KernelEnv
from cudagym.env.variants import ContrastiveConfig, Variant, VariantBook, has_analysis
from cudagym.errors import ConfigError
from cudagym.rewards.evaluator import EvaluatorConfig
from cudagym.tasks.loaders import bundled_task

TASK = "ew_scale_bias_gelu"
REPO = Path(__file__).resolve().parent.parent


def _variant(files: str, correct: bool, speedup: float | None, episode: str = "e") -> Variant:
    return Variant(task_id="t", episode=episode, files={"model_new.py": files}, correct=correct,
                   speedup_vs_eager=speedup, reasons=[f"reason of {files}"])


def test_book_ranks_dedups_renders_and_persists(tmp_path):
    book = VariantBook(tmp_path / "v.jsonl")
    book.add(_variant("slow", True, 0.8))
    book.add(_variant("fast", True, 2.5))
    book.add(_variant("wrong", False, None))
    book.add(_variant("fast", True, 1.0))  # the same files measured worse: the better measurement stays
    assert [v.files["model_new.py"] for v in book.best("t", 5)] == ["fast", "slow", "wrong"]
    text = book.render("t", 2, 1000)
    assert text.index("2.500x vs eager") < text.index("0.800x vs eager") and "wrong" not in text
    assert "reason of fast" in text and "```\nfast\n```" in text
    again = VariantBook(tmp_path / "v.jsonl")  # read back from its file
    assert [v.files["model_new.py"] for v in again.best("t", 5)] == ["fast", "slow", "wrong"]
    assert VariantBook().render("t", 3, 1000) == ""


def test_analysis_must_come_before_the_tool_call():
    call = '<tool_call>{"name": "profile", "arguments": {}}</tool_call>'
    assert has_analysis(f"<analysis>v2 was fastest: fewer passes</analysis>\n{call}")
    assert not has_analysis(f"{call}\n<analysis>late</analysis>")
    assert not has_analysis(f"<analysis>  </analysis>{call}")
    assert not has_analysis(call)


async def test_analysis_shaping_is_paid_once_and_a_missing_one_is_noted(evaluator, tmp_path):
    cfg = {"contrastive": ContrastiveConfig(require_analysis=True, analysis_reward=0.2)}
    env = KernelEnv(tasks=[bundled_task(TASK)], evaluator=evaluator, workspace_root=tmp_path, **cfg)
    prompt, _ = await env.areset()
    assert "<analysis>" in prompt
    call = '<tool_call>{"name": "list_files", "arguments": {}}</tool_call>'
    obs, reward, *_ , info = await env.astep(call)
    assert reward == 0 and "no <analysis>" in obs
    obs, reward, *_ , info = await env.astep(f"<analysis>nothing measured yet</analysis>{call}")
    assert reward == pytest.approx(0.2) and "shaping: first performance analysis +0.2" in info["reward_reasons"]
    obs, reward, *_ = await env.astep(f"<analysis>still nothing</analysis>{call}")
    assert reward == 0  # paid once per episode
    env.close()


@pytest.fixture(scope="module")
def contrastive_run(tmp_path_factory):
    """Two rounds of the scripted policy on one task, contrastive feedback on (CPU target)."""
    import asyncio

    from rich.console import Console

    out = tmp_path_factory.mktemp("contrastive") / "run"
    cfg = RunConfig(tasks=TASK, policy="scripted", episodes=2, concurrency=2, evaluator=EvaluatorConfig(target="cpu"),
                    out=out, contrastive=3)
    with open(os.devnull, "w") as sink:
        summary = asyncio.run(arun(cfg, Console(file=sink)))
    assert summary.ran == 2
    return out


def test_second_round_prompt_shows_the_first_rounds_variants_and_speedups(contrastive_run):
    store = TrajectoryStore(contrastive_run)
    first, second = store.summaries()  # episode ids sort as rounds: @0, @1
    assert first["verdict"]["correct"], first["verdict"]
    task_prompt = [m for m in store.conversation(second["episode_id"])["messages"] if m["role"] == "user"][0]["content"]
    assert "Earlier variants of this task" in task_prompt
    # the first round's measurements (its profile and its final verdict), with its code
    variants = [json.loads(line) for line in (contrastive_run / "variants.jsonl").read_text().splitlines()]
    from_first = [v for v in variants if v["episode"] == variants[0]["episode"] and v["speedup_vs_eager"] is not None]
    assert from_first  # rounds run in order: the file's first variants are the first round's
    assert any(f"{v['speedup_vs_eager']:.3f}x vs eager" in task_prompt for v in from_first), task_prompt[-3000:]
    assert from_first[0]["files"]["model_new.py"].strip()[:300] in task_prompt
    round_one = [m for m in store.conversation(first["episode_id"])["messages"] if m["role"] == "user"][0]["content"]
    assert "Earlier variants" not in round_one  # nothing measured before the first round


def test_sft_export_keeps_correct_episodes_once_and_loads_through_trl(contrastive_run, tmp_path):
    out = tmp_path / "sft.jsonl"
    s = export_sft(contrastive_run, out)
    assert (s.episodes, s.kept, s.duplicates) == (2, 1, 1)  # the scripted policy writes the same solution twice
    (row,) = [json.loads(line) for line in out.read_text().splitlines()]
    roles = [m["role"] for m in row["messages"]]
    assert roles[:3] == ["system", "user", "assistant"]
    # the scripted policy writes Hermes <tool_call> blocks in its text: kept as written, and answered
    # by <tool_response> user messages
    assert {"write_file", "submit"} <= {name for m in row["messages"] for name, _ in tool_calls(m)}
    assert all(m["content"].startswith("<tool_response>") for m in row["messages"][3:] if m["role"] == "user")
    assert row["metadata"]["task_id"] == TASK and row["metadata"]["milestone"] in ("correct", "faster_than_eager")
    assert row["metadata"]["solution_hash"] == solution_hash(row["messages"])
    assert {t["function"]["name"] for t in row["tools"]} >= {"write_file", "compile", "verify", "profile", "submit"}

    none = export_sft(contrastive_run, tmp_path / "none.parquet", ExportFilter(min_milestone="faster_than_compile"))
    assert none.kept == 0 and (tmp_path / "none.parquet").is_file()
    with pytest.raises(ConfigError, match="not a run directory"):
        export_sft(tmp_path, tmp_path / "x.jsonl")

    _through_trl(out, tmp_path)


def _through_trl(path: Path, tmp_path: Path) -> None:
    """TRL's SFTTrainer prepares the export (chat template, tokenization) and takes one step
    with a tiny random model and a tokenizer built here."""
    from datasets import load_dataset
    from trl import SFTConfig, SFTTrainer

    from cudagym.train.tiny import tiny_causal_lm, tiny_tokenizer

    data = load_dataset("json", data_files=str(path), split="train")
    tok = tiny_tokenizer(m["content"] or "" for row in data for m in row["messages"])
    model = tiny_causal_lm(tok)
    args = SFTConfig(output_dir=str(tmp_path / "trl"), max_steps=1, per_device_train_batch_size=1, max_length=2048,
                     report_to=[], use_cpu=True, save_strategy="no", logging_strategy="no", dataloader_num_workers=0)
    trainer = SFTTrainer(model=model, args=args, train_dataset=data, processing_class=tok)
    prepared = trainer.train_dataset
    assert "input_ids" in prepared.column_names and len(prepared) == 1
    assert tok.decode(prepared[0]["input_ids"][:1]) == "<|system|>"  # the chat template's rendering, cut at max_length
    whole = tok.apply_chat_template(data[0]["messages"], tokenize=False)
    assert whole.count("<|assistant|>") == sum(m["role"] == "assistant" for m in data[0]["messages"])
    assert '"name": "write_file"' in whole
    trainer.train()
    assert trainer.state.global_step == 1
