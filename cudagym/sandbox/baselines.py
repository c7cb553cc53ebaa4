"""On-disk cache of baseline timings (eager, torch.compile and library baselines) and roofline inputs.

Keyed by (task code digest, device model, torch version, timing settings, the baselines measured
and protocol version): an episode pays for the first `torch.compile` of a reference once per
task and device, not once per profile.

A baseline is cached for every later episode, so a disturbed one is never cached
(`BaselineGuard`, `measure_guarded`). A measurement is refused and measured again, at most
`attempts` times in all, when its calls spread more than `max_spread` (interquartile range over
median), when the sandbox's own account of its timed loops (`JobOutcome.host_load`, the local
sandbox's quiet windows) says other work used more than `max_other_cores` cores meanwhile, or when
the host's run queue, sampled by a thread of the parent during the loops (`HostLoad`: runnable
threads, from /proc/stat; a backend without that account still has this), held more than
`max_excess_load` runnable threads per core beyond the cores. When every attempt was disturbed, the
least disturbed (the lowest eager median) is used for the profile that asked, uncached, and says so
(`disturbed`, `notes`). Another process's load cannot make a later episode's baseline: at worst it
costs this profile a re-measure.
"""

from __future__ import annotations

import hashlib
import json
import os
import statistics
import tempfile
import threading
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import torch
from pydantic import BaseModel, Field

from cudagym.sandbox.protocol import TimingConfig
from cudagym.sandbox.timing import PROTOCOL_VERSION

ROLES = ("eager_ms", "compile_ms")


class BaselineGuard(BaseModel):
    """When a measured baseline counts as disturbed: not cached, measured again."""

    max_spread: float = Field(default=0.5, gt=0)  # (p75 - p25) / median of a role's timed calls
    max_excess_load: float = Field(default=1.5, ge=0)  # runnable threads beyond the cores, per core
    max_other_cores: float = Field(default=0.5, ge=0)  # other work's cores in the loops (JobOutcome.host_load)
    attempts: int = Field(default=2, ge=1)  # measurements at most, the first included
    sample_interval_s: float = Field(default=0.02, gt=0)


class HostLoad:
    """The host's run queue (runnable threads, /proc/stat's `procs_running`), sampled by a thread
    on `time.perf_counter()`'s clock, the clock of the parent's call records."""

    def __init__(self, interval_s: float = 0.02) -> None:
        self.interval_s = interval_s
        self.samples: list[tuple[float, int]] = []
        self.cores = os.cpu_count() or 1
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @staticmethod
    def run_queue() -> int | None:
        try:
            with open("/proc/stat", "rb") as fh:
                for line in fh:
                    if line.startswith(b"procs_running "):
                        return int(line.split()[1])
        except (OSError, ValueError):
            pass
        return None

    def __enter__(self) -> HostLoad:
        self._thread = threading.Thread(target=self._run, name="cudagym-host-load", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()

    def _run(self) -> None:
        while not self._stop.is_set():
            n = self.run_queue()
            if n is None:  # no /proc/stat: the one-minute load average instead
                n = round(os.getloadavg()[0])
            self.samples.append((time.perf_counter(), n))
            self._stop.wait(self.interval_s)

    def excess_per_core(self, windows: list[tuple[float, float]] | None = None) -> float | None:
        """Mean runnable threads beyond the cores, per core, over the samples inside `windows`
        (all samples without windows); None without samples there."""
        inside = [n for t, n in self.samples if windows is None or any(a <= t <= b for a, b in windows)]
        if not inside:
            return None
        return max(0.0, statistics.fmean(inside) - self.cores) / self.cores


def spread(times_ms: list[float] | None) -> float | None:
    """(p75 - p25) / median of a role's call times; None with fewer than 4 calls."""
    if not times_ms or len(times_ms) < 4:
        return None
    q1, med, q3 = statistics.quantiles(times_ms, n=4)
    return (q3 - q1) / med if med > 0 else None


def disturbance(value: dict[str, Any], load: float | None, guard: BaselineGuard) -> list[str]:
    """Why a baseline measurement is too disturbed to cache (empty: it is not)."""
    why = []
    other = (value.get("host_load") or {}).get("other_cores")
    if isinstance(other, (int, float)) and other > guard.max_other_cores:
        why.append(f"other work used {other:.2f} cores of the host during the timed loops (allowed "
                   f"{guard.max_other_cores:g})")
    if load is not None and load > guard.max_excess_load:
        why.append(f"the host ran {load:.1f} runnable threads per core beyond its cores during the timed loops "
                   f"(allowed {guard.max_excess_load:g})")
    for role in ROLES:
        s = spread(value.get(role))
        if s is not None and s > guard.max_spread:
            why.append(f"{role[:-3]} calls spread {s:.0%} (interquartile range over median; allowed "
                       f"{guard.max_spread:.0%})")
    return why


async def measure_guarded(measure: Callable[[], Awaitable[dict[str, Any]]],
                          guard: BaselineGuard) -> dict[str, Any]:
    """`measure()` (one baseline job) until a measurement is not disturbed, at most
    `guard.attempts` times. The value carries ``guard`` (attempts, each refusal's reasons, the
    load) and, when every attempt was disturbed, ``disturbed`` (it must not be cached) and
    ``notes`` for the verdict; the least disturbed attempt (lowest eager median) is returned then."""
    refused: list[list[str]] = []
    tried: list[dict[str, Any]] = []
    for _ in range(guard.attempts):
        with HostLoad(guard.sample_interval_s) as host:
            value = await measure()
        if "error" in value:
            return value
        windows = [tuple(w) for w in value.get("loop_windows_s") or []] or None
        load = host.excess_per_core(windows)
        why = disturbance(value, load, guard)
        info = {"attempts": len(tried) + 1, "excess_load_per_core": load, "refused": refused + ([why] if why else [])}
        value = {**value, "guard": info}
        if not why:
            if refused:
                value["notes"] = [f"baselines measured {len(refused) + 1} times: {len(refused)} disturbed "
                                  f"measurement(s) refused ({refused[0][0]})"]
            return value
        refused.append(why)
        tried.append(value)
    best = min(tried, key=lambda v: statistics.median(v.get("eager_ms") or [float("inf")]))
    best["guard"] = {**best["guard"], "attempts": len(tried), "refused": refused}
    best["disturbed"] = refused[-1][0]
    best["notes"] = [f"baselines disturbed in all {len(tried)} measurements ({refused[-1][0]}): the least disturbed "
                     "is used for this profile and not cached"]
    return best


class BaselineCache:
    def __init__(self, root: Path, guard: BaselineGuard | None = None) -> None:
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        self.guard = guard or BaselineGuard()

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

    async def measure(self, measure: Callable[[], Awaitable[dict[str, Any]]]) -> dict[str, Any]:
        """`measure_guarded` under this cache's guard."""
        return await measure_guarded(measure, self.guard)

    def put(self, key: str, value: dict[str, Any]) -> None:
        """Cache `value`; a disturbed one (`measure_guarded`) is refused: ValueError."""
        if value.get("disturbed"):
            raise ValueError(f"a disturbed baseline is never cached: {value['disturbed']}")
        fd, tmp = tempfile.mkstemp(dir=self.root, suffix=".tmp")
        with os.fdopen(fd, "w") as f:
            json.dump(value, f)
        os.replace(tmp, self.root / f"{key}.json")
