"""Images for the docker sandbox.

Two ways to make one:
- `host` (offline, the default): no registry is needed. The image is a skeleton root file system
  (`/etc/passwd` with the sandbox user, mount points, the host's merged-/usr symlinks) made with
  `docker import` and labelled `cudagym.rootfs=host`; a container of it gets the host's system
  directories (`/usr`, `/lib*`), dynamic-linker cache and Python prefix mounted read-only
  (`cudagym.sandbox.docker.host_mounts`), so it runs exactly this machine's interpreter, torch
  and compilers, and nothing in it can change them.
- `dockerfile`: `cudagym/sandbox/Dockerfile`, shipped in the package (a CUDA + PyTorch base, for
  real GPU machines; needs the base image's registry or a local copy of it). Its build context is
  made in memory from the installed package, so a wheel install builds it as a checkout does.
"""

from __future__ import annotations

import io
import os
import tarfile
from pathlib import Path
from typing import Any, Literal

from cudagym.sandbox.docker import ROOTFS_LABEL, docker_client

DEFAULT_TAG = "cudagym-sandbox:host"
DOCKERFILE = Path(__file__).resolve().with_name("Dockerfile")
ImageSource = Literal["host", "dockerfile"]


def _skeleton() -> bytes:
    """The root file system of a host image, as a tar archive in memory (a few KB)."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        def add(name: str, kind: bytes, mode: int, data: bytes = b"", link: str = "") -> None:
            info = tarfile.TarInfo(name)
            info.type, info.mode, info.size, info.linkname = kind, mode, len(data), link
            tar.addfile(info, io.BytesIO(data) if data else None)

        for d in ("cudagym", "cudagym/job", "etc", "proc", "sys", "dev", "tmp", "root", "usr", "home"):
            add(d, tarfile.DIRTYPE, 0o755)
        add("etc/passwd", tarfile.REGTYPE, 0o644, b"root:x:0:0:root:/root:/bin/sh\n"
            b"nobody:x:65534:65534:nobody:/nonexistent:/usr/sbin/nologin\n")
        add("etc/group", tarfile.REGTYPE, 0o644, b"root:x:0:\nnogroup:x:65534:\n")
        for top in ("bin", "sbin", "lib", "lib32", "lib64", "libx32"):
            host = Path("/") / top
            if host.is_symlink():  # merged /usr: the link is part of the image, its target is mounted
                add(top, tarfile.SYMTYPE, 0o777, link=os.readlink(host))
            elif host.is_dir():
                add(top, tarfile.DIRTYPE, 0o755)
    return buf.getvalue()


def build_image(source: ImageSource = "host", tag: str = DEFAULT_TAG, client: Any = None) -> str:
    """Build the sandbox image from `source`; returns its id."""
    client = client or docker_client()
    if source == "host":
        repository, _, version = tag.partition(":")
        out = client.api.import_image_from_data(_skeleton(), repository=repository, tag=version or "latest",
                                                changes=[f"LABEL {ROOTFS_LABEL}=host"])
        del out
        return str(client.images.get(tag).id)
    image, _logs = client.images.build(fileobj=io.BytesIO(dockerfile_context()), custom_context=True,
                                       tag=tag, rm=True)
    return str(image.id)


def run_requirements() -> list[str]:
    """The installed cudagym's own run-time requirements, torch left out (the base image has its build)."""
    from importlib.metadata import PackageNotFoundError, requires

    try:
        reqs = requires("cudagym") or []
    except PackageNotFoundError as e:
        raise RuntimeError("cudagym is not installed (pip install -e . or a wheel): "
                           "its requirements are unknown") from e
    return [r for r in reqs if "extra ==" not in r and not r.split(";")[0].strip().startswith("torch")]


def dockerfile_context() -> bytes:
    """The `dockerfile` image's build context as a tar archive: the Dockerfile, the package, requirements.txt."""
    import cudagym

    package = Path(cudagym.__file__).resolve().parent
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        tar.add(DOCKERFILE, arcname="Dockerfile")
        tar.add(package, arcname="cudagym",
                filter=lambda info: None if "__pycache__" in info.name or info.name.endswith((".so", ".o")) else info)
        req = ("\n".join(run_requirements()) + "\n").encode()
        info = tarfile.TarInfo("requirements.txt")
        info.size, info.mode = len(req), 0o644
        tar.addfile(info, io.BytesIO(req))
    return buf.getvalue()
