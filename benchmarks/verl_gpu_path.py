"""verl's training step on one GPU without vLLM or a Ray cluster: how far verl's own code runs on the
lent GPU machine (issue 31).

verl's rollout needs an LLM server (vLLM or SGLang). Neither is on the GPU machine, and neither fits
what one device call can carry (docs/verl_gpu.md says why, with the sizes). This script runs the rest
of one verl 0.9.1 GRPO step, with verl's own classes and the stage config ``cudagym_grpo`` (a few
settings changed for one GPU and a random model, listed in `step_overrides`), in one process:

1. model: a random Llama and a tokenizer trained here (`cudagym.train.tiny`), saved as a model
   directory that both the stand-in server and verl's training engine load;
2. config: ``cudagym_grpo`` composed and checked (`resolve_config`, `validate_config`);
3. data: ``cudagym train prepare bundled`` rows read by verl's ``RLHFDataset``, batched as verl's
   trainer batches them (``collate_fn``, a uid per prompt, ``_get_gen_batch``, ``rollout.n`` repeats);
4. rollout (v0): verl's ``AgentLoopWorker.generate_sequences`` plays each episode with cudagym's
   ``cudagym_kernel`` loop (real compile, verify and profile on the target) and pads and batches
   them with verl's post-processing. In place of vLLM, `LocalPolicyServer` answers each turn with
   the policy's own weights: per task one guided episode (the scripted policy's solution) and the
   rest sampled from the model, so each GRPO group has different rewards;
5. reward: verl's ``extract_reward`` of the episodes' ``rm_scores`` (cudagym's reward on each
   episode's last token);
6. actor init: verl's ``ActorRolloutRefWorker`` (its FSDP2 engine) for the actor and the reference
   policy, in this process (a world of one; no Ray actors);
7. old log-probs: ``RayPPOTrainer._compute_old_log_prob`` and ``_compute_ref_log_prob`` with those
   workers in place of the Ray worker groups, and verl's rollout-versus-actor log-prob metrics;
8. advantage: verl's ``compute_advantage`` (GRPO), as ``RayPPOTrainer.fit`` calls it;
9. actor update: ``RayPPOTrainer._update_actor`` (verl's ``ppo_loss``: clipped policy loss plus the
   KL loss of the stage config, backward, optimizer step), then the log-probs again to show the
   policy moved;
10. metrics: verl's ``compute_data_metrics`` and ``compute_timing_metrics``, and cudagym's
    ``episode_metrics``;
11. rollout (v1), unless ``--skip-v1``: the episodes again through verl's v1
    ``AgentLoopWorkerTQ`` into TransferQueue on a local Ray instance, then the
    ``cudagym_sync`` trainer's advantage and metric code (`cudagym.train.runner.KernelTrainer`).

It proves the path, not learning: the model is random. Each stage's wall seconds are one run with
no warm-up (first-call costs such as torch.compile and the evaluator's builds are included). The
first stage that fails ends the run (the v1 stage is last); the table shows how far it got and the
error, the log holds the traceback.

    python benchmarks/verl_gpu_path.py [--target auto|cuda|cpu] [--tasks a,b] [--group-size 2]
        [--turn-tokens 48] [--layers 2] [--hidden 256] [--skip-v1] [--out DIR]

Writes ``verl_gpu_path.json`` (every number) and ``verl_gpu_path.log`` (the table, the notes, the
tracebacks) to ``--out``, else to ``$OUT`` where that is set. Needs verl 0.9.1 and its Python
dependencies (`.ci/verl-nodeps.txt`); on the GPU machine they travel as wheels (docs/verl_gpu.md).
On a machine without a GPU it runs on the CPU: verl 0.9.1 has no CPU platform for its training
engine, so a stand-in is registered (`_register_cpu_platform`), for checking the script before a
device call.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import sys
import tempfile
import threading
import time
import traceback
import uuid
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch


@dataclass
class PathConfig:
    """What one run does (the command line's options)."""

    target: str = "auto"  # where the episodes' kernels run: auto (cuda if a GPU is present), cuda, cpu
    tasks: tuple[str, ...] = ("ew_scale_bias_gelu", "red_row_sum")  # bundled task ids: the step's prompts
    group_size: int = 2  # episodes per prompt (rollout.n): one guided, the rest sampled
    turn_tokens: int = 48  # tokens a sampled turn may generate
    layers: int = 2  # the random Llama's layers
    hidden: int = 256  # and width
    max_prompt_length: int = 8192
    max_response_length: int = 12288
    lr: float = 1e-3  # the actor's learning rate: large, so one step visibly moves a random model
    compile_baseline: bool = False  # the evaluator's torch.compile baseline (the +3 milestone; slow)
    skip_v1: bool = False
    out: Path | None = None


@dataclass
class Stage:
    """One stage of the run: wall seconds (perf_counter, one run, no warm-up), the peak GPU memory
    this process allocated during it (None on the CPU), what it found, or the error that ended it."""

    name: str
    seconds: float = 0.0
    peak_gpu_mib: float | None = None
    ok: bool = False
    facts: dict[str, Any] = field(default_factory=dict)
    error: str | None = None


class RunLog:
    """The stages in order, printed as they end and written to the run's directory."""

    def __init__(self, out: Path | None, cuda: bool) -> None:
        self.out, self.cuda = out, cuda
        self.stages: list[Stage] = []
        self.notes: list[str] = []
        self.tracebacks: list[str] = []
        self.header: dict[str, Any] = {}
        self.metrics: dict[str, float] = {}  # the step's verl metrics (numbers only), for the JSON

    @contextmanager
    def stage(self, name: str) -> Iterator[Stage]:
        s = Stage(name)
        self.stages.append(s)
        if self.cuda:
            torch.cuda.reset_peak_memory_stats()
        print(f"[verl-gpu] {name} ...", file=sys.stderr, flush=True)
        t0 = time.perf_counter()
        try:
            yield s
            s.ok = True
        except BaseException as e:
            s.error = f"{type(e).__name__}: {e}"[:600]
            self.tracebacks.append(f"--- {name}\n{traceback.format_exc()}")
            raise
        finally:
            if self.cuda:
                with suppress(RuntimeError):  # a CUDA error of the stage is already its error
                    torch.cuda.synchronize()
                s.peak_gpu_mib = torch.cuda.max_memory_allocated() / 2**20
            s.seconds = time.perf_counter() - t0
            print(f"[verl-gpu] {name}: {'ok' if s.ok else 'FAILED'} in {s.seconds:.1f} s "
                  f"{json.dumps(s.facts, default=str)[:400]}{'' if s.ok else ' ' + str(s.error)}",
                  file=sys.stderr, flush=True)
            self.write()

    def note(self, text: str) -> None:
        self.notes.append(text)
        print(f"[verl-gpu] note: {text}", file=sys.stderr, flush=True)

    def table(self) -> str:
        rows = [("stage", "ok", "wall s", "peak GPU MiB", "facts / error")]
        for s in self.stages:
            facts = s.error if s.error else ", ".join(f"{k}={_short(v)}" for k, v in s.facts.items())
            rows.append((s.name, "yes" if s.ok else "NO", f"{s.seconds:.1f}",
                         "-" if s.peak_gpu_mib is None else f"{s.peak_gpu_mib:.0f}", facts))
        widths = [max(len(r[i]) for r in rows) for i in range(4)]
        lines = ["  ".join(c.ljust(w) for c, w in zip(r[:4], widths)) + "  " + r[4] for r in rows]
        lines.insert(1, "  ".join("-" * w for w in widths) + "  " + "-" * 13)
        return "\n".join(lines)

    def text(self) -> str:
        head = "; ".join(f"{k}: {v}" for k, v in self.header.items())
        parts = [f"verl GPU path ({head})", "", self.table(), ""]
        parts += [f"note: {n}" for n in self.notes]
        return "\n".join(parts + ["", *self.tracebacks])

    def write(self) -> None:
        if self.out is None:
            return
        self.out.mkdir(parents=True, exist_ok=True)
        (self.out / "verl_gpu_path.json").write_text(json.dumps(
            {"header": self.header, "stages": [vars(s) for s in self.stages], "notes": self.notes,
             "metrics": self.metrics},
            indent=1, default=str))
        (self.out / "verl_gpu_path.log").write_text(self.text())


def _short(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:.4g}"
    if isinstance(v, (list, tuple)):
        return "[" + ",".join(_short(x) for x in v) + "]"
    return str(v)


class LocalPolicyServer:
    """Stands in for verl's LLM server client (vLLM/SGLang are not on the GPU machine): answers each
    turn with the policy's own weights, a `transformers` model on the device.

    Per task, the first episode to ask is guided (each turn is the scripted policy's, tokenized, so
    it reaches a verdict) and the others are sampled from the model (``turn_tokens`` at most). Every
    turn's log-probs are the model's (teacher-forced for guided turns), so verl's rollout-versus-
    actor log-prob check compares two implementations of one policy. The `TokenOutput` carries
    what verl's ``LLMServerClient.generate`` returns (``global_steps`` and its min/max)."""

    def __init__(self, model: Any, tokenizer: Any, target: str, turn_tokens: int, global_steps: int = 1) -> None:
        from cudagym.agent.scripted import ScriptedPolicy

        self.model, self.tokenizer, self.target = model, tokenizer, target
        self.turn_tokens, self.global_steps = turn_tokens, global_steps
        self.policy = ScriptedPolicy()
        self.guided: dict[str, str] = {}  # task id -> request id of its guided episode
        self.turns: dict[str, int] = {}
        self.generated_s = 0.0
        self._lock = threading.Lock()  # one forward at a time on the device; episodes' env steps overlap

    async def generate(self, request_id: str, *, prompt_ids: list[int], sampling_params: dict[str, Any],
                       **kwargs: Any) -> Any:
        from verl.workers.rollout.replica import TokenOutput

        from cudagym.agent.policy import TurnContext

        task_id = self.tokenizer.decode(prompt_ids).split("Task id: ", 1)[1].split(";", 1)[0]
        guided = self.guided.setdefault(task_id, request_id) == request_id
        turn = self.turns.get(request_id, 0)
        self.turns[request_id] = turn + 1
        cap = int(sampling_params["max_tokens"])
        if guided:
            reply = await self.policy.aact([], [], TurnContext(episode_id=request_id, task_id=task_id,
                                                               target=self.target, turn=turn))
            ids = self.tokenizer.encode(reply.content + self.tokenizer.eos_token, add_special_tokens=False)[:cap]
        else:
            ids = await asyncio.to_thread(self._sample, prompt_ids, min(cap, self.turn_tokens),
                                          float(sampling_params.get("temperature", 1.0)))
        logprobs = await asyncio.to_thread(self._score, prompt_ids, ids)
        steps = self.global_steps
        return TokenOutput(token_ids=ids, log_probs=logprobs, stop_reason="completed", num_preempted=0,
                           extra_fields={"global_steps": steps, "min_global_steps": steps, "max_global_steps": steps})

    def _sample(self, prompt_ids: list[int], max_new: int, temperature: float) -> list[int]:
        with self._lock, torch.no_grad():
            t0 = time.perf_counter()
            x = torch.tensor([prompt_ids], device=self.model.device)
            out = self.model.generate(input_ids=x, attention_mask=torch.ones_like(x), max_new_tokens=max_new,
                                      do_sample=True, temperature=max(temperature, 1e-3), top_k=0, top_p=1.0,
                                      eos_token_id=self.tokenizer.eos_token_id,
                                      pad_token_id=self.tokenizer.pad_token_id)
            self.generated_s += time.perf_counter() - t0
            return out[0, len(prompt_ids):].tolist()

    def _score(self, prompt_ids: list[int], ids: list[int]) -> list[float]:
        if not ids:
            return []
        with self._lock, torch.no_grad():
            x = torch.tensor([prompt_ids + ids], device=self.model.device)
            logits = self.model(input_ids=x).logits[0, len(prompt_ids) - 1:-1].float()
            lp = torch.log_softmax(logits, dim=-1).gather(-1, x[0, len(prompt_ids):, None])[:, 0]
            return lp.tolist()


def step_overrides(cfg: PathConfig, model_dir: Path, data_dir: Path, target: str, cuda: bool) -> list[str]:
    """What this run changes in the stage config ``cudagym_grpo``, and why."""
    n_prompts = len(cfg.tasks)
    context = cfg.max_prompt_length + cfg.max_response_length
    return [
        f"actor_rollout_ref.model.path={model_dir}",
        f"data.train_files={data_dir / 'train.parquet'}", f"data.val_files={data_dir / 'val.parquet'}",
        f"data.max_prompt_length={cfg.max_prompt_length}", f"data.max_response_length={cfg.max_response_length}",
        f"actor_rollout_ref.rollout.max_model_len={context}",
        # one GPU: one training process, no sequence parallelism, no tensor-parallel rollout
        "trainer.n_gpus_per_node=1", "actor_rollout_ref.rollout.tensor_model_parallel_size=1",
        "actor_rollout_ref.actor.ulysses_sequence_parallel_size=1",
        # FSDP2: its device mesh also works on a CPU (the script's check without a GPU)
        "actor_rollout_ref.actor.strategy=fsdp2", "actor_rollout_ref.ref.strategy=fsdp2",
        # no flash-attn on the machine: padded batches and PyTorch's SDPA (packed sequences need flash-attn)
        "actor_rollout_ref.model.use_remove_padding=false",
        "+actor_rollout_ref.model.override_config.attn_implementation=sdpa",
        "actor_rollout_ref.model.enable_gradient_checkpointing=false",
        f"actor_rollout_ref.actor.optim.lr={cfg.lr}",
        # one step of len(tasks) prompts x group_size episodes, one mini-batch
        f"data.train_batch_size={n_prompts}", f"actor_rollout_ref.actor.ppo_mini_batch_size={n_prompts}",
        f"actor_rollout_ref.rollout.n={cfg.group_size}",
        # episodes evaluated in this process (no evaluation pool: no Ray cluster)
        "cudagym.evaluator.backend=local", f"cudagym.evaluator.target={target}",
        f"cudagym.evaluator.compile_baseline={str(cfg.compile_baseline).lower()}",
        "trainer.logger=[console]",
        # no reference model on the CPU: verl's FSDP2 reference offloads to pinned host memory, which needs
        # an accelerator (the GPU run keeps the stage config's KL loss and its reference model)
        *([] if cuda else ["actor_rollout_ref.actor.use_kl_loss=false"]),
    ]


def _hide_incompatible_trl(log: RunLog) -> None:
    """verl 0.9.1's FSDP model build patches TRL's ``AutoModelForCausalLMWithValueHead`` whenever TRL
    is importable; TRL 1.x (the dev extra's 1.16) no longer has it and the build fails. Hide TRL from
    this process where that is so (the GPU machine has no TRL)."""
    import importlib.util

    if importlib.util.find_spec("trl") is None:
        return
    import trl

    try:
        from trl.experimental.ppo import AutoModelForCausalLMWithValueHead  # noqa: F401
        return
    except ImportError:
        pass
    if not hasattr(trl, "AutoModelForCausalLMWithValueHead"):
        sys.modules["trl"] = None  # type: ignore[assignment]  # find_spec then reports no TRL
        log.note(f"TRL {trl.__version__} hidden from verl: verl 0.9.1's FSDP model build imports "
                 "AutoModelForCausalLMWithValueHead, which this TRL no longer has")


def _register_cpu_platform() -> None:
    """A CPU platform for verl 0.9.1, which knows only accelerators (and falls back to CUDA): the
    FSDP2 engine then runs on the CPU with gloo, for checking this script without a GPU."""
    from types import SimpleNamespace

    from verl.plugin.platform.platform_base import PlatformBase
    from verl.plugin.platform.platform_manager import PlatformRegistry

    def zero(*_: Any) -> int:
        return 0

    module = SimpleNamespace(
        is_available=lambda: True, current_device=lambda: "cpu", device_count=lambda: 1, set_device=zero,
        synchronize=zero, manual_seed=torch.manual_seed, manual_seed_all=torch.manual_seed, empty_cache=zero,
        max_memory_allocated=zero, max_memory_reserved=zero, memory_allocated=zero, memory_reserved=zero,
        reset_peak_memory_stats=zero, mem_get_info=lambda *_: (1 << 34, 1 << 34), get_device_name=lambda *_: "CPU",
        get_rng_state=torch.get_rng_state, set_rng_state=torch.set_rng_state, is_initialized=lambda: True,
        Stream=torch.cpu.Stream, current_stream=torch.cpu.current_stream, stream=torch.cpu.stream)

    class PlatformCPU(PlatformBase):
        device_name = property(lambda self: "cpu")
        vendor_name = property(lambda self: "cpu")
        device_module = property(lambda self: module)

        def is_available(self) -> bool:
            return True

        def current_device(self) -> Any:
            return "cpu"  # model.to(device=...) and torch.device(...) take it as it is

        def device_count(self) -> int:
            return 1

        def set_device(self, device_index: int) -> None:
            pass

        def synchronize(self, device_index: int | None = None) -> None:
            pass

        def manual_seed(self, seed: int) -> None:
            torch.manual_seed(seed)

        def manual_seed_all(self, seed: int) -> None:
            torch.manual_seed(seed)

        def set_allocator_settings(self, settings: str) -> None:
            pass

        def empty_cache(self) -> None:
            pass

        def get_device_capability(self, device_index: int = 0) -> tuple[int | None, int | None]:
            return None, None

        def communication_backend_name(self) -> str:
            return "gloo"

        def visible_devices_envvar(self) -> str:
            return "CUDA_VISIBLE_DEVICES"

        @contextmanager
        def nvtx_range(self, msg: str) -> Iterator[None]:
            yield

        def profiler_start(self) -> None:
            pass

        def profiler_stop(self) -> None:
            pass

        def ray_resource_name(self) -> str:
            return "CPU"

        def ray_noset_envvars(self) -> list[str]:
            return []

        def is_ipc_supported(self) -> bool:
            return False

        def cudart(self) -> Any:
            return None

    PlatformRegistry.register(platform="cpu")(PlatformCPU)
    os.environ["VERL_PLATFORM"] = "cpu"
    # the FSDP engine is registered for cuda/npu only; it runs on its device mesh's device
    os.environ["VERL_ENGINE_DEVICE"] = "cuda"


def _single_process_world(cuda: bool) -> None:
    """The environment verl's workers read their rank from (a world of one). On the GPU verl starts
    its own process group (gloo and NCCL); on the CPU it would ask for NCCL, so gloo is started here."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    if not cuda:
        torch.distributed.init_process_group("gloo", rank=0, world_size=1)


def _versions() -> dict[str, str]:
    from importlib.metadata import PackageNotFoundError, version

    out = {}
    for name in ("torch", "verl", "tensordict", "transformers", "ray", "transferqueue", "vllm", "sglang", "trl"):
        try:
            out[name] = version(name)
        except PackageNotFoundError:
            out[name] = "absent"
    return out


async def run_v0_and_step(cfg: PathConfig, log: RunLog, work: Path, target: str, cuda: bool,
                          ctx: dict[str, Any]) -> None:
    """Stages 1-10 (see the module doc); puts what the v1 stage and the clean-up need into `ctx`."""
    from omegaconf import OmegaConf
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from cudagym.train.launch import resolve_config, validate_config
    from cudagym.train.prepare import PrepareConfig, prepare
    from cudagym.train.tiny import kernel_texts, tiny_causal_lm, tiny_tokenizer

    device = torch.device("cuda" if cuda else "cpu")
    model_dir, data_dir = work / "model", work / "data"
    with log.stage("model (random Llama, tokenizer trained here)") as s:
        tok = tiny_tokenizer(kernel_texts(cfg.tasks, target), vocab_size=2000, eos="<|end|>")
        context = cfg.max_prompt_length + cfg.max_response_length
        model = tiny_causal_lm(tok, max_positions=context, layers=cfg.layers, hidden=cfg.hidden)
        model.save_pretrained(model_dir)
        tok.save_pretrained(model_dir)
        tok = AutoTokenizer.from_pretrained(model_dir)
        policy = AutoModelForCausalLM.from_pretrained(
            model_dir, dtype=torch.bfloat16 if cuda else torch.float32).to(device).eval()
        s.facts.update(parameters=sum(p.numel() for p in model.parameters()), vocab=len(tok),
                       layers=cfg.layers, hidden=cfg.hidden, server_dtype=str(policy.dtype).removeprefix("torch."))

    with log.stage("config (cudagym_grpo, verl's checks)") as s:
        prepare(PrepareConfig(source="bundled", out=data_dir, val_fraction=0.2, target=target))
        overrides = step_overrides(cfg, model_dir, data_dir, target, cuda)
        vcfg = resolve_config("grpo", overrides)
        notes = validate_config(vcfg)
        s.facts.update(overrides=len(overrides), adv_estimator=vcfg.algorithm.adv_estimator,
                       use_kl_loss=vcfg.actor_rollout_ref.actor.use_kl_loss, notes=len(notes))

    from verl.experimental.agent_loop.agent_loop import AgentLoopWorker
    from verl.protocol import DataProto
    from verl.trainer.ppo.core_algos import agg_loss
    from verl.trainer.ppo.metric_utils import compute_data_metrics, compute_timing_metrics, reduce_metrics
    from verl.trainer.ppo.ray_trainer import RayPPOTrainer, compute_advantage, compute_response_mask
    from verl.trainer.ppo.reward import extract_reward
    from verl.utils.dataset.rl_dataset import RLHFDataset, collate_fn

    from cudagym.train.runner import episode_metrics
    from cudagym.train.settings import RunSettings
    from cudagym.train.verl_loop import METRIC_KEYS, evaluator_for

    n = cfg.group_size
    # verl's trainer without its Ray worker groups: the methods of one step, the workers set below
    trainer = object.__new__(RayPPOTrainer)
    trainer.config = vcfg
    timing: dict[str, float] = {}
    with log.stage("data (RLHFDataset, collate_fn, gen batch)") as s:
        rows: dict[str, dict[str, Any]] = {}
        for split in ("train", "val"):
            ds = RLHFDataset(str(data_dir / f"{split}.parquet"), tok, vcfg.data)
            for i in range(len(ds)):
                rows[ds[i]["extra_info"]["task_id"]] = ds[i]
        missing = [t for t in cfg.tasks if t not in rows]
        if missing:
            raise ValueError(f"tasks not in the prepared data: {missing}")
        batch = DataProto.from_single_dict(collate_fn([rows[t] for t in cfg.tasks]))
        batch.meta_info["temperature"] = vcfg.actor_rollout_ref.rollout.temperature
        batch.non_tensor_batch["uid"] = np.array([str(uuid.uuid4()) for _ in cfg.tasks], dtype=object)
        gen_batch = trainer._get_gen_batch(batch)
        gen_batch.meta_info["global_steps"] = 1
        gen_batch = gen_batch.repeat(repeat_times=n, interleave=True)
        s.facts.update(prompts=len(cfg.tasks), episodes=len(gen_batch))

    spec = ctx["spec"] = RunSettings.of(OmegaConf.to_container(vcfg.cudagym, resolve=True)).evaluator
    ctx.update(vcfg=vcfg, rows=rows, server_v1=LocalPolicyServer(policy, tok, target, cfg.turn_tokens))
    server = LocalPolicyServer(policy, tok, target, cfg.turn_tokens)
    with log.stage(f"rollout v0 (AgentLoopWorker, {target} episodes)") as s:
        t0 = time.perf_counter()
        evaluator_for(spec)  # the loop's evaluator for this process, started before the episodes
        s.facts["evaluator_start_s"] = time.perf_counter() - t0
        worker = AgentLoopWorker(vcfg, llm_client=server)
        gen_out = await worker.generate_sequences(gen_batch)
        timing.update(gen_out.meta_info.pop("timing", {}))
        nt = gen_out.non_tensor_batch
        s.facts.update(
            episodes=len(gen_out), responses=tuple(gen_out.batch["responses"].shape),
            guided=len(server.guided),
            correct=[float(x) for x in nt["correct"]], turns=[int(x) for x in nt["turns"]],
            compile_s=float(np.sum(nt["compile_s"])), verify_s=float(np.sum(nt["verify_s"])),
            profile_s=float(np.sum(nt["profile_s"])), server_generate_s=server.generated_s,
            reward_extra_keys=len(gen_out.meta_info.get("reward_extra_keys", [])))

    with log.stage("reward (extract_reward of rm_scores)") as s:
        batch = batch.repeat(repeat_times=n, interleave=True).union(gen_out)
        if "response_mask" not in batch.batch.keys():
            batch.batch["response_mask"] = compute_response_mask(batch)
        batch.meta_info["global_token_num"] = torch.sum(batch.batch["attention_mask"], dim=-1).tolist()
        reward_tensor, extra = extract_reward(batch)
        verdicts = [c["verdict"]["reward"] if c["verdict"] else None for c in batch.non_tensor_batch["cudagym"]]
        per_episode = reward_tensor.sum(-1).tolist()
        s.facts.update(rewards=per_episode, verdict_rewards=verdicts, extra_keys=sorted(set(extra) & set(METRIC_KEYS)))

    use_ref = bool(vcfg.actor_rollout_ref.actor.use_kl_loss)
    with log.stage(f"actor{' + ref' if use_ref else ''} init (verl FSDP2 engine, world of 1)") as s:
        from verl.workers.engine_workers import ActorRolloutRefWorker

        actor = ActorRolloutRefWorker(vcfg.actor_rollout_ref, role="actor")
        actor.init_model()
        trainer.actor_rollout_wg, trainer.ref_in_actor = actor, False
        if use_ref:
            trainer.ref_policy_wg = ActorRolloutRefWorker(vcfg.actor_rollout_ref, role="ref")
            trainer.ref_policy_wg.init_model()
        engine = actor.actor.engine
        s.facts.update(engine=type(engine).__name__, device=str(next(engine.module.parameters()).device),
                       reference_model=use_ref)

    metrics: dict[str, Any] = {}
    with log.stage(f"old{' + ref' if use_ref else ''} log-probs (_compute_old_log_prob"
                   f"{', _compute_ref_log_prob' if use_ref else ''})") as s:
        from verl.utils.debug.metrics import calculate_debug_metrics

        t0 = time.perf_counter()
        old, mfu = trainer._compute_old_log_prob(batch)
        timing["old_log_prob"] = time.perf_counter() - t0
        actor_cfg = vcfg.actor_rollout_ref.actor
        entropy = agg_loss(loss_mat=old.batch["entropys"], loss_mask=batch.batch["response_mask"],
                           loss_agg_mode=actor_cfg.loss_agg_mode, loss_scale_factor=actor_cfg.loss_scale_factor)
        metrics.update({"actor/entropy": entropy.detach().item(), "perf/mfu/actor_infer": mfu})
        old.batch.pop("entropys")
        batch = batch.union(old)
        metrics.update(calculate_debug_metrics(batch))
        if use_ref:
            t0 = time.perf_counter()
            batch = batch.union(trainer._compute_ref_log_prob(batch))
            timing["ref"] = time.perf_counter() - t0
        s.facts.update({k: metrics[k] for k in metrics if k.startswith("training/rollout_probs_diff")}
                       | {"actor/entropy": metrics["actor/entropy"]})

    with log.stage("advantage (compute_advantage, GRPO)") as s:
        batch.batch["token_level_scores"] = reward_tensor
        batch.non_tensor_batch.update({k: np.array(v) for k, v in extra.items()})
        batch.batch["token_level_rewards"] = batch.batch["token_level_scores"]
        alg = vcfg.algorithm
        batch = compute_advantage(batch, adv_estimator=alg.adv_estimator, gamma=alg.gamma, lam=alg.lam, num_repeat=n,
                                  norm_adv_by_std_in_grpo=alg.get("norm_adv_by_std_in_grpo", True), config=alg)
        adv = batch.batch["advantages"]
        mask = batch.batch["response_mask"].bool()
        s.facts["advantage_per_episode"] = [float(adv[i][mask[i]].mean()) if mask[i].any() else 0.0
                                            for i in range(len(adv))]

    with log.stage(f"actor update (_update_actor: ppo_loss{' + KL' if use_ref else ''}, backward, step)") as s:
        before = batch.batch["old_log_probs"].clone()
        t0 = time.perf_counter()
        actor_out = trainer._update_actor(batch)
        timing["update_actor"] = time.perf_counter() - t0
        update = reduce_metrics(actor_out.meta_info["metrics"])
        metrics.update(update)
        after, _ = trainer._compute_old_log_prob(batch)
        moved = (after.batch["old_log_probs"] - before).abs()[mask]
        s.facts.update({k: update[k] for k in ("actor/pg_loss", "actor/kl_loss", "actor/grad_norm", "actor/lr")
                        if k in update} | {"logprob_change_mean": float(moved.mean())})
        if not float(moved.max()) > 0:
            raise AssertionError("the update did not change the policy's log-probs")

    with log.stage("metrics (compute_data_metrics, episode_metrics)") as s:
        timing["step"] = sum(timing.get(k, 0.0) for k in ("gen", "old_log_prob", "ref", "update_actor"))
        metrics.update(compute_data_metrics(batch=batch, use_critic=False))
        metrics.update(compute_timing_metrics(batch=batch, timing_raw=timing))
        infos = [{k: batch.non_tensor_batch[k][i] for k in METRIC_KEYS} for i in range(len(batch))]
        metrics.update(episode_metrics(infos))
        s.facts.update({k: metrics[k] for k in ("critic/score/mean", "critic/advantages/max", "episode/pass_rate",
                                                 "num_turns/mean", "response_length/mean") if k in metrics})
    log.metrics = {k: float(v) for k, v in metrics.items() if isinstance(v, (int, float, np.number))}


async def run_v1(cfg: PathConfig, log: RunLog, ctx: dict[str, Any]) -> None:
    """Stage 11: the episodes through verl's v1 worker into TransferQueue, then the cudagym_sync
    trainer's advantage and metric code (as tests/test_train_verl.py, with the device's episodes)."""
    with log.stage("rollout v1 (AgentLoopWorkerTQ, TransferQueue, KernelTrainer metrics)") as s:
        import ray
        import transfer_queue as tq
        from tensordict import TensorDict
        from verl.single_controller.ray.base import ResourcePoolManager
        from verl.trainer.ppo.metric_utils import RolloutMoELoadBalanceMetricsAccumulator
        from verl.trainer.ppo.v1.agent_loop_tq import AgentLoopWorkerTQ

        from cudagym.train import AGENT_NAME
        from cudagym.train.runner import KernelTrainer

        vcfg, rows, server = ctx["vcfg"].copy(), ctx["rows"], ctx["server_v1"]
        t0 = time.perf_counter()
        ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False)
        try:
            tq.init()
            s.facts["ray_tq_start_s"] = time.perf_counter() - t0
            worker = AgentLoopWorkerTQ.__ray_actor_class__(vcfg, llm_client=server)
            params = {"temperature": 1.0, "top_p": 1.0, "top_k": -1, "logprobs": True}
            runs = []
            for i, task_id in enumerate(cfg.tasks):
                row = {k: v for k, v in rows[task_id].items() if k != "agent_name" and not hasattr(v, "shape")}
                for session in range(cfg.group_size):
                    runs.append(worker._run_agent_loop(
                        dict(params), {"step": 1, "sample_index": i, "rollout_n": session, "validate": False},
                        agent_name=AGENT_NAME, uid=f"uid-{task_id}", session_id=session, global_steps=1, **row))
            await asyncio.gather(*runs)
            listing = tq.kv_list(partition_id="train")["train"]
            keys = sorted(listing)
            tags = [listing[k] for k in keys]
            batch = tq.KVBatchMeta(keys=keys, tags=tags, partition_id="train")
            trainer = object.__new__(KernelTrainer)  # the metric code of verl's v1 trainer, without its workers
            trainer.config, trainer.use_critic = vcfg, False
            trainer._rollout_moe_lb_metrics_accumulator = RolloutMoELoadBalanceMetricsAccumulator(
                model_config=vcfg.actor_rollout_ref.model)
            trainer.resource_pool_manager = ResourcePoolManager(resource_pool_spec={"global_pool": [1]}, mapping={})
            # bypass mode's old log-probs (the rollout's): the v1 worker group's log-prob pass needs Ray workers
            lp = tq.kv_batch_get(keys=keys, partition_id="train", select_fields=["rollout_log_probs"])
            tq.kv_batch_put(keys=keys, partition_id="train",
                            fields=TensorDict({"old_log_probs": lp["rollout_log_probs"]}, batch_size=len(keys)))
            metrics: dict[str, Any] = {}
            trainer._compute_advantage(batch, metrics)
            trainer._compute_metrics(batch, metrics, {"step": 1.0, "gen": 0.5}, 2, 0)
            s.facts.update(episodes=len(keys),
                           tags_min_max=[(t["min_global_steps"], t["max_global_steps"]) for t in tags],
                           **{k: metrics[k] for k in ("critic/score/mean", "episode/pass_rate", "episode/count",
                                                      "num_turns/mean") if k in metrics})
        finally:
            tq.close()
            ray.shutdown()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    d = PathConfig()
    ap.add_argument("--target", choices=("auto", "cuda", "cpu"), default=d.target)
    ap.add_argument("--tasks", default=",".join(d.tasks), help="comma-separated bundled task ids (the step's prompts)")
    ap.add_argument("--group-size", type=int, default=d.group_size, help="episodes per prompt (rollout.n), >= 2")
    ap.add_argument("--turn-tokens", type=int, default=d.turn_tokens, help="tokens a sampled turn may generate")
    ap.add_argument("--layers", type=int, default=d.layers)
    ap.add_argument("--hidden", type=int, default=d.hidden)
    ap.add_argument("--lr", type=float, default=d.lr)
    ap.add_argument("--compile-baseline", action="store_true", help="time torch.compile baselines (slow)")
    ap.add_argument("--skip-v1", action="store_true", help="skip the v1 (TransferQueue, Ray) stage")
    ap.add_argument("--out", type=Path, default=Path(os.environ["OUT"]) if os.environ.get("OUT") else None)
    a = ap.parse_args()
    if a.group_size < 2:
        ap.error("--group-size must be at least 2 (one guided episode, one sampled)")
    cfg = PathConfig(target=a.target, tasks=tuple(t.strip() for t in a.tasks.split(",") if t.strip()),
                     group_size=a.group_size, turn_tokens=a.turn_tokens, layers=a.layers, hidden=a.hidden, lr=a.lr,
                     compile_baseline=a.compile_baseline, skip_v1=a.skip_v1, out=a.out)

    from cudagym.rewards.evaluator import resolve_target

    target = resolve_target(cfg.target).value
    cuda = torch.cuda.is_available()
    log = RunLog(cfg.out, cuda)
    log.header.update(device=torch.cuda.get_device_name() if cuda else "CPU (no GPU)", target=target,
                      python=sys.version.split()[0], **_versions())
    log.note("vLLM/SGLang absent: each turn is answered by LocalPolicyServer (a transformers model with the "
             "policy's weights) through verl's LLM-server interface, in place of verl's rollout replicas")
    _hide_incompatible_trl(log)
    if not cuda:
        _register_cpu_platform()
        log.note("no GPU: verl's FSDP2 engine runs on the CPU (gloo) through a stand-in platform")
    _single_process_world(cuda)
    failed = False
    ctx: dict[str, Any] = {}
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="cudagym-verl-gpu-") as work:
        try:
            asyncio.run(run_v0_and_step(cfg, log, Path(work), target, cuda, ctx))
            if not cfg.skip_v1:
                asyncio.run(run_v1(cfg, log, ctx))
        except Exception:  # noqa: BLE001 - recorded in the stage that raised it; the table says how far it got
            failed = True
        finally:
            from cudagym.train.verl_loop import release_evaluator

            ev = release_evaluator(ctx["spec"]) if "spec" in ctx else None
            if ev is not None:
                ev.close()
            if torch.distributed.is_initialized():
                torch.distributed.destroy_process_group()
    log.header["total_s"] = round(time.perf_counter() - t0, 1)
    log.write()
    print(log.text())
    reached = [s.name for s in log.stages if s.ok]
    print(f"\nreached {len(reached)} of {len(log.stages)} stages started; "
          f"{'FAILED at ' + log.stages[-1].name if failed else 'all ok'}")
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
