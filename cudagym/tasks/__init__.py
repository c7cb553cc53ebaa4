"""Tasks: the `Task` model, loaders and the corpus generator."""

from cudagym.tasks.model import Target, Task, Tolerance, default_tolerance

__all__ = ["Target", "Task", "Tolerance", "default_tolerance"]
