"""Action parsing, tool schemas and output trimming (no evaluator needed)."""

import json

import pytest

from cudagym.env.format import trim_output
from cudagym.env.parsing import parse_action, parse_text
from cudagym.env.tools import ToolCall, Toolbox


def test_hermes_blocks_with_reasoning_and_raw_newlines():
    text = (
        "<think>the kernel needs a loop</think>I will write the file.\n"
        '<tool_call>\n{"name": "write_file", "arguments": {"path": "kernels/a.cpp", "content": "int x;\nint y;"}}\n'
        '</tool_call>\n'
        '<tool_call>{"name": "compile", "arguments": {}}</tool_call>'
    )
    p = parse_text(text)
    assert p.error is None
    assert [c.name for c in p.calls] == ["write_file", "compile"]
    assert p.calls[0].arguments["content"] == "int x;\nint y;"


def test_bare_json_fenced_and_list():
    assert parse_text('{"name": "verify", "arguments": {}}').calls[0].name == "verify"
    parsed = parse_text('```json\n{"name": "profile", "arguments": {"ncu": true}}\n```')
    assert parsed.calls[0].arguments == {"ncu": True}
    p = parse_text('[{"name": "list_files"}, {"name": "submit", "arguments": "{}"}]')
    assert [c.name for c in p.calls] == ["list_files", "submit"]


def test_unclosed_tool_call_block_is_still_read():
    p = parse_text('ok <tool_call>{"name": "compile", "arguments": {}}')
    assert [c.name for c in p.calls] == ["compile"]


@pytest.mark.parametrize("text, fragment", [
    ("I think I should compile now.", "no tool call found"),
    ("<tool_call>{not json}</tool_call>", "invalid JSON"),
    ('<tool_call>{"arguments": {}}</tool_call>', "needs a string 'name'"),
    ('<tool_call>{"name": "read_file", "arguments": [1, 2]}</tool_call>', "must be a JSON object"),
    ("", "no tool call found"),
])
def test_unparseable_text_gives_a_message(text, fragment):
    p = parse_text(text)
    assert p.calls == []
    assert fragment in p.error
    assert "<tool_call>" in p.error  # the message teaches the format


def test_one_bad_block_does_not_drop_the_good_ones():
    p = parse_text('<tool_call>{bad}</tool_call><tool_call>{"name": "compile"}</tool_call>')
    assert [c.name for c in p.calls] == ["compile"]
    assert "tool call #1" in p.error


def test_structured_forms():
    assert parse_action({"name": "compile", "arguments": {}}).calls[0].name == "compile"
    native = {"id": "c1", "type": "function", "function": {"name": "read_file", "arguments": '{"path": "model.py"}'}}
    call = parse_action(native).calls[0]
    assert (call.name, call.arguments, call.id) == ("read_file", {"path": "model.py"}, "c1")
    assert len(parse_action([ToolCall(name="verify"), {"name": "profile"}]).calls) == 2
    assert "no tool call" in parse_action([]).error
    assert parse_action(42).error


def test_schemas_are_flat_openai_functions():
    schemas = Toolbox().schemas()
    names = [s["function"]["name"] for s in schemas]
    assert names == ["write_file", "edit_file", "read_file", "list_files", "compile", "verify", "profile", "submit"]
    for s in schemas:
        assert s["type"] == "function" and s["function"]["description"]
        params = s["function"]["parameters"]
        assert params["type"] == "object" and params["additionalProperties"] is False
        for name, prop in params["properties"].items():
            assert prop["type"] in ("string", "integer", "boolean"), (s["function"]["name"], name)
        json.dumps(s)
    by_name = {s["function"]["name"]: s["function"]["parameters"] for s in schemas}
    assert by_name["profile"]["properties"]["ncu"]["type"] == "boolean"
    assert by_name["edit_file"]["required"] == ["path", "old_string", "new_string"]


def test_trim_keeps_errors_head_and_tail():
    lines = [f"note: line {i} of ordinary compiler chatter" for i in range(2000)]
    lines[1200] = "kernels/a.cu(12): error: identifier \"blockIdx\" is undefined"
    text = "\n".join(lines)
    out = trim_output(text, 3000)
    assert len(out) < 3500
    assert "identifier \"blockIdx\" is undefined" in out
    assert "line 0 of" in out and "line 1999 of" in out
    assert "lines elided" in out
    assert trim_output("short", 100) == "short"
