"""The TRL adapter: one real GRPO step (TRL 1.16's GRPOTrainer, CPU) on a tiny random causal LM and
a tokenizer trained here, its rollouts real KernelEnv episodes on the CPU target (real compiler,
real sandbox) on a bundled task.

Each group of two episodes holds one played by the scripted policy (a guided episode: the stored
solution, through compile, verify, profile and submit) and one sampled from the random model
(which never writes a tool call, so its token budget -- the prompt plus `max_completion_length` --
ends it, and its empty workspace scores -1), so the group's rewards differ and the step has a
gradient.
"""

from __future__ import annotations

import os

import pytest
import torch

from cudagym.agent.scripted import ScriptedPolicy
from cudagym.env.kernel_env import EnvConfig, ShapingConfig
from cudagym.env.parsing import parse_text
from cudagym.tasks.loaders import bundled_task
from cudagym.train.trl import KernelRollout, RolloutConfig

from cudagym.train.tiny import kernel_texts, tiny_causal_lm, tiny_tokenizer

TASK = "ew_scale_bias_gelu"


class Recorder:
    """Keeps what the rollout function returned to the trainer (the adapter itself is unchanged)."""

    def __init__(self, rollout: KernelRollout):
        self.rollout = rollout
        self.outputs: list[dict] = []

    def __call__(self, prompts, trainer):
        out = self.rollout(prompts, trainer)
        self.outputs.append(out)
        return out


@pytest.fixture(scope="module")
def tokenizer():
    tok = tiny_tokenizer(kernel_texts([TASK]), vocab_size=800, eos="<|end|>")
    tok.padding_side = "left"
    return tok


def test_one_grpo_step_on_kernel_env(evaluator, tokenizer, tmp_path):
    from trl import GRPOConfig, GRPOTrainer

    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
    tok = tokenizer
    model = tiny_causal_lm(tok)
    before = {k: v.detach().clone() for k, v in model.named_parameters()}
    env_config = EnvConfig(target="cpu", max_turns=40, shaping=ShapingConfig(well_formed_turn=0.1, well_formed_cap=0.3))
    rollout = KernelRollout([bundled_task(TASK)], tokenizer=tok, env_config=env_config, evaluator=evaluator,
                            config=RolloutConfig(guided_per_group=1), guide=ScriptedPolicy())
    recorder = Recorder(rollout)
    args = GRPOConfig(output_dir=str(tmp_path / "grpo"), max_steps=1, per_device_train_batch_size=2, num_generations=2,
                      max_completion_length=2500, generation_kwargs={"max_new_tokens": 64}, learning_rate=1e-2,
                      beta=0.0, use_cpu=True, report_to=[], save_strategy="no", logging_steps=1,
                      dataloader_num_workers=0, seed=0)
    trainer = GRPOTrainer(model=model, args=args, processing_class=tok, train_dataset=rollout.dataset(),
                          reward_funcs=rollout.reward_funcs(), rollout_func=recorder)
    trainer.train()
    assert trainer.state.global_step == 1

    (out,) = recorder.outputs
    guided, sampled = out["episode"]
    # the scripted episode: write, compile, verify, profile, submit -> a correct verdict
    assert guided["guided"] and guided["terminated"] and guided["turns"] == 5, guided
    assert out["milestone_reward"][0] >= 1.0 and guided["milestone"] in ("correct", "faster_than_eager")
    assert out["shaping_reward"][0] == pytest.approx(0.3)  # 5 well-formed turns at 0.1, capped at 0.3
    # the random model's episode: no tool call, ended by its token budget, the empty workspace scored
    assert not sampled["guided"] and sampled["truncated_by"] == "tokens" and 10 < sampled["turns"] < 40, sampled
    assert out["milestone_reward"][1] == -1.0 and out["shaping_reward"][1] == 0.0
    assert sampled["parse_errors"] == sampled["turns"]
    # within its budget as tokenized (prompt + completion), and not far short of it (one turn's worth)
    for i, e in enumerate(out["episode"]):
        assert e["budget"] == len(out["prompt_ids"][i]) + 2500
        assert e["tokens"] == len(out["prompt_ids"][i]) + len(out["completion_ids"][i]) <= e["budget"]
    assert sampled["budget"] - sampled["tokens"] < 300

    # masks: the model's tokens are 1, the observations (rendered by the chat template) 0
    for ids, mask in zip(out["completion_ids"], out["env_mask"]):
        assert len(ids) == len(mask) and set(mask) == {0, 1}
        masked = tok.decode([t for t, m in zip(ids, mask) if m == 0])
        assert masked.count("<tool_response>") == masked.count("</tool_response>") >= 4
        assert "<|user|>" in masked and "<tool_response>" not in tok.decode([t for t, m in zip(ids, mask) if m])
    g_ids, g_mask = out["completion_ids"][0], out["env_mask"][0]
    written = tok.decode([t for t, m in zip(g_ids, g_mask) if m], skip_special_tokens=True)
    calls = parse_text(written).calls  # the guide's five turns, as trained on
    assert [c.name for c in calls] == ["write_file", "write_file", "compile", "verify", "profile", "submit"]
    assert calls[0].arguments["content"] == ScriptedPolicy().solution_files(TASK, "cpu")[calls[0].arguments["path"]]
    observed = tok.decode([t for t, m in zip(g_ids, g_mask) if not m])
    assert "[compile] Compile succeeded" in observed and "[verify] Verify PASSED" in observed
    assert "Submitted" not in observed  # the final observation is not appended

    # TRL saw the rewards, and the step moved the weights
    logged = trainer.state.log_history[0]
    assert logged["rewards/milestone_reward/mean"] == pytest.approx(sum(out["milestone_reward"]) / 2)
    assert logged["rewards/shaping_reward/mean"] == pytest.approx(0.15)
    assert logged["cudagym/turns"] == pytest.approx((5 + sampled["turns"]) / 2)
    changed = [k for k, v in model.named_parameters() if not torch.equal(v.detach().cpu(), before[k])]
    assert changed, "the GRPO step changed no weight"
    rollout.close()
