"""The verl path (verl 0.9.1's real classes, CPU): the cudagym_kernel agent loop, prepared data, stage configs.

The agent loop is built as verl's `AgentLoopWorker` builds it (the registry entry of the packaged
agent-loop file, `hydra.utils.instantiate`, verl's composed trainer config), with a tokenizer
trained here (byte-level BPE, a ChatML-style template) and a stand-in for verl's server manager
that answers each turn with the scripted policy's text, tokenized by that tokenizer. Episodes run
on bundled tasks on the CPU target: real compiler, sandbox and evaluator.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest

try:
    import verl  # noqa: F401
except ImportError:  # CI installs it (.ci/verl-nodeps.txt): there a missing verl is a failure
    if os.environ.get("CI"):
        raise
    pytest.skip("verl is not installed: pip install --no-deps -r .ci/verl-nodeps.txt", allow_module_level=True)

from omegaconf import OmegaConf
from typer.testing import CliRunner

from conftest import SOLUTIONS, cpu_config
from cudagym.agent.policy import TurnContext
from cudagym.agent.scripted import ScriptedPolicy
from cudagym.cli import app
from cudagym.rewards.evaluator import Evaluator
from cudagym.tasks.loaders import bundled_task, bundled_tasks
from cudagym.train.launch import resolve_config, validate_config
from cudagym.train.prepare import PrepareConfig, prepare
from cudagym.train.verl_loop import AGENT_NAME, METRIC_KEYS, EvaluatorSpec, install_evaluator, release_evaluator

TEMPLATE = (
    "{% if tools %}<|im_start|>system\n# Tools\n{% for t in tools %}{{ t | tojson }}\n{% endfor %}<|im_end|>{% endif %}"
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
EOS = "<|im_end|>"
SPEC = EvaluatorSpec(backend="local", target="cpu", mode="strict", compile_baseline=False)
EVAL_OVERRIDES = [f"cudagym.evaluator.{k}={v}" for k, v in
                  (("backend", "local"), ("target", "cpu"), ("mode", "strict"), ("compile_baseline", "false"))]
TASKS = ("ew_scale_bias_gelu", "norm_softmax")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tokenizer (byte-level BPE trained on the tasks, solutions and prompts) and a tiny Llama
    config, saved as a Hugging Face model directory (no weights: verl's config classes read the
    config and the tokenizer)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, PreTrainedTokenizerFast

    from cudagym.agent.prompt import system_prompt

    texts = [t.code for t in bundled_tasks()] + [p.read_text() for p in SOLUTIONS.rglob("*") if p.is_file()]
    texts.append(system_prompt("cpu", "strict"))
    raw = Tokenizer(models.BPE())
    raw.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    raw.decoder = decoders.ByteLevel()
    raw.train_from_iterator(texts, trainers.BpeTrainer(
        vocab_size=2000, special_tokens=["<pad>", "<|im_start|>", EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tok = PreTrainedTokenizerFast(tokenizer_object=raw, pad_token="<pad>", eos_token=EOS)
    tok.chat_template = TEMPLATE
    d = tmp_path_factory.mktemp("tiny-model")
    tok.save_pretrained(d)
    LlamaConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                num_key_value_heads=2, max_position_embeddings=131072,
                architectures=["LlamaForCausalLM"]).save_pretrained(d)
    return d


@pytest.fixture(scope="module")
def tokenizer(model_dir: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir)


class ReplayServer:
    """Stands in for verl's `LLMServerClient`: the scripted policy's turn for the task named in the
    prompt, tokenized with the real tokenizer, cut at ``max_tokens`` like a server would; its
    `TokenOutput.extra_fields` are what `LLMServerClient.generate` returns (the weights version
    ``global_steps``, and ``min_global_steps``/``max_global_steps`` set from it), the version
    moving on by `steps_per_turn` each turn as under partial rollout."""

    def __init__(self, tokenizer: Any, global_steps: int = 3, steps_per_turn: int = 0):
        self.tokenizer = tokenizer
        self.global_steps = global_steps
        self.steps_per_turn = steps_per_turn
        self.policy = ScriptedPolicy(SOLUTIONS)
        self.turns: dict[str, int] = {}
        self.sent: dict[str, list[str]] = {}  # task id -> the texts sent, in order
        self.max_tokens: list[int] = []

    async def generate(self, request_id: str, *, prompt_ids: list[int], sampling_params: dict[str, Any],
                       **kwargs: Any) -> Any:
        from verl.workers.rollout.replica import TokenOutput

        prompt = self.tokenizer.decode(prompt_ids)
        task_id = prompt.split("Task id: ", 1)[1].split(";", 1)[0]
        turn = self.turns.get(request_id, 0)
        self.turns[request_id] = turn + 1
        reply = await self.policy.aact([], [], TurnContext(episode_id=request_id, task_id=task_id, target="cpu",
                                                           turn=turn))
        ids = self.tokenizer.encode(reply.content + EOS, add_special_tokens=False)
        self.max_tokens.append(sampling_params["max_tokens"])
        ids = ids[: sampling_params["max_tokens"]]
        self.sent.setdefault(task_id, []).append(self.tokenizer.decode(ids))
        steps = self.global_steps + turn * self.steps_per_turn
        return TokenOutput(token_ids=ids, log_probs=[-0.5] * len(ids), stop_reason="completed", num_preempted=0,
                           extra_fields={"global_steps": steps, "min_global_steps": steps, "max_global_steps": steps})


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("verl-data")
    prepare(PrepareConfig(source="bundled", out=out, val_fraction=0.2, target="cpu"))
    return out


@pytest.fixture(scope="module")
def loop_env(tmp_path_factory: pytest.TempPathFactory, model_dir: Path, tokenizer: Any, data_dir: Path):
    """verl's trainer config for the tests, the dataset rows by task id, and the evaluator."""
    from verl.utils.dataset.rl_dataset import RLHFDataset

    tmp = tmp_path_factory.mktemp("verl-loop")
    cfg = resolve_config("grpo", [f"actor_rollout_ref.model.path={model_dir}", *EVAL_OVERRIDES,
                                  f"data.train_files={data_dir / 'train.parquet'}",
                                  f"data.val_files={data_dir / 'val.parquet'}", "data.train_batch_size=2",
                                  "actor_rollout_ref.actor.ppo_mini_batch_size=2",
                                  "data.max_prompt_length=8192", "data.max_response_length=16384"])
    validate_config(cfg)
    rows: dict[str, dict[str, Any]] = {}
    for split in ("train", "val"):
        ds = RLHFDataset(str(data_dir / f"{split}.parquet"), tokenizer, cfg.data)
        for i in range(len(ds)):
            row = ds[i]
            rows[row["extra_info"]["task_id"]] = row
    ev = Evaluator(cpu_config(tmp / "cache"))
    install_evaluator(SPEC, ev)
    try:
        yield cfg, rows
    finally:
        release_evaluator(SPEC)
        ev.close()


def _make_loop(cfg: Any, tokenizer: Any, server: ReplayServer) -> Any:
    """The loop as verl's AgentLoopWorker makes it: registry entries from the agent-loop file, instantiated by Hydra."""
    import hydra
    from verl.experimental.agent_loop.agent_loop import DictConfigWrap, ToolListWrap, _agent_loop_registry
    from verl.utils.dataset.rl_dataset import RLHFDataset

    for entry in OmegaConf.load(cfg.actor_rollout_ref.rollout.agent.agent_loop_config_path):
        _agent_loop_registry[entry.name] = entry
    return hydra.utils.instantiate(
        config=_agent_loop_registry[AGENT_NAME], trainer_config=DictConfigWrap(config=cfg), server_manager=server,
        tokenizer=tokenizer, processor=None, hf_model_type=None, dataset_cls=RLHFDataset,
        data_config=DictConfigWrap(cfg.data), tools=ToolListWrap([]))


def _runs(mask: list[int]) -> list[tuple[int, int, int]]:
    """(value, start, end) of each run of equal mask values."""
    out, start = [], 0
    for i in range(1, len(mask) + 1):
        if i == len(mask) or mask[i] != mask[start]:
            out.append((mask[start], start, i))
            start = i
    return out


async def test_episodes_through_verl_agent_loop(loop_env: Any, tokenizer: Any) -> None:
    import asyncio

    cfg, rows = loop_env
    server = ReplayServer(tokenizer)
    loop = _make_loop(cfg, tokenizer, server)
    assert type(loop).__name__ == "KernelAgentLoop"
    params = {"temperature": 1.0, "top_p": 1.0, "top_k": -1, "logprobs": True}
    outs = await asyncio.gather(*(loop.run(dict(params), **rows[t]) for t in TASKS))
    for task_id, out in zip(TASKS, outs):
        files = ScriptedPolicy(SOLUTIONS).solution_files(task_id, "cpu")
        info = out.extra_fields["reward_extra_info"]
        assert set(info) == set(METRIC_KEYS)
        assert info["submitted"] == 1 and info["truncated"] == 0 and info["turns"] == 5
        assert info["tool_calls"] == len(files) + 4 and info["tool_errors"] == 0 and info["parse_errors"] == 0
        assert info["compiled"] == 1 and info["correct"] == 1 and info["speedup_vs_eager"] > 0
        assert info["compile_s"] > 0 and info["verify_s"] > 0 and info["profile_s"] > 0
        verdict = out.extra_fields["cudagym"]["verdict"]
        assert out.reward_score == verdict["reward"] >= 1.0, verdict["reasons"]
        # the prompt: the row's system prompt and the env's task prompt, through the chat template
        system = [m for m in rows[task_id]["raw_prompt"] if m["role"] == "system"]
        prompt_text = tokenizer.decode(out.prompt_ids)
        assert prompt_text.startswith("<|im_start|>system\n# Tools\n") and '"name": "submit"' in prompt_text
        assert system[0]["content"] in prompt_text and f"Task id: {task_id};" in prompt_text
        assert prompt_text.endswith("<|im_start|>assistant\n")
        # the response: assistant turns (mask 1) exactly as generated, tool observations (mask 0) between
        assert len(out.response_ids) == len(out.response_mask) == len(out.response_logprobs)
        runs = _runs(out.response_mask)
        assert [v for v, _, _ in runs] == [1, 0, 1, 0, 1, 0, 1, 0, 1]
        turns = [tokenizer.decode(out.response_ids[a:b]) for v, a, b in runs if v == 1]
        assert turns == server.sent[task_id] and all(t.endswith(EOS) for t in turns)
        first = json.loads(turns[0].split("<tool_call>\n")[1].split("\n</tool_call>")[0])
        assert first["arguments"]["content"] == next(iter(files.values()))
        for (v, a, b), step in zip([r for r in runs if r[0] == 0], ("write_file", "compile", "verify", "profile")):
            text = tokenizer.decode(out.response_ids[a:b])
            assert text.startswith("<|im_start|>user\n<tool_response>\n[" + step + "]"), text[:200]
            assert text.endswith("</tool_response><|im_end|><|im_start|>assistant\n")
        for v, a, b in runs:
            assert set(out.response_logprobs[a:b]) == ({-0.5} if v == 1 else {0.0})
        assert tokenizer.decode(out.prompt_ids + out.response_ids) == prompt_text + "".join(
            tokenizer.decode(out.response_ids[a:b]) for _, a, b in runs)
        assert info["response_tokens"] == sum(out.response_mask)
        # verl's own post-processing accepts it (padding to prompt_length + response_length)
        tensors = out.as_dict()
        assert tensors["rm_scores"][-1].item() == out.reward_score


async def test_episode_ends_at_the_response_budget(loop_env: Any, tokenizer: Any) -> None:
    cfg, rows = loop_env
    cfg = cfg.copy()
    cfg.actor_rollout_ref.rollout.response_length = 300
    server = ReplayServer(tokenizer)
    out = await _make_loop(cfg, tokenizer, server).run({"temperature": 1.0}, **rows["norm_softmax"])
    info = out.extra_fields["reward_extra_info"]
    assert len(out.response_ids) == len(out.response_mask) <= 300
    assert info["response_budget_hit"] == 1 and info["truncated"] == 1 and info["submitted"] == 0
    assert server.max_tokens[0] == 300  # the first turn may use the whole budget, no more
    # the cut first turn wrote nothing: the empty workspace is scored as it stands
    assert out.reward_score == out.extra_fields["cudagym"]["verdict"]["reward"] == -1.0


def test_prepared_parquet_loads_with_verl_dataset(data_dir: Path, tokenizer: Any) -> None:
    from verl.utils.dataset.rl_dataset import RLHFDataset

    config = OmegaConf.create({"prompt_key": "prompt", "max_prompt_length": 8192, "filter_overlong_prompts": True,
                               "return_raw_chat": True})
    ids = []
    for split in ("train", "val"):
        ds = RLHFDataset(str(data_dir / f"{split}.parquet"), tokenizer, config)
        for i in range(len(ds)):
            row = ds[i]
            assert row["agent_name"] == AGENT_NAME and row["data_source"] == "bundled"
            assert row["extra_info"]["split"] == split and row["index"] == i
            assert [m["role"] for m in row["raw_prompt"]] == ["system", "user"]
            task = bundled_task(row["extra_info"]["task_id"])
            assert row["extra_info"]["source"] == task.source
            assert f"Task id: {task.id};" in row["raw_prompt"][1]["content"]
            ids.append(task.id)
    assert sorted(ids) == sorted(t.id for t in bundled_tasks()) and len(ids) == len(set(ids))
    summary = json.loads((data_dir / "prepare.json").read_text())
    assert summary["val"] == round(len(ids) * 0.2) and summary["dropped"] == []


def test_prepare_drops_tasks_close_to_the_eval_set(tmp_path: Path) -> None:
    evals = tmp_path / "bench"
    evals.mkdir()
    code = "# a benchmark's copy\n" + bundled_task("norm_softmax").code
    (evals / "19_Softmax.py").write_text(code)
    result = CliRunner().invoke(app, ["train", "prepare", "bundled", "--out", str(tmp_path / "d"),
                                      "--eval", str(evals), "--val-fraction", "0"])
    assert result.exit_code == 0, result.output
    summary = json.loads((tmp_path / "d" / "prepare.json").read_text())
    assert [d["task_id"] for d in summary["dropped"]] == ["norm_softmax"]
    assert summary["train"] == len(bundled_tasks()) - 1 and "dropped norm_softmax" in result.output
    # everything close to the eval set: a clear error, no data
    result = CliRunner().invoke(app, ["train", "prepare", "norm_softmax", "--out", str(tmp_path / "e"),
                                      "--eval", str(evals)])
    assert result.exit_code == 2 and "contaminated" in result.output
    result = CliRunner().invoke(app, ["train", "prepare", "no_such_source", "--out", str(tmp_path / "f")])
    assert result.exit_code == 2 and "no_such_source" in result.output


@pytest.mark.parametrize("stage", ["grpo", "ppo"])
def test_dry_run_validates_stage_configs(stage: str, model_dir: Path) -> None:
    result = CliRunner().invoke(app, ["train", stage, f"actor_rollout_ref.model.path={model_dir}", "--dry-run"])
    assert result.exit_code == 0, result.output
    out = result.output
    printed = OmegaConf.create(out[out.index("\nactor_rollout_ref:") + 1:].split("\nnote:")[0].split("\nvalid:")[0])
    assert f"valid: {stage}" in out
    assert printed.algorithm.adv_estimator == {"grpo": "grpo", "ppo": "gae"}[stage]
    rollout = printed.actor_rollout_ref.rollout
    assert rollout.prompt_length + rollout.response_length == 131072 == rollout.max_model_len
    assert rollout.multi_turn.enable and rollout.mode == "async" and rollout.agent.default_agent_loop == AGENT_NAME
    assert Path(rollout.agent.agent_loop_config_path).is_file()
    assert printed.critic.enable is (stage == "ppo")


def test_dry_run_rejects_bad_configs(model_dir: Path) -> None:
    runner = CliRunner()
    too_long = runner.invoke(app, ["train", "grpo", f"actor_rollout_ref.model.path={model_dir}",
                                   "data.max_response_length=200000", "--dry-run"])
    assert too_long.exit_code == 2 and "max_model_len" in too_long.output
    single = runner.invoke(app, ["train", "grpo", f"actor_rollout_ref.model.path={model_dir}",
                                 "actor_rollout_ref.rollout.multi_turn.enable=false", "--dry-run"])
    assert single.exit_code == 2 and "multi_turn.enable" in single.output
    unknown = runner.invoke(app, ["train", "grpo", "no.such.key=1", "--dry-run"])
    assert unknown.exit_code == 2 and "no.such.key" in unknown.output
    assert runner.invoke(app, ["train", "nope", "--dry-run"]).exit_code == 2
    assert runner.invoke(app, ["train", "grpo", "not-an-override", "--dry-run"]).exit_code == 2
    help_text = runner.invoke(app, ["train", "--help"]).output
    assert "prepare" in help_text and "CONFIG" in help_text


def _dataset_rows(rows: dict[str, dict[str, Any]], task_ids: tuple[str, ...]) -> list[dict[str, Any]]:
    return [rows[t] for t in task_ids]


async def test_finished_episodes_through_verl_v0_worker_and_metrics(loop_env: Any, tokenizer: Any) -> None:
    """verl's v0 `AgentLoopWorker.generate_sequences` (the loop built from the registry, its
    `_agent_loop_postprocess` padding and `_postprocess` batching), then verl's GRPO advantage and
    `compute_data_metrics`: the servers' extra_fields come through (the first turn's
    ``global_steps``/``min_global_steps``, the last turn's ``max_global_steps``, as verl's tool
    loop merges them), the reward sits on each episode's last token, the episode metrics are columns."""
    import numpy as np
    from verl.experimental.agent_loop.agent_loop import AgentLoopWorker
    from verl.protocol import DataProto
    from verl.trainer.ppo.metric_utils import compute_data_metrics
    from verl.trainer.ppo.ray_trainer import compute_advantage
    from verl.utils.dataset.rl_dataset import collate_fn

    cfg, rows = loop_env
    server = ReplayServer(tokenizer, global_steps=5, steps_per_turn=1)
    worker = AgentLoopWorker(cfg, llm_client=server)
    batch = DataProto.from_single_dict(collate_fn(_dataset_rows(rows, TASKS)))
    batch.meta_info = {"global_steps": 5, "validate": False}
    out = await worker.generate_sequences(batch)

    nt = out.non_tensor_batch
    assert list(nt["global_steps"]) == [5, 5] and list(nt["min_global_steps"]) == [5, 5]
    assert list(nt["max_global_steps"]) == [9, 9]  # five turns, the weights moved on each turn
    assert [len(t) for t in nt["turn_scores"]] == [5, 5] and list(nt["tool_rewards"]) == [[], []]
    assert set(METRIC_KEYS) <= set(out.meta_info["reward_extra_keys"]) and list(nt["correct"]) == [1.0, 1.0]
    assert [c["task_id"] for c in nt["cudagym"]] == list(TASKS)
    rewards = [c["verdict"]["reward"] for c in nt["cudagym"]]
    last = out.batch["attention_mask"][:, out.batch["prompts"].size(1):].sum(-1) - 1
    assert out.batch["rm_scores"][[0, 1], last].tolist() == rewards
    assert out.batch["rm_scores"].sum().item() == sum(rewards)
    assert [m["num_preempted"] for m in out.meta_info["metrics"]] == [0, 0]

    out.batch["token_level_scores"] = out.batch["rm_scores"]
    out.batch["token_level_rewards"] = out.batch["rm_scores"]
    out.non_tensor_batch["uid"] = np.array(["a", "a"], dtype=object)  # one GRPO group
    out = compute_advantage(out, adv_estimator="grpo", num_repeat=2)
    metrics = compute_data_metrics(batch=out, use_critic=False)
    assert metrics["critic/score/mean"] == pytest.approx(sum(rewards) / 2)
    assert metrics["num_turns/mean"] == 10  # assistant + tool turns


@pytest.fixture(scope="module")
def transfer_queue(tmp_path_factory: pytest.TempPathFactory):
    """verl v1's TransferQueue (controller and storage actors) on a local Ray instance."""
    ray = pytest.importorskip("ray")
    tq = pytest.importorskip("transfer_queue")
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False)
    try:
        tq.init()
        yield tq
    finally:
        tq.close()
        ray.shutdown()


@pytest.mark.slow
async def test_finished_episodes_through_verl_v1_worker_and_training_metrics(
        loop_env: Any, tokenizer: Any, transfer_queue: Any) -> None:
    """verl's v1 path: `AgentLoopWorkerTQ._run_agent_loop` puts each episode into the
    TransferQueue (its tags: ``min_global_steps``/``max_global_steps`` from the loop's
    extra_fields, which verl reads as ints), then the trainer's own `_compute_advantage` and
    `_compute_metrics` (cudagym's `KernelTrainer`, registered as verl trainer mode
    ``cudagym_sync``): verl's staleness metrics, and the episodes' outcomes in the step's metrics."""
    from verl.single_controller.ray.base import ResourcePoolManager
    from verl.trainer.ppo.metric_utils import RolloutMoELoadBalanceMetricsAccumulator
    from verl.trainer.ppo.v1 import get_trainer_cls
    from verl.trainer.ppo.v1.agent_loop_tq import AgentLoopWorkerTQ

    from cudagym.train.runner import KernelTrainer

    tq = transfer_queue
    cfg, rows = loop_env
    cfg = cfg.copy()
    cfg.actor_rollout_ref.rollout.n = 2
    assert cfg.trainer.v1.trainer_mode == "cudagym_sync" and get_trainer_cls("cudagym_sync") is KernelTrainer
    server = ReplayServer(tokenizer, global_steps=5, steps_per_turn=1)
    worker = AgentLoopWorkerTQ.__ray_actor_class__(cfg, llm_client=server)
    params = {"temperature": 1.0, "top_p": 1.0, "top_k": -1, "logprobs": True}
    for i, task_id in enumerate(TASKS):
        row = {k: v for k, v in rows[task_id].items() if k != "agent_name" and not hasattr(v, "shape")}
        for session in range(2):
            await worker._run_agent_loop(dict(params), {"step": 5, "sample_index": i, "rollout_n": session,
                                                        "validate": False},
                                         agent_name=AGENT_NAME, uid=f"uid-{task_id}", session_id=session,
                                         global_steps=5, **row)
    listing = tq.kv_list(partition_id="train")["train"]
    keys = sorted(listing)
    assert len(keys) == 4
    tags = [listing[k] for k in keys]
    assert all(t["min_global_steps"] == 5 and t["max_global_steps"] == 9 and t["global_steps"] == 5 for t in tags)
    batch = tq.KVBatchMeta(keys=keys, tags=tags, partition_id="train")

    trainer = object.__new__(KernelTrainer)  # verl's trainer without its workers: the metric code only
    trainer.config, trainer.use_critic = cfg, False
    trainer._rollout_moe_lb_metrics_accumulator = RolloutMoELoadBalanceMetricsAccumulator(
        model_config=cfg.actor_rollout_ref.model)
    trainer.resource_pool_manager = ResourcePoolManager(resource_pool_spec={"global_pool": [6]}, mapping={})
    # what the actor's forward pass puts before the advantage (same weights: the rollout's log-probs)
    from tensordict import TensorDict

    logprobs = tq.kv_batch_get(keys=keys, partition_id="train", select_fields=["rollout_log_probs"])
    tq.kv_batch_put(keys=keys, partition_id="train",
                    fields=TensorDict({"old_log_probs": logprobs["rollout_log_probs"]}, batch_size=len(keys)))
    metrics: dict[str, Any] = {}
    trainer._compute_advantage(batch, metrics)
    trainer._compute_metrics(batch, metrics, {"step": 1.0, "gen": 0.5}, 6, 0)
    assert metrics["training/off_policy/trajectory_spans/max"] == 5  # versions 5..9
    assert metrics["training/off_policy/trajectory_staleness_worst/max"] == 0  # (6 - 1) - 5
    # the episodes as they ended (on a loaded CPU a check may fail: the metrics follow the episodes)
    fields = tq.kv_batch_get(keys=keys, partition_id="train", select_fields=["extra_fields"])["extra_fields"]
    fields = fields.tolist() if hasattr(fields, "tolist") else list(fields)
    infos = [f["reward_extra_info"] for f in fields]
    rewards = [f["cudagym"]["verdict"]["reward"] for f in fields]
    assert metrics["num_turns/mean"] == 2 * sum(i["turns"] for i in infos) / 4
    assert metrics["critic/score/mean"] == pytest.approx(sum(rewards) / 4)
    assert metrics["episode/count"] == 4 and metrics["episode/pass_rate"] == sum(i["correct"] for i in infos) / 4
    assert metrics["episode/turns/mean"] == sum(i["turns"] for i in infos) / 4
    assert metrics["episode/tool_errors/mean"] == sum(i["tool_errors"] for i in infos) / 4
    assert metrics["episode/compiled_rate"] == sum(i["compiled"] for i in infos) / 4
    if any(i["correct"] for i in infos):
        assert metrics["episode/speedup_vs_eager/geomean"] > 0
