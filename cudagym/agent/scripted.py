"""A policy that replays a known solution: write its files, compile, verify, profile, submit.

Solutions live in ``<solutions_root>/<task_id>/<cpu|cuda>/`` (``model_new.py`` and
``kernels/...``); the default root is ``cudagym/examples/solutions``, shipped inside the
package (wheel installs included). For a task without a solution it says so and submits the empty workspace (which
fails). Each turn depends only on the `TurnContext`, so one instance serves concurrent episodes.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from cudagym.agent.policy import AssistantTurn, Policy, TurnContext
from cudagym.env.tools import ToolCall

_STEPS = ("write", "compile", "verify", "profile", "submit")


def default_solutions_root() -> Path:
    env = os.environ.get("CUDAGYM_SOLUTIONS")
    if env:
        return Path(env)
    import cudagym

    return Path(cudagym.__file__).resolve().parent / "examples" / "solutions"


class ScriptedPolicy(Policy):
    name = "scripted"

    def __init__(self, solutions_root: str | os.PathLike[str] | None = None, structured: bool = False) -> None:
        """`structured=True` answers with native tool calls; otherwise with Hermes text."""
        self.solutions_root = Path(solutions_root) if solutions_root else default_solutions_root()
        self.structured = structured

    def solution_dir(self, task_id: str, target: str) -> Path | None:
        d = self.solutions_root / task_id / target
        return d if (d / "model_new.py").is_file() else None

    def solution_files(self, task_id: str, target: str) -> dict[str, str]:
        d = self.solution_dir(task_id, target)
        if d is None:
            return {}
        files = {"model_new.py": (d / "model_new.py").read_text()}
        kdir = d / "kernels"
        if kdir.is_dir():
            for p in sorted(kdir.rglob("*")):
                if p.is_file():
                    files[p.relative_to(d).as_posix()] = p.read_text()
        return files

    def plan(self, context: TurnContext) -> tuple[str, list[ToolCall]]:
        files = self.solution_files(context.task_id, context.target)
        if not files:
            return (f"I have no stored solution for {context.task_id} on {context.target}; submitting as is.",
                    [ToolCall(name="submit", id=f"call_{context.turn}_0")])
        step = _STEPS[min(context.turn, len(_STEPS) - 1)]
        if step == "write":
            calls = [ToolCall(name="write_file", arguments={"path": p, "content": c}, id=f"call_0_{i}")
                     for i, (p, c) in enumerate(files.items())]
            return f"Writing the {len(files)} files of the solution.", calls
        call = ToolCall(name=step, id=f"call_{context.turn}_0")
        return {"compile": "Building the kernels.", "verify": "Checking correctness.",
                "profile": "Timing it against the baselines.", "submit": "Submitting."}[step], [call]

    async def aact(
        self, messages: list[dict[str, Any]], tools: list[dict[str, Any]], context: TurnContext
    ) -> AssistantTurn:
        text, calls = self.plan(context)
        if self.structured:
            return AssistantTurn(content=text, tool_calls=calls)
        blocks = "".join(
            f"\n<tool_call>\n{json.dumps({'name': c.name, 'arguments': c.arguments})}\n</tool_call>" for c in calls
        )
        return AssistantTurn(content=text + blocks)
