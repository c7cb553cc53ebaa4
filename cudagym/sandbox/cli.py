"""`cudagym sandbox ...`: the sandbox backends' own commands (the docker backend's image)."""

from __future__ import annotations

import typer

from cudagym.options import option
from cudagym.sandbox.config import DockerSandboxConfig

app = typer.Typer(no_args_is_help=True, help="Sandbox backends: the docker backend's image.")
image_app = typer.Typer(no_args_is_help=True, help="The docker backend's image.")
app.add_typer(image_app, name="image")


@image_app.command("build")
def build(
    source: str = typer.Option("host", "--from", help="'host' (offline, the default): `docker import` of a skeleton "
                               "root file system, labelled cudagym.rootfs=host; its containers get this host's /usr, "
                               "/lib*, dynamic-linker cache and Python prefix mounted read-only, so no registry is "
                               "needed and workers run this machine's interpreter, torch and compilers. 'dockerfile': "
                               "cudagym/sandbox/Dockerfile (a CUDA + PyTorch base image, for GPU machines; needs its "
                               "registry)."),
    tag: str = option(DockerSandboxConfig, "image", "--tag"),
) -> None:
    """Build the docker sandbox's image (default: offline, from this host's own Python environment)."""
    from cudagym.errors import CudagymError
    from cudagym.sandbox.image import build_image

    if source not in ("host", "dockerfile"):
        raise typer.BadParameter("--from must be host or dockerfile")
    try:
        image_id = build_image(source, tag)  # type: ignore[arg-type]
    except CudagymError as e:
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(2) from None
    typer.echo(f"{tag} {image_id} (from {source})")
