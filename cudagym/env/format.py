"""Observation text: tool results rendered for the agent, long output trimmed to a budget.

Trimming keeps what an agent needs to fix its code: the lines that report errors (with a line of
context), then the head and the tail of the output, and says how much it left out.
"""

from __future__ import annotations

import re

from cudagym.core.verdict import CompileResult, ProfileResult, TimingStats, Verdict, VerifyResult
from cudagym.sandbox.library import LIBRARY_TITLES

_ERROR_LINE = re.compile(
    r"(error|Error|ERROR|undefined reference|Traceback|Exception|FAILED|fatal|mismatch|"
    r"Segmentation|Aborted|illegal|^\s*File \".*\", line \d+)"
)


def trim_output(text: str, budget_chars: int) -> str:
    """`text` cut to about `budget_chars`, keeping error lines first, then head and tail."""
    if len(text) <= budget_chars:
        return text
    lines = text.splitlines()
    keep: set[int] = set()
    used = 0
    # 1. error lines and their neighbours, first come first kept, up to 60% of the budget
    for i, line in enumerate(lines):
        if _ERROR_LINE.search(line):
            for j in (i - 1, i, i + 1):
                if 0 <= j < len(lines) and j not in keep:
                    cost = min(len(lines[j]), 400) + 1
                    if used + cost > budget_chars * 0.6:
                        break
                    keep.add(j)
                    used += cost
    # 2. head and tail share what is left
    rest = max(budget_chars - used, 0)
    head_budget, tail_budget = rest // 2, rest - rest // 2
    for i in range(len(lines)):
        cost = min(len(lines[i]), 400) + 1
        if cost > head_budget:
            break
        if i not in keep:
            keep.add(i)
            head_budget -= cost
    for i in range(len(lines) - 1, -1, -1):
        cost = min(len(lines[i]), 400) + 1
        if cost > tail_budget:
            break
        if i not in keep:
            keep.add(i)
            tail_budget -= cost
    out: list[str] = []
    skipped = 0
    for i, line in enumerate(lines):
        if i in keep:
            if skipped:
                out.append(f"[... {skipped} lines elided ...]")
                skipped = 0
            out.append(line if len(line) <= 400 else line[:400] + " [... line cut ...]")
        else:
            skipped += 1
    if skipped:
        out.append(f"[... {skipped} lines elided ...]")
    return "\n".join(out)


def _ms(t: TimingStats | None) -> str:
    if t is None:
        return "n/a"
    return f"{t.median_ms:.4f} ms (median of {t.n}, IQR {t.iqr_ms:.4f} ms, CV {t.cv * 100:.1f}%)"


def _x(s: float | None) -> str:
    return "n/a" if s is None else f"{s:.3f}x"


def format_compile(r: CompileResult, budget: int) -> str:
    if r.ok:
        what = "nothing changed, reused the cached build" if r.cached else (
            f"compiled {', '.join(r.compiled) or 'nothing'}" + (f"; reused {', '.join(r.reused)}" if r.reused else ""))
        extra = f"; pre-built inline modules: {', '.join(r.inline_modules)}" if r.inline_modules else ""
        tail = f"\n{trim_output(r.log, budget // 2)}" if r.log.strip() and "warning" in r.log else ""
        return f"Compile succeeded in {r.seconds:.1f}s ({what}{extra}).{tail}"
    body = "\n".join(r.errors) if r.errors else ""
    log = r.log if r.log.strip() else ""
    text = "Compile FAILED.\n" + (f"Errors:\n{body}\n" if body else "") + (f"Compiler output:\n{log}" if log else "")
    return trim_output(text.rstrip(), budget)


def format_verify(r: VerifyResult, budget: int) -> str:
    lines = []
    if r.ok:
        lines.append(f"Verify PASSED: correct on {r.trials_passed}/{r.trials} trials"
                     + (f", max abs error {r.max_abs_error:.3g}" if r.max_abs_error is not None else "") + ".")
    else:
        kind = r.error_kind.value if r.error_kind else "not correct"
        lines.append(f"Verify FAILED ({kind}): passed {r.trials_passed}/{r.trials} trials"
                     + (f", max abs error {r.max_abs_error:.3g}" if r.max_abs_error is not None else "") + ".")
    if r.audit is not None:
        a = r.audit
        lines.append(f"Op audit ({a.mode}): {'passed' if a.passed else 'FAILED'}"
                     + (f"; forbidden ops: {', '.join(a.forbidden_ops)}" if a.forbidden_ops else "")
                     + (f"; own-kernel share {a.own_kernel_share:.0%}" if a.own_kernel_share is not None else ""))
        lines.extend(f"  - {x}" for x in a.reasons)
    lines.extend(f"- {x}" for x in r.reasons)
    if r.error:
        lines.append("Error output:\n" + r.error)
    return trim_output("\n".join(lines), budget)


def format_profile(r: ProfileResult, budget: int) -> str:
    if not r.ok:
        kind = r.error_kind.value if r.error_kind else "failed"
        text = (
            f"Profile FAILED ({kind})." + "".join(f"\n- {x}" for x in r.reasons) + (f"\n{r.error}" if r.error else "")
        )
        return trim_output(text, budget)
    lines = [
        f"ModelNew:      {_ms(r.candidate)}",
        f"eager PyTorch: {_ms(r.eager)}",
        f"torch.compile: {_ms(r.compiled)}",
        f"Speedup vs eager {_x(r.speedup_vs_eager)}, vs torch.compile {_x(r.speedup_vs_compile)}.",
    ]
    for name, stats in r.library.items():
        lines.append(
            f"{LIBRARY_TITLES.get(name, name) + ':':<14} {_ms(stats)} (speedup {_x(r.speedup_vs_library.get(name))})"
        )
    if r.server is not None:
        s = r.server
        lines.append(
            f"Server mode (calls after {s.gap_ms[0]:g}-{s.gap_ms[1]:g} ms idle gaps): ModelNew {_ms(s.candidate)}, "
            f"eager {_ms(s.eager)}, torch.compile {_ms(s.compiled)}; speedup vs eager "
            f"{_x(s.speedup_vs_eager)}, vs torch.compile {_x(s.speedup_vs_compile)}."
        )
    lines.extend(f"- {x}" for x in r.reasons)
    if r.ncu:
        lines.append("Nsight Compute metrics:")
        for k, v in r.ncu.items():
            lines.append(f"  {k}: {v}")
    return trim_output("\n".join(lines), budget)


def format_verdict(v: Verdict, budget: int) -> str:
    lines = [f"Submitted. Milestone: {v.milestone}; reward {v.reward:+g}."]
    lines.extend(f"- {x}" for x in v.reasons)
    if v.error and v.milestone == "failed":
        lines.append("Error output:\n" + v.error)
    return trim_output("\n".join(lines), budget)
