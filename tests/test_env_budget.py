"""The env's token budget, measured with a real tokenizer (a BPE trained here, through
`transformers`): observations are fitted into what is left (tool output trimmed, the protocol
kept) and the episode ends with ``truncated=True`` at its budget; a small budget and a 128K one."""

from __future__ import annotations

import json

import pytest

from cudagym.env.kernel_env import EnvConfig, KernelEnv, ShapingConfig
from cudagym.env.tokens import TokenizerCounter
from cudagym.tasks.loaders import bundled_task

from cudagym.train.tiny import tiny_tokenizer

TASK = "ew_scale_bias_gelu"
LINE = "// line {i:05d}: the kernel writes out float values, then a tail of plain text"


def call(name: str, **arguments) -> str:
    return f'<tool_call>\n{json.dumps({"name": name, "arguments": arguments})}\n</tool_call>'


@pytest.fixture(scope="module")
def counter():
    from cudagym.env.prompt import task_prompt
    from cudagym.tasks.model import Target

    texts = [task_prompt(bundled_task(TASK).for_target(Target.CPU), Target.CPU),
             "\n".join(LINE.format(i=i) for i in range(300)), call("read_file", path="kernels/big.cpp"),
             "error: 'undefined_fn' was not declared in this scope Compile FAILED"]
    return TokenizerCounter(tiny_tokenizer(texts, vocab_size=1000))


def _episode_tokens(counter, prompt: str, turns: list[tuple[str, str]]) -> int:
    """The episode's length as the policy sees it, counted independently of the env."""
    return counter.count(prompt) + sum(counter.count(a) + counter.count(o) for a, o in turns)


async def test_small_budget_trims_the_compile_log_keeps_the_protocol_and_truncates(evaluator, counter, tmp_path):
    # a kernel with 120 compile errors: the compiler's log is long, its error lines matter
    bad = "".join(f"extern \"C\" void f{i}() {{ undefined_fn_{i}(); }}\n" for i in range(120))
    env = KernelEnv(tasks=[bundled_task(TASK)], evaluator=evaluator, workspace_root=tmp_path, token_counter=counter,
                    max_tokens=10**6, score_on_truncation=False)
    prompt, info = await env.areset()
    assert info["tokens"] == counter.count(prompt)
    actions = [call("write_file", path="kernels/k.cpp", content=bad)
               + call("write_file", path="model_new.py", content="import torch\n"),
               call("compile") + call("read_file", path="kernels/k.cpp")]
    turns = []
    for a in actions:  # the same episode without a budget worth mentioning: how long it is untrimmed
        obs, *_ , full_info = await env.astep(a)
        turns.append((a, obs))
    untrimmed = _episode_tokens(counter, prompt, turns)
    assert not full_info["observation_trimmed"] and "undefined_fn_0" in obs

    budget = untrimmed - counter.count(turns[-1][1]) // 2  # the last observation must lose half of it
    env = KernelEnv(tasks=[bundled_task(TASK)], evaluator=evaluator, workspace_root=tmp_path, token_counter=counter,
                    max_tokens=budget)
    prompt, _ = await env.areset()
    obs1, _, _, trunc1, info1 = await env.astep(actions[0])
    assert not trunc1 and not info1["observation_trimmed"]
    obs2, reward, term, trunc2, info2 = await env.astep(actions[1])
    assert trunc2 and not term and info2["truncated_by"] == "tokens" and info2["observation_trimmed"]
    # inside the budget, measured independently with the same tokenizer, and it used most of it
    used = _episode_tokens(counter, prompt, [(actions[0], obs1), (actions[1], obs2)])
    assert used == info2["tokens"] and budget - 200 <= used <= budget, (used, budget)
    # the protocol: both calls answered, in order, headers and call results intact; the log trimmed
    assert obs2.index("[compile] Compile FAILED") < obs2.index("[read_file] kernels/k.cpp")
    assert [r["name"] for r in info2["tool_results"]] == ["compile", "read_file"]
    assert [c["name"] for c in info2["calls"]] == ["compile", "read_file"]
    assert all(r["text"] in obs2 for r in info2["tool_results"])
    assert "lines elided" in obs2 and "trimmed to fit the episode's token budget" in obs2
    assert "error" in info2["tool_results"][0]["text"] and "undefined_fn_" in info2["tool_results"][0]["text"]
    # scored as it stands (a workspace that does not compile), with the verdict's first line kept
    assert "The token budget is used up; the workspace was scored" in obs2 and "Milestone: failed" in obs2
    assert reward == -1.0
    env.close()


async def test_128k_budget_with_long_tool_output_ends_at_its_budget(evaluator, counter, tmp_path):
    # 230 KB, ~70K tokens: the write fits, a read of it no more
    big = "\n".join(LINE.format(i=i) for i in range(3000)) + "\n"
    env = KernelEnv(tasks=[bundled_task(TASK)], evaluator=evaluator, workspace_root=tmp_path, token_counter=counter,
                    max_tokens=131072, max_observation_chars=2_000_000, message_overhead_tokens=5,
                    shaping=ShapingConfig(well_formed_turn=0.01))
    prompt, _ = await env.areset()
    env.declare_prompt(counter.count(prompt) + 900)  # as a trainer would: system prompt and template included
    write = call("write_file", path="kernels/big.cpp", content=big)
    read = call("read_file", path="kernels/big.cpp", max_lines=5000)
    assert counter.count(write) > 60000  # the write alone is about half the budget
    turns = []
    obs, _, term, trunc, info = await env.astep(write)
    turns.append((write, obs))
    assert not trunc and info["tokens_left"] < 131072 - 60000
    obs, reward, term, trunc, info = await env.astep(read)
    turns.append((read, obs))
    assert trunc and not term and info["truncated_by"] == "tokens" and info["observation_trimmed"]
    used = counter.count(prompt) + 900 + sum(counter.count(a) + counter.count(o) + 2 * 5 for a, o in turns)
    assert used == info["tokens"] and info["tokens_left"] == 131072 - used
    assert 0.99 * 131072 <= used <= 131072, used  # filled to its budget (within 1%), not past it
    assert obs.startswith("[read_file] kernels/big.cpp (lines 1-3000 of 3000)")  # header and its first lines kept
    assert LINE.format(i=0) in obs and LINE.format(i=2999) in obs and "lines elided" in obs
    assert info["tool_results"][0]["text"] in obs
    assert "Milestone: failed" in obs and reward == pytest.approx(-1.0 + 0.01)  # scored; well-formed turn paid
    env.close()


async def test_format_shaping_pays_well_formed_turns_up_to_the_cap_and_charges_malformed(evaluator, tmp_path):
    env = KernelEnv(tasks=[bundled_task(TASK)], evaluator=evaluator, workspace_root=tmp_path,
                    config=EnvConfig(shaping=ShapingConfig(well_formed_turn=0.2, well_formed_cap=0.3,
                                                           malformed_turn=-0.1)))
    await env.areset()
    rewards = []
    for action in (call("list_files"), "no call here", call("read_file", path="model.py"), call("run_shell"),
                   call("list_files"), call("write_file", path="model_new.py")):
        _, r, _, _, info = await env.astep(action)
        rewards.append(round(r, 6))
    # well formed 0.2, malformed -0.1, well formed 0.1 (the cap), unknown tool -0.1, capped 0, bad arguments -0.1
    assert rewards == [0.2, -0.1, 0.1, -0.1, 0.0, -0.1]
    assert "shaping: malformed turn -0.1" in info["reward_reasons"]
    env.close()
