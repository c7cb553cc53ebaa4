"""What a wheel install needs at run time is inside the package and declared (issue 29, packaging)."""

from __future__ import annotations

import io
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

import pytest

import cudagym
from cudagym.agent.scripted import default_solutions_root
from cudagym.sandbox.image import dockerfile_context, run_requirements

from conftest import REPO

PACKAGE = Path(cudagym.__file__).resolve().parent


def test_scripted_solutions_ship_inside_the_package(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("CUDAGYM_SOLUTIONS", raising=False)
    root = default_solutions_root()
    assert root.is_relative_to(PACKAGE)
    assert (root / "ew_scale_bias_gelu" / "cpu" / "model_new.py").is_file()


def test_dockerfile_context_is_made_from_the_installed_package() -> None:
    with tarfile.open(fileobj=io.BytesIO(dockerfile_context())) as tar:
        names = set(tar.getnames())
        requirements = tar.extractfile("requirements.txt").read().decode().splitlines()  # type: ignore[union-attr]
        dockerfile = tar.extractfile("Dockerfile").read().decode()  # type: ignore[union-attr]
    assert {"Dockerfile", "requirements.txt", "cudagym/__init__.py", "cudagym/sandbox/opwatch.cpp"} <= names
    assert not any("__pycache__" in n or n.endswith(".so") for n in names)
    # torch comes from the base image, extras stay out; every other run-time dependency is named
    assert not any(r.startswith("torch") for r in requirements)
    assert any(r.startswith("pydantic") for r in requirements) and not any("extra" in r for r in requirements)
    assert requirements == run_requirements()
    for line in dockerfile.splitlines():
        if line.startswith("COPY "):
            assert line.split()[1] in names, line  # nothing copied from outside the context


@pytest.mark.slow
def test_wheel_carries_the_package_data(tmp_path: Path) -> None:
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
                    "-w", str(tmp_path), str(REPO)], check=True, capture_output=True)
    (wheel,) = tmp_path.glob("cudagym-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    needed = {"cudagym/sandbox/opwatch.cpp", "cudagym/sandbox/Dockerfile", "cudagym/tasks/bundled/manifest.json",
              "cudagym/examples/solutions/ew_scale_bias_gelu/cpu/model_new.py",
              "cudagym/train/configs/cudagym_grpo.yaml"}
    assert needed <= names, needed - names
    # every file the package reads at run time from its own tree is in the wheel
    for path in PACKAGE.rglob("*"):
        if path.is_file() and "__pycache__" not in path.parts and path.suffix not in (".so", ".o", ".pyc"):
            assert f"cudagym/{path.relative_to(PACKAGE)}" in names, path
