"""On-disk cache of baseline timings (eager, torch.compile and library baselines) and roofline inputs.

Keyed by (task code digest, device model, torch version, timing settings, the baselines measured
and protocol version):
an episode pays for the first `torch.compile` of a reference once per task and device, not once
per profile.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from pathlib import Path
from typing import Any

import torch

from cudagym.sandbox.protocol import TimingConfig
from cudagym.sandbox.timing import PROTOCOL_VERSION


class BaselineCache:
    def __init__(self, root: Path):
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)

    @staticmethod
    def key(task_digest: str, device_name: str, timing: TimingConfig, with_compile: bool,
            library: tuple[str, ...] = ()) -> str:
        blob = json.dumps([task_digest, device_name, torch.__version__, timing.model_dump(), with_compile,
                           PROTOCOL_VERSION, *([list(library)] if library else [])], sort_keys=True)
        return hashlib.sha256(blob.encode()).hexdigest()[:24]

    def get(self, key: str) -> dict[str, Any] | None:
        path = self.root / f"{key}.json"
        try:
            return json.loads(path.read_text())
        except (OSError, ValueError):
            return None

    def put(self, key: str, value: dict[str, Any]) -> None:
        fd, tmp = tempfile.mkstemp(dir=self.root, suffix=".tmp")
        with os.fdopen(fd, "w") as f:
            json.dump(value, f)
        os.replace(tmp, self.root / f"{key}.json")
