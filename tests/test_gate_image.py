"""The timer's gate kernels compiled once, by the sandbox's parent, and loaded by each worker
(`cudagym.sandbox.timing.gate`): the image the parent stores is the one a worker of that GPU
looks for, a job cannot replace it, and (GPU) a worker loads it without compiling."""

from __future__ import annotations

import hashlib
import stat
from pathlib import Path

import pytest

from cudagym.rewards.evaluator import Evaluator
from cudagym.sandbox.timing import gate
from cudagym.tasks.model import Target

from conftest import make_workspace, task_of

TASK = task_of("ew_scale_bias_gelu").for_target(Target.CPU)


@pytest.mark.parametrize("capability,threads_per_sm", [((9, 0), 2048), ((8, 0), 2048), ((8, 9), 1536),
                                                       ((8, 6), 1536), ((7, 5), 1024), ((10, 0), 2048)])
def test_the_parent_names_the_image_a_worker_of_that_gpu_looks_for(capability: tuple[int, int],
                                                                   threads_per_sm: int) -> None:
    """The parent knows a GPU's compute capability (NVML), a worker its resident threads per SM
    (its CUDA context): both arrive at the same source, so at the same name."""
    parent = gate.blocks_per_sm(gate.THREADS_PER_SM.get(capability, 2048))
    worker = gate.blocks_per_sm(threads_per_sm)
    assert gate.gate_image_name(capability, parent, "13.0") == gate.gate_image_name(capability, worker, "13.0")


def test_the_image_name_changes_with_whatever_compiles_it_differently() -> None:
    name = gate.gate_image_name((9, 0), 8, "13.0")
    assert name == gate.gate_image_name((9, 0), 8, "13.0")
    assert len({name, gate.gate_image_name((9, 0), 6, "13.0"), gate.gate_image_name((10, 0), 8, "13.0"),
                gate.gate_image_name((9, 0), 8, "12.8")}) == 4


ATTACK = """\
import os
import torch
import torch.nn as nn
from pathlib import Path

ROOT = Path(os.environ["CUDAGYM_OPWATCH_DIR"]) / "gate"
TRIED = []
for what, act in [
    ("overwrite", lambda p: p.write_bytes(b"forged")),
    ("chmod", lambda p: os.chmod(p, 0o666)),  # its owner's uid may (Landlock does not cover modes)
    ("overwrite after chmod", lambda p: p.write_bytes(b"forged")),
    ("truncate", lambda p: os.truncate(p, 0)),
    ("unlink", lambda p: p.unlink()),
    ("create", lambda p: (ROOT / "forged.cubin").write_bytes(b"forged")),
]:
    for image in sorted(ROOT.glob("gate-*-test.cubin")):
        try:
            act(image)
        except PermissionError as e:
            TRIED.append(what)
        else:
            if what != "chmod":
                raise SystemExit(f"{what} of {image.name} succeeded")
Path("tried.txt").write_text("\\n".join(TRIED))


class ModelNew(nn.Module):
    def __init__(self, features, scale):
        super().__init__()
        self.bias = nn.Parameter(torch.randn(features) * 0.1)
        self.scale = scale

    def forward(self, x):
        return torch.nn.functional.gelu(x * self.scale + self.bias)
"""


def test_a_job_cannot_replace_or_add_a_gate_image(evaluator: Evaluator, tmp_path: Path) -> None:
    """A stored image (as the parent writes it: read-only, in the harness's build directory) is
    the same bytes after a candidate's code, run by a verify job, tried to overwrite, truncate and
    unlink it (also after making it writable, which a worker that keeps the owner's uid may) and
    to plant another beside it: each attempt was refused (PermissionError, Landlock)."""
    root = Path(evaluator.sandbox.opwatch_dir) / gate.GATE_IMAGE_DIR  # type: ignore[attr-defined]
    root.mkdir(parents=True, exist_ok=True)
    image = root / gate.gate_image_name((9, 0), 8, "0.0").replace(".cubin", "-test.cubin")
    try:
        image.write_bytes(b"\x7fELF the parent's image")
        image.chmod(0o444)
        before = hashlib.sha256(image.read_bytes()).hexdigest()
        ws = make_workspace(tmp_path / "ws", TASK, ATTACK)
        v = evaluator.verify(TASK, ws)
        assert "succeeded" not in (v.error or ""), v.error
        tried = (ws.root / "tried.txt").read_text().splitlines()
        assert [t for t in tried if t != "chmod"] == ["overwrite", "overwrite after chmod", "truncate", "unlink",
                                                      "create"], (tried, v.error)
        assert hashlib.sha256(image.read_bytes()).hexdigest() == before
        assert not (root / "forged.cubin").exists()
    finally:
        image.chmod(0o644)
        image.unlink(missing_ok=True)


@pytest.mark.gpu
def test_a_worker_loads_the_parents_image_without_compiling(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The parent's images for the visible GPUs (NVML, no CUDA context); with them, the gate
    kernels load with NVRTC's compile refused; without them, that compile is what loads them."""
    import torch

    from cudagym.sandbox.gpu import gpu_capabilities

    paths = gate.store_gate_images(tmp_path, gpu_capabilities())
    assert paths and all(p.is_file() and stat.S_IMODE(p.stat().st_mode) == 0o444 for p in paths)
    monkeypatch.setenv("CUDAGYM_OPWATCH_DIR", str(tmp_path))

    def refused(*_: object) -> bytes:
        raise AssertionError("compiled, though the parent's image was there")

    monkeypatch.setattr(gate, "compile_gate", refused)
    loaded = gate.gate_kernels.__wrapped__(torch.cuda.current_device())
    assert loaded.blocks > 0
    monkeypatch.setenv("CUDAGYM_OPWATCH_DIR", str(tmp_path / "none"))
    with pytest.raises(AssertionError, match="compiled"):
        gate.gate_kernels.__wrapped__(torch.cuda.current_device())
