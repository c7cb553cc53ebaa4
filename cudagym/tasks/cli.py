"""`cudagym tasks ...` (owned by the corpus work; replaced there)."""

import typer

app = typer.Typer(no_args_is_help=True)
