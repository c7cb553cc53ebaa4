"""Tasks: the `Task` model, loaders and the corpus generator."""

from cudagym.tasks.model import DEFAULT_TOLERANCE, Target, Task, Tolerance

__all__ = ["DEFAULT_TOLERANCE", "Target", "Task", "Tolerance"]
