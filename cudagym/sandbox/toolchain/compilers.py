"""Running a compiler or the linker (`cudagym.sandbox.toolchain`), and reading what it printed:
its process (own process group, killed on timeout), readable diagnostics from gcc, nvcc and the
linker, trimmed logs, and what a failed run says when nothing in its output parses.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
from dataclasses import dataclass
from pathlib import Path

MAX_LOG_LINES = 200


# -- diagnostics -----------------------------------------------------------------------------

_GCC_DIAG = re.compile(
    r"^(?P<file>[^\s:][^:]*?):(?P<line>\d+)(?::\d+)?: (?P<sev>fatal error|error|warning|note): (?P<msg>.*)$"
)
_NVCC_DIAG = re.compile(
    r"^(?P<file>[^\s(][^(]*?)\((?P<line>\d+)\): (?P<sev>catastrophic error|error|warning|remark)"
    r"(?: #[\w-]+)?: (?P<msg>.*)$"
)
_TOOL_ERROR = re.compile(
    r"^(?:\S*/)?(?P<tool>g\+\+|gcc|c\+\+|cc1plus|nvcc|ptxas|ld|collect2|cicc)(?:\s+(?:fatal|error))?\s*:"
    r"\s*(?:(?:fatal )?error:\s*)?(?P<msg>.*)$"
)
_QUOTES = str.maketrans("\u2018\u2019", "''")  # gcc's UTF-8 quotes, where the locale asks for them
_ERROR_WORD = re.compile(r"\b(error|fatal)\b", re.IGNORECASE)
_LINK_ERROR = re.compile(r"(undefined reference to .*|multiple definition of .*|cannot find -l\S+)")
_NOISE = re.compile(
    r"(In instantiation of|required from|required by substitution|In file included from|"
    r"^\s+from |In function |In member function |At global scope:|In lambda function|"
    r"^compilation terminated|Detected \d+ compilation errors?|errors? detected in the compilation)"
)


def relativize(text: str, replacements: dict[str, str]) -> str:
    """Replace each absolute path prefix in `text` by its short name (longest prefix first)."""
    for prefix in sorted(replacements, key=len, reverse=True):
        if prefix:
            text = text.replace(prefix, replacements[prefix])
    return text


def parse_diagnostics(output: str, max_lines: int) -> list[str]:
    """Readable error lines (`file:line: error: message`) from gcc / nvcc / linker output.

    Warnings, notes and template-instantiation chains are dropped; duplicates are collapsed.
    `output` should already be relativized.
    """
    errors: list[str] = []
    for raw in output.splitlines():
        line = raw.rstrip()
        if not line or _NOISE.search(line):
            continue
        m = _GCC_DIAG.match(line) or _NVCC_DIAG.match(line)
        if m:
            sev = m["sev"]
            if sev in ("warning", "note", "remark"):
                continue
            sev = "error" if sev == "catastrophic error" else sev
            entry = f"{m['file']}:{m['line']}: {sev}: {m['msg'].strip().translate(_QUOTES)}"
        elif (lm := _LINK_ERROR.search(line)) and ("ld" in line or ".o" in line or "in function" in line):
            entry = f"link: error: {lm.group(1).strip()}"
        elif (tm := _TOOL_ERROR.match(line)) and _ERROR_WORD.search(line):
            msg = tm["msg"].strip()
            if not msg or msg.startswith("ld returned"):
                continue
            entry = f"{tm['tool']}: error: {msg}"
        else:
            continue
        if entry not in errors:
            errors.append(entry)
        if len(errors) >= max_lines:
            break
    return errors


def trim_log(output: str, max_lines: int = MAX_LOG_LINES) -> str:
    """The compiler output without instantiation noise, at most `max_lines` lines."""
    lines = [ln.rstrip() for ln in output.splitlines() if ln.strip() and not _NOISE.search(ln)]
    if len(lines) > max_lines:
        lines = lines[:max_lines] + [f"... ({len(lines) - max_lines} more lines)"]
    return "\n".join(lines)


# -- running compilers -----------------------------------------------------------------------


@dataclass
class ToolRun:
    """One finished compiler or linker run: its exit status and output (stdout and stderr together)."""

    returncode: int
    output: str
    timed_out: bool = False


def run_tool(argv: list[str], cwd: Path, env: dict[str, str], timeout_s: float) -> ToolRun:
    """Run `argv` in its own process group; kill the whole group on timeout."""
    proc = subprocess.Popen(
        argv, cwd=cwd, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT, start_new_session=True,
    )
    try:
        out, _ = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        out, _ = proc.communicate()
        return ToolRun(-signal.SIGKILL, out.decode(errors="replace"), timed_out=True)
    return ToolRun(proc.returncode, out.decode(errors="replace"))


_OUTPUT_LIMIT = re.compile(r"File size limit exceeded|File too large|file too large|signal 25\b|SIGXFSZ")


def over_output_limit(run: ToolRun) -> bool:
    """Whether a failed compiler or linker run hit RLIMIT_FSIZE (SIGXFSZ, or EFBIG on a write)."""
    return run.returncode in (-signal.SIGXFSZ, 128 + signal.SIGXFSZ) or bool(_OUTPUT_LIMIT.search(run.output))


def fallback_error(rel: str, output: str, run: ToolRun) -> list[str]:
    """When no diagnostic could be parsed: the last lines of the output, or the exit status."""
    tail = [ln.strip() for ln in output.splitlines() if ln.strip()][-3:]
    if tail:
        return [f"{rel}: error: {ln}" for ln in tail]
    return [f"{rel}: error: the compiler exited with status {run.returncode}"]
