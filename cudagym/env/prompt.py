"""The task prompt: the first observation of an episode (the user message of the conversation).

The workflow guide, the rules and the optimization advice are the policy's system prompt
(`cudagym.agent.prompt`); this message carries what is specific to the task.
"""

from __future__ import annotations

from cudagym.tasks.model import Target, Task

_TARGET_NOTE = {
    Target.CUDA: (
        "Target: CUDA on an NVIDIA GPU. Write CUDA kernels (kernels/*.cu with extern \"C\" launchers, "
        "optionally kernels/*_binding.cpp torch bindings) and call them from ModelNew.forward."
    ),
    Target.CPU: (
        "Target: the host CPU (no GPU). Write C++ kernels (kernels/*.cpp with extern \"C\" functions, "
        "optionally kernels/*_binding.cpp torch bindings), compiled with the host compiler; the reference "
        "and the baselines run on the CPU too."
    ),
}


def task_prompt(task: Task, target: Target) -> str:
    """The first user message of an episode for `task` (already sized for `target`)."""
    meta = [f"id: {task.id}", f"dtype: {task.dtype}"]
    if task.level is not None:
        meta.append(f"level: {task.level}")
    if task.ops:
        meta.append(f"ops: {', '.join(task.ops)}")
    tol = task.effective_tolerance
    return (
        f"Optimize this PyTorch reference model with your own kernels.\n\n"
        f"{_TARGET_NOTE[target]}\n"
        f"Task {'; '.join(meta)}; outputs must match within atol={tol.atol:g}, rtol={tol.rtol:g}.\n\n"
        f"The reference is model.py in your workspace (read-only):\n"
        f"```python\n{task.code.rstrip()}\n```\n\n"
        "Write model_new.py defining `class ModelNew(nn.Module)` with the same constructor signature as "
        "`Model` (its state dict is loaded into yours, so keep parameter names and shapes), plus the "
        "kernels it calls under kernels/. Then compile, verify and profile, improve, and submit when "
        "you are done. The episode ends at submit or when the turn budget runs out (the workspace is "
        "then scored as it stands)."
    )
