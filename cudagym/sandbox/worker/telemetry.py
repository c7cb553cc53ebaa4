"""What a job reports about itself besides its results: the device's state before and after a
profile (`DeviceTelemetry`, NVML) and the seconds of each of its phases (`Phases`).

Diagnostics only: no verdict is decided from them. Without torch (the state object holds a
`DeviceTelemetry` from the worker's start).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any


class DeviceTelemetry:
    """NVML readings of the worker's GPU; NVML is opened once (in the spare, before any job)."""

    def __init__(self) -> None:
        self._nvml: tuple[Any, Any] | None = None  # (pynvml, handle) once initialized

    def handle(self) -> Any | None:
        """The GPU's NVML handle, opening NVML on the first call; None where it is not available."""
        if self._nvml is None:
            try:
                import pynvml

                pynvml.nvmlInit()
                idx = int(os.environ.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0] or 0)
                self._nvml = (pynvml, pynvml.nvmlDeviceGetHandleByIndex(idx))
            except Exception:  # noqa: BLE001 - telemetry is best effort
                return None
        return self._nvml[1]

    def read(self) -> dict[str, Any]:
        """The GPU's name, clocks, temperature, utilization, power and throttle reasons now."""
        h = self.handle()
        if h is None or self._nvml is None:
            return {"error": "NVML is not available"}
        try:
            pynvml = self._nvml[0]
            util = pynvml.nvmlDeviceGetUtilizationRates(h)
            return {
                "gpu_name": pynvml.nvmlDeviceGetName(h),
                "sm_clock_mhz": pynvml.nvmlDeviceGetClockInfo(h, pynvml.NVML_CLOCK_SM),
                "mem_clock_mhz": pynvml.nvmlDeviceGetClockInfo(h, pynvml.NVML_CLOCK_MEM),
                "temperature_c": pynvml.nvmlDeviceGetTemperature(h, pynvml.NVML_TEMPERATURE_GPU),
                "utilization_pct": util.gpu,
                "power_w": pynvml.nvmlDeviceGetPowerUsage(h) / 1000.0,
                "throttle_reasons": int(pynvml.nvmlDeviceGetCurrentClocksThrottleReasons(h)),
            }
        except Exception as e:  # noqa: BLE001 - telemetry is best effort
            return {"error": str(e)[:200]}


class Phases:
    """Seconds per phase of a job, sent with the result (diagnostics: where a check's time goes).
    `clock`: the harness's own `time.perf_counter`, as bound before candidate code ran."""

    def __init__(self, clock: Callable[[], float]) -> None:
        self._clock = clock
        self._t = self._clock()
        self.times: dict[str, float] = {}
        self.extra: dict[str, Any] = {}  # other diagnostics (not used for any verdict)

    def mark(self, name: str) -> None:
        now = self._clock()
        self.times[name] = self.times.get(name, 0.0) + now - self._t
        self._t = now
