"""OpenAIChatPolicy against a real local HTTP server speaking the chat-completions protocol."""

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from cudagym.agent.openai_policy import OpenAIChatPolicy
from cudagym.agent.policy import PolicyError, TurnContext
from cudagym.agent.prompt import system_prompt
from cudagym.env.parsing import parse_action
from cudagym.env.tools import Toolbox


class ChatServer:
    """Serves scripted replies in order and records every request body."""

    def __init__(self, replies, fail_first=0):
        self.replies = list(replies)
        self.requests = []
        self.fail_first = fail_first
        server = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *a):
                pass

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                server.requests.append({"path": self.path, "auth": self.headers.get("Authorization"), "body": body})
                if server.fail_first > 0:
                    server.fail_first -= 1
                    data = b'{"error": {"message": "overloaded", "type": "server_error"}}'
                    self.send_response(503)
                else:
                    message = server.replies.pop(0)
                    data = json.dumps({
                        "id": "cmpl-1", "object": "chat.completion", "created": 0, "model": body["model"],
                        "choices": [{"index": 0, "message": {"role": "assistant", **message},
                                     "finish_reason": "tool_calls" if message.get("tool_calls") else "stop"}],
                        "usage": {"prompt_tokens": 11, "completion_tokens": 7, "total_tokens": 18},
                    }).encode()
                    self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}/v1"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.httpd.shutdown()
        self.httpd.server_close()


CTX = TurnContext(episode_id="e", task_id="t", target="cpu", turn=0)
TOOLS = Toolbox().schemas()


async def test_native_tool_calls():
    reply = {"content": "Compiling first.", "tool_calls": [
        {"id": "call_a", "type": "function", "function": {"name": "write_file",
                                                          "arguments": json.dumps({"path": "kernels/a.cpp",
                                                                                   "content": "int x;"})}},
        {"id": "call_b", "type": "function", "function": {"name": "compile", "arguments": "{}"}},
    ]}
    with ChatServer([reply]) as srv:
        policy = OpenAIChatPolicy(base_url=srv.url, api_key="sk-test", model="tiny", tool_mode="native")
        msgs = [{"role": "system", "content": system_prompt("cpu")}, {"role": "user", "content": "task"}]
        turn = await policy.aact(msgs, TOOLS, CTX)
        await policy.aclose()
    req = srv.requests[0]
    assert req["path"] == "/v1/chat/completions" and req["auth"] == "Bearer sk-test"
    assert req["body"]["model"] == "tiny" and req["body"]["tools"] == TOOLS and req["body"]["tool_choice"] == "auto"
    assert [c.name for c in turn.tool_calls] == ["write_file", "compile"]
    assert turn.tool_calls[0].arguments == {"path": "kernels/a.cpp", "content": "int x;"}
    assert turn.tool_calls[0].id == "call_a"
    assert turn.usage == {"prompt_tokens": 11, "completion_tokens": 7}
    # the turn's action is what the env parses
    assert [c.name for c in parse_action(turn.action()).calls] == ["write_file", "compile"]
    assert turn.message()["tool_calls"][1]["function"]["name"] == "compile"


async def test_hermes_text_mode(monkeypatch):
    text = 'I will verify.\n<tool_call>\n{"name": "verify", "arguments": {}}\n</tool_call>'
    monkeypatch.setenv("CUDAGYM_MODEL", "env-model")
    monkeypatch.setenv("OPENAI_API_KEY", "sk-env")
    with ChatServer([{"content": text}]) as srv:
        monkeypatch.setenv("OPENAI_BASE_URL", srv.url)
        policy = OpenAIChatPolicy(tool_mode="hermes")
        history = [
            {"role": "system", "content": system_prompt("cpu", tools=TOOLS, hermes=True)},
            {"role": "user", "content": "task"},
            {"role": "assistant", "content": "listing", "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "list_files", "arguments": "{}"}}]},
            {"role": "tool", "tool_call_id": "c1", "content": "model.py 10 bytes"},
        ]
        turn = await policy.aact(history, TOOLS, CTX)
        await policy.aclose()
    body = srv.requests[0]["body"]
    assert body["model"] == "env-model" and srv.requests[0]["auth"] == "Bearer sk-env"
    assert "tools" not in body
    assert "<tools>" in body["messages"][0]["content"]
    # native history folded into text for a server without a tool parser
    assert body["messages"][2]["content"].endswith('</tool_call>') and "tool_calls" not in body["messages"][2]
    assert body["messages"][3] == {"role": "user", "content": "<tool_response>\nmodel.py 10 bytes\n</tool_response>"}
    assert turn.tool_calls == [] and parse_action(turn.action()).calls[0].name == "verify"


async def test_retries_then_succeeds_and_errors_are_policy_errors():
    with ChatServer([{"content": "ok"}], fail_first=2) as srv:
        policy = OpenAIChatPolicy(base_url=srv.url, model="m", max_retries=3)
        policy.config = policy.config.model_copy(update={"timeout_s": 10})
        turn = await policy.aact([{"role": "user", "content": "hi"}], TOOLS, CTX)
        await policy.aclose()
    assert turn.content == "ok" and len(srv.requests) == 3
    with ChatServer([], fail_first=5) as srv:
        policy = OpenAIChatPolicy(base_url=srv.url, model="m", max_retries=1)
        with pytest.raises(PolicyError, match="503"):
            await policy.aact([{"role": "user", "content": "hi"}], TOOLS, CTX)
        await policy.aclose()


def test_missing_model_name_is_a_clear_error(monkeypatch):
    monkeypatch.delenv("CUDAGYM_MODEL", raising=False)
    with pytest.raises(PolicyError, match="CUDAGYM_MODEL"):
        OpenAIChatPolicy(base_url="http://127.0.0.1:9/v1")


async def test_episode_driven_by_the_server(tmp_path):
    """The policy plays a short episode in the real env: tool results go back as tool messages."""
    from cudagym.agent.episode import run_episode
    from cudagym.env import KernelEnv
    from cudagym.tasks.loaders import bundled_task

    def native(i, name, args):
        return {"content": "", "tool_calls": [{"id": f"c{i}", "type": "function",
                                               "function": {"name": name, "arguments": json.dumps(args)}}]}

    replies = [native(0, "read_file", {"path": "model.py"}),
               native(1, "write_file", {"path": "kernels/k.cpp", "content": "this is not C++\n"}),
               native(2, "compile", {}),
               {"content": '<tool_call>{"name": "submit", "arguments": {}}</tool_call>'}]
    with ChatServer(replies) as srv:
        policy = OpenAIChatPolicy(base_url=srv.url, model="m")
        env = KernelEnv(tasks=[bundled_task("ew_scale_bias_gelu")], target="cpu", workspace_root=tmp_path)
        result = await run_episode(env, policy, "ew_scale_bias_gelu", "srv0")
        env.close()
        await policy.aclose()
    assert result.status == "done" and result.turns == 4 and result.reward == -1.0
    last = srv.requests[-1]["body"]["messages"]
    tool_msgs = [m for m in last if m["role"] == "tool"]
    assert [m["tool_call_id"] for m in tool_msgs] == ["c0", "c1", "c2"]
    assert "class Model" in tool_msgs[0]["content"] and "Compile FAILED" in tool_msgs[2]["content"]
    assert result.usage["completion_tokens"] == 28
