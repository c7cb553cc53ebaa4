"""The `cudagym` command."""

from __future__ import annotations

import typer

app = typer.Typer(help="cudagym: an RL environment for GPU kernel optimization.", no_args_is_help=True,
                  pretty_exceptions_show_locals=False)


def main() -> None:
    app()
