"""The `cudagym` command: one entry point, subcommands per component."""

from __future__ import annotations

import typer

from cudagym.agent import cli as agent_cli
from cudagym.check import check
from cudagym.sandbox import cli as sandbox_cli
from cudagym.selfcheck import selfcheck_cmd
from cudagym.tasks import cli as tasks_cli
from cudagym.train import cli as train_cli

app = typer.Typer(help="cudagym: an RL environment for GPU kernel optimization.", no_args_is_help=True,
                  pretty_exceptions_show_locals=False, add_completion=False)
tasks_cli.app.command("selfcheck")(selfcheck_cmd)  # above the floors it drives: cudagym/selfcheck.py
app.add_typer(tasks_cli.app, name="tasks", help="List, build and inspect task corpora.")
app.add_typer(sandbox_cli.app, name="sandbox", help="Sandbox backends: build the docker backend's image.")
agent_cli.register(app)
app.add_typer(train_cli.app, name="train")
app.command(name="check")(check)


def main() -> None:
    app()
