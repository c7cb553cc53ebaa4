"""The agent's tools: argument models, OpenAI function schemas, and their execution.

Each tool is one pydantic argument model (flat: string, integer and boolean fields only, since
some trainers drop nested schema fields) plus one coroutine that runs it against an episode's
`ToolContext`. A tool never raises for a bad request: it returns a `ToolResult` with `ok=False`
and a message meant for the agent. File tools go through `Workspace`, which enforces the write
rules (only `model_new.py` and `kernels/` are writable, no traversal, size limits).
"""

from __future__ import annotations

import json
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from cudagym.env.format import (
    format_compile,
    format_profile,
    format_verdict,
    format_verify,
    trim_output,
)
from cudagym.env.variants import BookLimits, MeasuredFiles, snapshot_files
from cudagym.errors import CudagymError, WorkspaceError
from cudagym.core.verdict import CompileResult, Verdict
from cudagym.rewards.reuse import ProfileMemo
from cudagym.sandbox.workspace import Workspace
from cudagym.tasks.model import Task


class ToolCall(BaseModel):
    """One requested tool invocation. `id` is the caller's (native tool calls carry one)."""

    name: str
    arguments: dict[str, Any] = Field(default_factory=dict)
    id: str | None = None


class ToolResult(BaseModel):
    """What a tool returns: `text` is the agent's observation; `data` is for `info` and logs."""

    name: str
    ok: bool
    text: str
    seconds: float = 0.0
    call_id: str | None = None
    error: str | None = None  # short reason when ok is False
    data: dict[str, Any] = Field(default_factory=dict)
    verdict: Verdict | None = None  # set by submit
    terminal: bool = False  # the episode ends after this call (submit)
    measured: MeasuredFiles | None = Field(default=None, exclude=True)  # profile, submit: the files measured


# -- argument models ---------------------------------------------------------------------------
class _Args(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class WriteFileArgs(_Args):
    """Create or overwrite a file. Only `model_new.py` and files under `kernels/` are writable."""

    path: str = Field(description="Workspace-relative path, e.g. 'model_new.py' or 'kernels/add.cpp'.")
    content: str = Field(description="The complete new content of the file.")


class EditFileArgs(_Args):
    """Replace one exact occurrence of `old_string` with `new_string` in a writable file."""

    path: str = Field(description="Workspace-relative path of the file to edit.")
    old_string: str = Field(description="Exact text to replace; it must occur exactly once in the file.")
    new_string: str = Field(description="The replacement text.")


class ReadFileArgs(_Args):
    """Read a workspace file (including the read-only reference `model.py`), with line numbers."""

    path: str = Field(description="Workspace-relative path of the file to read.")
    start_line: int = Field(default=1, ge=1, description="First line to show (1-based).")
    max_lines: int = Field(default=400, ge=1, le=5000, description="How many lines to show at most.")


class ListFilesArgs(_Args):
    """List the files of the workspace with their sizes."""


class CompileArgs(_Args):
    """Compile the kernels under `kernels/` (and any load_inline modules of model_new.py)."""


class VerifyArgs(_Args):
    """Check ModelNew against the reference on fresh random inputs, with the op audit."""


class ProfileArgs(_Args):
    """Time ModelNew against eager PyTorch and torch.compile on the target device."""

    ncu: bool = Field(default=False, description="Also collect Nsight Compute metrics (CUDA target only; slower).")


class SubmitArgs(_Args):
    """Submit the workspace as the final answer: verify and profile it and end the episode."""


# -- execution context -------------------------------------------------------------------------
@dataclass
class ToolContext:
    """What a tool works on: one episode's task (already for its target), workspace and evaluator."""

    task: Task
    workspace: Workspace
    evaluator: Any  # an EvaluatorAPI: cudagym.rewards.evaluator.Evaluator, cudagym.pool.EvalPool
    max_output_chars: int = 6000
    counters: dict[str, dict[str, float]] = field(default_factory=dict)
    book_limits: BookLimits | None = None  # what profile and submit read of the files they measure
    profiles: ProfileMemo = field(default_factory=ProfileMemo)  # the episode's profiles a submit may reuse


ToolFn = Callable[[ToolContext, Any], Awaitable[ToolResult]]


@dataclass(frozen=True)
class ToolSpec:
    name: str
    args: type[_Args]
    run: ToolFn

    @property
    def description(self) -> str:
        return (self.args.__doc__ or "").strip()

    def schema(self) -> dict[str, Any]:
        """The OpenAI function-calling schema of this tool (flat JSON schema, no titles)."""
        raw = self.args.model_json_schema()
        props = {}
        for name, prop in raw.get("properties", {}).items():
            p = {k: v for k, v in prop.items() if k != "title"}
            props[name] = p
        params: dict[str, Any] = {"type": "object", "properties": props, "additionalProperties": False}
        params["required"] = list(raw.get("required", []))
        return {"type": "function",
                "function": {"name": self.name, "description": self.description, "parameters": params}}


def _ok(name: str, text: str, **data: Any) -> ToolResult:
    return ToolResult(name=name, ok=True, text=text, data=data)


def _fail(name: str, error: str, text: str | None = None, **data: Any) -> ToolResult:
    return ToolResult(name=name, ok=False, text=text or f"Error: {error}", error=error, data=data)


# -- the tools ---------------------------------------------------------------------------------
async def _write_file(ctx: ToolContext, a: WriteFileArgs) -> ToolResult:
    ctx.workspace.write(a.path, a.content)
    n = a.content.count("\n") + (1 if a.content and not a.content.endswith("\n") else 0)
    return _ok("write_file", f"Wrote {a.path} ({len(a.content.encode())} bytes, {n} lines).", path=a.path)


async def _edit_file(ctx: ToolContext, a: EditFileArgs) -> ToolResult:
    ctx.workspace.edit(a.path, a.old_string, a.new_string)
    return _ok("edit_file", f"Edited {a.path}: replaced 1 occurrence.", path=a.path)


async def _read_file(ctx: ToolContext, a: ReadFileArgs) -> ToolResult:
    text = ctx.workspace.read(a.path)
    lines = text.splitlines()
    end = min(len(lines), a.start_line - 1 + a.max_lines)
    shown = lines[a.start_line - 1 : end]
    width = len(str(end))
    body = "\n".join(f"{i:>{width}} | {line}" for i, line in enumerate(shown, start=a.start_line))
    header = (f"{a.path} (lines {a.start_line}-{end} of {len(lines)})" if shown
              else f"{a.path}: no lines in range (it has {len(lines)})")
    return _ok("read_file", trim_output(f"{header}\n{body}" if shown else header, ctx.max_output_chars), path=a.path)


async def _list_files(ctx: ToolContext, a: ListFilesArgs) -> ToolResult:
    rows = []
    for rel in ctx.workspace.list():
        size = (ctx.workspace.root / rel).stat().st_size
        note = " (read-only reference)" if rel == "model.py" else ""
        rows.append(f"{rel}  {size} bytes{note}")
    return _ok("list_files", "\n".join(rows) if rows else "(the workspace is empty)", files=ctx.workspace.list())


async def _compile(ctx: ToolContext, a: CompileArgs) -> ToolResult:
    res: CompileResult = await ctx.evaluator.acompile(ctx.task, ctx.workspace)
    text = format_compile(res, ctx.max_output_chars)
    r = ToolResult(name="compile", ok=res.ok, text=text, error=None if res.ok else "compile failed",
                   data={"compile": res.model_dump(exclude={"log"})})
    return r


async def _verify(ctx: ToolContext, a: VerifyArgs) -> ToolResult:
    res = await ctx.evaluator.averify(ctx.task, ctx.workspace)
    return ToolResult(name="verify", ok=res.ok, text=format_verify(res, ctx.max_output_chars),
                      error=None if res.ok else (res.error_kind.value if res.error_kind else "not correct"),
                      data={"verify": res.model_dump()})


def _changed_note(ctx: ToolContext, measured: MeasuredFiles) -> str:
    """A note when the tool's jobs (the candidate's code) changed the workspace's solution files."""
    changed = measured.changed_in(ctx.workspace)
    if not changed:
        return ""
    names = ", ".join(changed[:8]) + (f" and {len(changed) - 8} more" if len(changed) > 8 else "")
    return (f"\nNote: the solution's code changed files of the workspace while it ran ({names}); what was "
            "measured is the workspace as it was before.")


async def _profile(ctx: ToolContext, a: ProfileArgs) -> ToolResult:
    measured = snapshot_files(ctx.workspace, ctx.book_limits)  # before the jobs: they run the candidate's code
    res = await ctx.evaluator.aprofile(ctx.task, ctx.workspace, ncu=a.ncu)
    ctx.profiles.record(res)
    return ToolResult(name="profile", ok=res.ok,
                      text=format_profile(res, ctx.max_output_chars) + _changed_note(ctx, measured),
                      error=None if res.ok else (res.error_kind.value if res.error_kind else "profile failed"),
                      data={"profile": res.model_dump()}, measured=measured)


async def _submit(ctx: ToolContext, a: SubmitArgs) -> ToolResult:
    measured = snapshot_files(ctx.workspace, ctx.book_limits)
    verdict: Verdict = await ctx.evaluator.aevaluate(ctx.task, ctx.workspace, profiled=ctx.profiles)
    return ToolResult(name="submit", ok=True, text=format_verdict(verdict, ctx.max_output_chars),
                      data={"verdict": verdict.summary()}, verdict=verdict, terminal=True, measured=measured)


TOOLS: tuple[ToolSpec, ...] = (
    ToolSpec("write_file", WriteFileArgs, _write_file),
    ToolSpec("edit_file", EditFileArgs, _edit_file),
    ToolSpec("read_file", ReadFileArgs, _read_file),
    ToolSpec("list_files", ListFilesArgs, _list_files),
    ToolSpec("compile", CompileArgs, _compile),
    ToolSpec("verify", VerifyArgs, _verify),
    ToolSpec("profile", ProfileArgs, _profile),
    ToolSpec("submit", SubmitArgs, _submit),
)


class Toolbox:
    """The tool set of an environment: schemas for the policy and `run` for the environment."""

    def __init__(self, tools: tuple[ToolSpec, ...] = TOOLS) -> None:
        self.tools = {t.name: t for t in tools}

    @property
    def names(self) -> list[str]:
        return list(self.tools)

    def schemas(self) -> list[dict[str, Any]]:
        return [t.schema() for t in self.tools.values()]

    def accepts(self, call: ToolCall) -> bool:
        """Whether `call` names one of these tools with valid arguments (it may still fail when run)."""
        spec = self.tools.get(call.name)
        if spec is None:
            return False
        try:
            spec.args.model_validate(call.arguments)
        except ValidationError:
            return False
        return True

    async def run(self, ctx: ToolContext, call: ToolCall) -> ToolResult:
        """Run one call. Every failure becomes an error result, never an exception."""
        t0 = time.perf_counter()
        result = await self._run(ctx, call)
        result.seconds = time.perf_counter() - t0
        result.call_id = call.id
        c = ctx.counters.setdefault(result.name, {"calls": 0, "errors": 0, "seconds": 0.0})
        c["calls"] += 1
        c["errors"] += 0 if result.ok else 1
        c["seconds"] += result.seconds
        return result

    async def _run(self, ctx: ToolContext, call: ToolCall) -> ToolResult:
        spec = self.tools.get(call.name)
        if spec is None:
            return _fail(call.name or "?", f"unknown tool {call.name!r}; the tools are: {', '.join(self.tools)}")
        try:
            args = spec.args.model_validate(call.arguments)
        except ValidationError as e:
            return _fail(spec.name, f"bad arguments for {spec.name}: {_describe_validation(e)}",
                         text=f"Error: bad arguments for {spec.name}: {_describe_validation(e)}\n"
                              f"Expected: {json.dumps(spec.schema()['function']['parameters']['properties'])}")
        try:
            return await spec.run(ctx, args)
        except WorkspaceError as e:
            return _fail(spec.name, str(e))
        except CudagymError as e:
            return _fail(spec.name, f"{spec.name} could not run: {e}")
        except Exception as e:  # noqa: BLE001 - a harness bug must not reach the agent as a traceback
            return _fail(
                spec.name,
                f"internal error in {spec.name} ({type(e).__name__}); this is not your code's fault",
                internal=f"{type(e).__name__}: {e}",
            )


def _describe_validation(e: ValidationError) -> str:
    parts = []
    for err in e.errors():
        loc = ".".join(str(x) for x in err["loc"]) or "arguments"
        kind = err["type"]
        if kind == "missing":
            parts.append(f"missing required argument '{loc}'")
        elif kind == "extra_forbidden":
            parts.append(f"unexpected argument '{loc}'")
        else:
            got = type(err.get("input")).__name__
            parts.append(f"'{loc}': {err['msg'].lower()} (got {got})")
    return "; ".join(parts)
