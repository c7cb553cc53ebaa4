"""`cudagym run` and `cudagym report` (owned by the episode-runner work; replaced there)."""

import typer


def register(app: typer.Typer) -> None:
    """Add the agent commands to the top-level app."""
