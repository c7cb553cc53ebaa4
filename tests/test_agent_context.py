"""Context budget with a real (locally trained) tokenizer, the system prompt, scripted/callable policies."""

import json

import pytest
from tokenizers import Tokenizer, models, pre_tokenizers, trainers

from cudagym.agent.context import ContextBudget
from cudagym.agent.policy import CallablePolicy, PolicyError, TurnContext
from cudagym.agent.prompt import system_prompt
from cudagym.agent.scripted import ScriptedPolicy
from cudagym.env.parsing import parse_action
from cudagym.env.tokens import CharEstimate, TokenizerCounter
from cudagym.env.tools import Toolbox


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    tok = Tokenizer(models.WordLevel(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    corpus = ["the kernel writes out float values", "compile verify profile submit",
              "error undefined reference to blockIdx", "tool output line"]
    tok.train_from_iterator(corpus, trainers.WordLevelTrainer(special_tokens=["[UNK]"]))
    path = tmp_path_factory.mktemp("tok") / "tokenizer.json"
    tok.save(str(path))
    return TokenizerCounter.from_file(path)


def test_tokenizer_counter_counts_words_not_chars(tokenizer):
    assert tokenizer.count("the kernel writes out float values") == 6
    assert tokenizer.count("compile unknownwordxyz") == 2  # unknown words are one [UNK] each
    assert CharEstimate().count("x" * 10) == 3


def _conversation(n_turns, out_words=300):
    msgs = [{"role": "system", "content": "the kernel " * 50}, {"role": "user", "content": "compile verify " * 20}]
    for i in range(n_turns):
        msgs.append({"role": "assistant", "content": f"turn {i}", "tool_calls": [
            {"id": f"c{i}", "type": "function", "function": {"name": "write_file", "arguments": json.dumps(
                {"path": "kernels/a.cpp", "content": "float values " * 200})}}]})
        msgs.append({"role": "tool", "tool_call_id": f"c{i}", "content": "tool output line " * out_words})
    return msgs


def test_fit_elides_old_tool_outputs_first(tokenizer):
    msgs = _conversation(6)
    budget = ContextBudget(max_tokens=4000, counter=tokenizer, keep_recent=2)
    full = budget.total(msgs)
    fitted = budget.fit(msgs)
    assert full > 4000 >= budget.total(fitted)
    assert fitted[0] == msgs[0] and fitted[1] == msgs[1]  # system and task prompt untouched
    assert fitted[-2:] == msgs[-2:]  # the recent turn untouched
    tool_contents = [m["content"] for m in fitted if m["role"] == "tool"]
    assert "elided" in tool_contents[0] and "elided" not in tool_contents[-1]
    # structure kept: every tool message still answers its call
    assert [m["tool_call_id"] for m in fitted if m["role"] == "tool"] == [f"c{i}" for i in range(6)]
    assert msgs[3]["content"].startswith("tool output")  # the input was not mutated


def test_fit_elides_arguments_then_drops_turns(tokenizer):
    msgs = _conversation(8, out_words=10)
    budget = ContextBudget(max_tokens=2500, counter=tokenizer, keep_recent=2)
    fitted = budget.fit(msgs)
    assert budget.total(fitted) <= 2500
    args = [json.loads(m["tool_calls"][0]["function"]["arguments"]) for m in fitted if m.get("tool_calls")]
    assert "elided" in args[0]["content"] and args[-1]["content"].startswith("float values")
    tiny = ContextBudget(max_tokens=900, counter=tokenizer, keep_recent=2).fit(msgs)
    assert any("earlier messages were removed" in (m.get("content") or "") for m in tiny)
    assert tiny[-2:] == msgs[-2:] and len(tiny) < len(msgs)
    # a dropped assistant turn never leaves an orphan tool message behind
    ids = {c["id"] for m in tiny for c in m.get("tool_calls", [])}
    assert all(m["tool_call_id"] in ids for m in tiny if m["role"] == "tool")


def test_under_budget_is_unchanged():
    msgs = _conversation(1, out_words=5)
    assert ContextBudget(max_tokens=10**6).fit(msgs) == msgs


def test_system_prompt_covers_rules_tools_formats():
    cpu = system_prompt("cpu", "strict")
    for needle in ("strict", "allocation and view ops", "write_file", "edit_file", "submit", "kernel_library",
                   "load_inline", "extern \"C\"", "C++", "OpenMP"):
        assert needle in cpu, needle
    cuda = system_prompt("cuda", "permissive", tools=Toolbox().schemas(), hermes=True)
    assert "permissive" in cuda and "coalesce" in cuda.lower() and "<tools>" in cuda and "<tool_call>" in cuda
    assert '"name": "profile"' in cuda


async def test_scripted_policy_plans_from_context(tmp_path):
    sol = tmp_path / "t1" / "cpu"
    (sol / "kernels").mkdir(parents=True)
    (sol / "model_new.py").write_text("# new\n")
    (sol / "kernels" / "k.cpp").write_text("// k\n")
    p = ScriptedPolicy(solutions_root=tmp_path)
    names = []
    for turn in range(5):
        t = await p.aact([], [], TurnContext(episode_id="e", task_id="t1", target="cpu", turn=turn))
        names.append([c.name for c in parse_action(t.action()).calls])
    assert names == [["write_file", "write_file"], ["compile"], ["verify"], ["profile"], ["submit"]]
    t = await p.aact([], [], TurnContext(episode_id="e", task_id="t1", target="cuda", turn=0))
    assert "no stored solution" in t.content and parse_action(t.action()).calls[0].name == "submit"


def sample_policy(messages, tools, context):
    return {"name": "list_files", "arguments": {}}


async def test_callable_policy_from_spec():
    p = CallablePolicy.from_spec("test_agent_context:sample_policy")
    t = await p.aact([], [], TurnContext(episode_id="e", task_id="t", target="cpu", turn=3))
    assert t.tool_calls[0].name == "list_files" and t.tool_calls[0].id == "call_3_0"
    with pytest.raises(PolicyError):
        CallablePolicy.from_spec("no_such_module_xyz:fn")
    with pytest.raises(PolicyError):
        CallablePolicy.from_spec("justaname")
