"""KernelEnv with the real evaluator on the CPU target: check_env, full episodes, bad actions."""

import json
from pathlib import Path

import gymnasium
import pytest
from gymnasium.utils.env_checker import check_env

import cudagym.env  # noqa: F401 - registers cudagym/Kernel-v0
from cudagym.agent.episode import run_episode
from cudagym.agent.scripted import ScriptedPolicy, default_solutions_root
from cudagym.env import ENV_ID, KernelEnv, ToolCall
from cudagym.rewards.evaluator import Evaluator, EvaluatorConfig
from cudagym.sandbox.workspace import MAX_FILE_BYTES
from cudagym.tasks.loaders import bundled_task

TASK = "ew_scale_bias_gelu"
SOLUTION = default_solutions_root() / TASK / "cpu"


@pytest.fixture(scope="module")
def evaluator():
    ev = Evaluator(EvaluatorConfig(target="cpu"))
    yield ev
    ev.close()


@pytest.fixture
def env(evaluator, tmp_path):
    e = KernelEnv(tasks=[bundled_task(TASK)], evaluator=evaluator, workspace_root=tmp_path / "ws", max_turns=12)
    yield e
    e.close()


def call(name, **arguments):
    return f'<tool_call>{json.dumps({"name": name, "arguments": arguments})}</tool_call>'


def test_check_env_passes():
    # no injected evaluator: check_env re-makes the env from its spec, which deep-copies the kwargs
    env = gymnasium.make(ENV_ID, tasks=[bundled_task(TASK)], target="cpu")
    check_env(env.unwrapped)
    assert env.spec.nondeterministic is True
    env.close()


def test_reset_returns_prompt_tools_and_metadata(env):
    obs, info = env.reset(seed=3, options={"task": TASK})
    assert "class Model" in obs and "ModelNew" in obs and "CPU" in obs
    assert env.observation_space.contains(obs)
    assert [t["function"]["name"] for t in info["tools"]][-1] == "submit"
    assert info["task"]["id"] == TASK and info["task"]["target"] == "cpu"
    ws = Path(info["workspace"])
    assert (ws / "model.py").read_text() == env.task.code  # sized for the CPU target
    assert info["task"]["sizes"]["BATCH"] != bundled_task(TASK).sizes["BATCH"]


def test_full_episode_text_actions(env):
    obs, info = env.reset(options={"task": TASK})
    files = {"model_new.py": (SOLUTION / "model_new.py").read_text()}
    for p in sorted((SOLUTION / "kernels").iterdir()):
        files[f"kernels/{p.name}"] = p.read_text()
    turn = "Let me write the solution.\n" + "\n".join(call("write_file", path=k, content=v) for k, v in files.items())
    obs, r, term, trunc, info = env.step(turn)
    assert (r, term, trunc) == (0.0, False, False)
    assert obs.count("[write_file] Wrote") == len(files)
    obs, r, term, trunc, info = env.step("Now compile. " + call("compile"))
    assert "Compile succeeded" in obs, obs
    obs, r, term, trunc, info = env.step(call("verify"))
    assert "Verify PASSED" in obs, obs
    assert info["calls"][0] == {**info["calls"][0], "name": "verify", "ok": True}
    obs, r, term, trunc, info = env.step(call("submit"))
    assert term and not trunc
    assert r >= 1.0, obs
    assert info["verdict"]["correct"] is True
    assert info["reward_reasons"]
    assert info["metrics"]["verify"]["calls"] == 1 and info["metrics"]["write_file"]["calls"] == len(files)
    assert env.observation_space.contains(obs)
    # stepping after the end is an error observation, not an exception
    obs, r, term, trunc, info = env.step(call("list_files"))
    assert "episode is over" in obs and r == 0.0


async def test_full_episode_structured_actions(evaluator, tmp_path):
    env = KernelEnv(tasks=[bundled_task(TASK)], evaluator=evaluator, workspace_root=tmp_path)
    records = []
    result = await run_episode(env, ScriptedPolicy(structured=True), TASK, "s0", on_step=records.append)
    env.close()
    assert result.status == "done" and result.turns == 5
    assert [r["action"]["tool_calls"][0]["name"] for r in records] == ["write_file", "compile", "verify", "profile",
                                                                        "submit"]
    assert records[2]["info"]["calls"][0]["ok"] is True
    assert result.verdict["correct"] and result.reward >= 1.0


async def test_compile_error_is_shown_and_submit_scores_minus_one(env):
    await env.areset(options={"task": TASK})
    await env.astep({"name": "write_file", "arguments": {"path": "kernels/k.cpp",
                                                         "content": "extern \"C\" void f() { undefined_fn(); }\n"}})
    await env.astep({"name": "write_file", "arguments": {"path": "model_new.py", "content": "import torch\n"}})
    obs, r, term, trunc, info = await env.astep({"name": "compile", "arguments": {}})
    assert "Compile FAILED" in obs and "undefined_fn" in obs
    assert info["calls"][0]["ok"] is False and not term
    obs, r, term, trunc, info = await env.astep([ToolCall(name="submit")])
    assert term and r == -1.0 and info["verdict"]["milestone"] == "failed"


async def test_turn_budget_truncates_and_scores(evaluator, tmp_path):
    env = KernelEnv(tasks=[bundled_task(TASK)], evaluator=evaluator, workspace_root=tmp_path, max_turns=2)
    await env.areset()
    obs, r, term, trunc, info = await env.astep(call("list_files"))
    assert not trunc
    obs, r, term, trunc, info = await env.astep(call("read_file", path="model.py"))
    assert trunc and not term and info["truncated_by"] == "turns"
    assert "budget is used up" in obs
    assert r == -1.0 and info["verdict"]["milestone"] == "failed"  # no model_new.py: scored, and failed
    env.close()


async def test_token_budget_truncates(evaluator, tmp_path):
    env = KernelEnv(tasks=[bundled_task(TASK)], evaluator=evaluator, workspace_root=tmp_path, max_tokens=50,
                    score_on_truncation=False)
    await env.areset()
    obs, r, term, trunc, info = await env.astep(call("read_file", path="model.py"))
    assert trunc and info["truncated_by"] == "tokens" and r == 0.0
    env.close()


BAD_ACTIONS = [
    ("unparseable text", "I am not sure what to do.", "no tool call found"),
    ("invalid json", "<tool_call>{'name': 'compile'}</tool_call>", "invalid JSON"),
    ("unknown tool", call("run_shell", cmd="ls"), "unknown tool 'run_shell'"),
    ("missing argument", call("write_file", path="model_new.py"), "missing required argument 'content'"),
    ("wrong type", call("write_file", path="model_new.py", content=123), "'content'"),
    ("wrong type bool", call("profile", ncu="yes"), "'ncu'"),
    ("extra argument", call("compile", fast=True), "unexpected argument 'fast'"),
    ("path traversal", call("write_file", path="../escape.py", content="x"), "without '..'"),
    ("absolute path", call("read_file", path="/etc/passwd"), "must be relative"),
    ("traversal via kernels", call("write_file", path="kernels/../../x.py", content="x"), "without '..'"),
    ("write the reference", call("write_file", path="model.py", content="x = 1"), "not writable"),
    ("edit the reference", call("edit_file", path="model.py", old_string="Model", new_string="M"), "not writable"),
    ("write outside writable dirs", call("write_file", path="harness.py", content="x"), "not writable"),
    ("oversized file", call("write_file", path="kernels/big.cpp", content="x" * (MAX_FILE_BYTES + 1)), "the limit is"),
    ("read missing file", call("read_file", path="kernels/none.cu"), "no such file"),
    ("edit not unique", call("edit_file", path="model_new.py", old_string="zzz", new_string="y"), "occurs 0 times"),
    ("bad structured", {"name": "write_file", "arguments": "not json"}, "invalid JSON"),
    ("structured no name", {"arguments": {}}, "needs a string 'name'"),
]


@pytest.mark.parametrize("label, action, fragment", BAD_ACTIONS, ids=[b[0] for b in BAD_ACTIONS])
async def test_bad_action_is_an_error_observation(env, label, action, fragment):
    _, info = await env.areset(options={"task": TASK})
    ws = Path(info["workspace"])
    await env.astep(call("write_file", path="model_new.py", content="import torch\n"))
    obs, r, term, trunc, info = await env.astep(action)
    assert fragment in obs, obs
    assert "Error" in obs and "Traceback" not in obs
    assert (r, term, trunc) == (0.0, False, False)
    assert not (ws.parent / "escape.py").exists() and not (ws / "harness.py").exists()
    assert (ws / "model.py").read_text() == env.task.code
    # the episode goes on
    obs, *_ = await env.astep(call("list_files"))
    assert "model_new.py" in obs and "model.py" in obs


async def test_too_many_calls_in_one_turn(env):
    await env.areset()
    obs, r, term, trunc, info = await env.astep(call("list_files") * 10)
    assert obs.count("[list_files]") == 8 and "at most 8 tool calls" in obs


async def test_calls_after_submit_are_not_run(env):
    await env.areset()
    obs, r, term, trunc, info = await env.astep(call("submit") + call("list_files"))
    assert term and [c["name"] for c in info["calls"]] == ["submit"] and "after submit were not run" in obs


async def test_edit_and_read_roundtrip(env):
    await env.areset()
    await env.astep(call("write_file", path="kernels/a.cpp", content="int alpha = 1;\nint beta = 2;\n"))
    obs, *_ = await env.astep(call("edit_file", path="kernels/a.cpp", old_string="beta = 2", new_string="beta = 3"))
    assert "replaced 1 occurrence" in obs
    obs, *_ = await env.astep(call("read_file", path="kernels/a.cpp", start_line=2))
    assert "2 | int beta = 3;" in obs and "alpha" not in obs


def test_workspaces_are_separate_and_cleaned(evaluator, tmp_path):
    e1 = KernelEnv(tasks=[bundled_task(TASK)], evaluator=evaluator, workspace_root=tmp_path)
    e2 = KernelEnv(tasks=[bundled_task(TASK)], evaluator=evaluator, workspace_root=tmp_path)
    _, i1 = e1.reset()
    _, i2 = e2.reset()
    assert i1["workspace"] != i2["workspace"]
    e1.step(call("write_file", path="model_new.py", content="a = 1\n"))
    assert not (Path(i2["workspace"]) / "model_new.py").exists()
    e1.close()
    e2.close()
    assert not Path(i1["workspace"]).exists() and not Path(i2["workspace"]).exists()
