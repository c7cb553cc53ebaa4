"""The sandbox backends' settings: one model per backend over a shared spare-worker base.

`SandboxConfig` is the discriminated union the evaluator holds (`backend: "local" | "docker"`);
each setting is declared once here, with its default and its description (the command line's
options read both from the fields, `cudagym.options`); `cudagym.sandbox.backends.open_sandbox`
starts the backend a config describes. The models import no backend, so a config can be built and
validated without importing one.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import BaseModel, Field

SPARES_PER_GPU = 6
SPARES_ON_CPU = 2


class SpareWorkerConfig(BaseModel):
    """What every spare-worker backend (`cudagym.sandbox.schedule.SpareWorkerSandbox`) reads.

    A step makes up to four jobs back to back (verify + reference, baseline, profile); each job
    consumes a spare. A local forked spare is ready in about 2 s on an H100 host (5 s when 16
    start at once), a spawned one in 13-16 s."""

    spare_workers: int | None = Field(
        default=None, ge=0,
        description=f"Warm worker processes kept per device (default {SPARES_PER_GPU} per GPU, {SPARES_ON_CPU} on "
                    "the CPU). Each check takes one; with many episodes at once, more spares keep checks from waiting "
                    "for workers to start, at the cost of a CUDA context and host memory for each.")
    start_timeout_s: float = 600.0  # a worker must be ready (torch imported) within this
    max_result_mb: int = 16384  # capacity of a worker's result memory (outputs of all trials; sparse)
    freeze_starting_spares: bool = True  # pause spares still starting while a timing job runs
    # a job's GPU lease ends when its result is in and its worker is killed, not once the worker
    # (and its CUDA context) is gone. Off by default: only a worker that is gone cannot have work
    # still running on the GPU when the next job is timed (docs/timing.md)
    release_gpu_at_result: bool = False
    # when a GPU timing job holds the GPU alone: "loop" (the default: for its timer's calibration,
    # before the candidate loads, and for its timed loops; it builds the problem, loads the
    # candidate and runs its end checks and its worker's exit under a shared lease, beside checks,
    # within its GPU's timing turn, which it keeps until its worker is gone, so that no other
    # timing job calibrates or times while its candidate is loaded: `cudagym.sandbox.schedule.JobLease`)
    # or "job" (the whole job, from its ready worker to the worker's exit)
    exclusive_from: Literal["job", "loop"] = "loop"
    # a GPU timer calibration measured by a timing job before its candidate loaded is given to the
    # later timing jobs on the same GPU for this long (seconds), so that they do not measure it
    # again under the lease; 0 (the default): each job measures its own. Off because on an H100 a
    # calibration handed over read the later jobs' small kernels 0.6-0.8 us slower (a 3 us GELU
    # 4.0-4.5 us against 2.9-3.4, layernorm 130.5 against 129.8 us): the timer's read phase and
    # overhead are the process's own, and its own calibration is what keeps them out
    calibration_max_age_s: float = Field(default=0.0, ge=0.0)

    def spares_for(self, device: str) -> int:
        """How many spares `device` ("cpu", "cuda" or "cuda:N") keeps."""
        if self.spare_workers is not None:
            return self.spare_workers
        return SPARES_PER_GPU if device.startswith("cuda") else SPARES_ON_CPU


class LocalSandboxConfig(SpareWorkerConfig):
    """Worker processes on this host (`cudagym.sandbox.local.LocalSandbox`)."""

    backend: Literal["local"] = "local"
    python: str = sys.executable
    isolate: bool = True  # namespaces + cgroups where available (Landlock is always applied)
    watchdog_interval_s: float = 0.05
    spare_nice: int = 10  # CPU niceness of spares until they take a job (0: off)
    premap_result_mb: int | None = None  # result memory a spare populates (and page-locks) ahead;
    # None: 512 MB per GPU worker (six trials of 64 MB outputs fit), 0 on the CPU
    fork_server: bool = True  # fork workers from a warm server per device (False: spawn each one)
    # A timing job (profile, baseline) on a GPU that another process uses (NVML: a compute or
    # graphics process that is not ours, or SM utilization of one): "refuse" waits up to
    # device_busy_wait_s for it to leave, then fails the job with `device_busy`, and fails a job
    # beside which one appeared; "report" times anyway and says what it saw (host_load's
    # "gpu_foreign"); "allow" does not look (GPUs shared on purpose: MIG, MPS).
    gpu_sharing: Literal["refuse", "report", "allow"] = "refuse"
    # CPU target: sample where verify's and the profile's workers spend their time, every this
    # many µs of CPU time on average, out of the candidate's reach (`cudagym.sandbox.cpusamples`;
    # strict mode refuses torch's compute found there); 0: off. The profile's period is
    # `cpu_sample_timed_us`: its timed loop makes many calls, and each sample costs its times a
    # little (`benchmarks/bench_cpu_sampling.py`)
    cpu_sample_us: float = Field(default=250.0, ge=0.0)
    cpu_sample_timed_us: float = Field(default=1000.0, gt=0.0)
    device_busy_wait_s: float = 30.0
    gpu_sharing_allow: tuple[str, ...] = ()  # process names that count as ours (e.g. "nvidia-cuda-mps-server")



class DockerSandboxConfig(SpareWorkerConfig):
    """A container per worker (`cudagym.sandbox.docker.DockerSandbox`)."""

    backend: Literal["docker"] = "docker"
    image: str = Field(default="cudagym-sandbox:host",
                       description="Image name: the docker backend's workers run this image (`cudagym sandbox "
                                   "image build` makes it).")
    user: str | None = None  # uid:gid in the container; None: nobody when the parent is root, else the parent's
    python: str | None = None  # None: this interpreter with a host-rootfs image, else `python3`
    tmp_mb: int = 64  # size of the container's private /tmp (root's: the candidate cannot write it)
    # The containers' hard file-size limit: the largest any job may be given (a baseline job's
    # torch.compile writes 4096 MB at most). Each job lowers it to its own; without
    # CAP_SYS_RESOURCE no process in the container can raise a hard limit again.
    max_file_mb_ceiling: int = 4096
    base_pids: int = 64  # processes + threads of a worker at rest where the pids cgroup cannot be read
    runtime_dir: Path = Path("/dev/shm")  # where job directories are made (memory: result bytes are mapped)
    docker_url: str | None = None  # None: the environment's (DOCKER_HOST or the local socket)
    # The containers' parent cgroup. None: "/" under the daemon's cgroupfs driver, so that each
    # container competes for the CPU as one process, like a local worker, rather than all
    # containers sharing the one weight of docker's default `/docker` group (on a busy host that
    # group gets one task's share: `import torch` in a container took 42 s against 9 s on the
    # host, on two cores with twelve runnable tasks); the daemon's default under systemd.
    cgroup_parent: str | None = None



# The backend a config is for, by its `backend` field ("local" or "docker")
SandboxConfig = Annotated[LocalSandboxConfig | DockerSandboxConfig, Field(discriminator="backend")]


def reject_moved(data: dict[str, Any], moved: dict[str, str], model: str) -> None:
    """A config (a saved file, keyword arguments) that sets a field since moved into a nested
    model: ValueError naming the field and where it lives now (pydantic would drop it silently)."""
    old = [k for k in moved if k in data]
    if old:
        raise ValueError("; ".join(f"{model}.{k} is now {model}.{moved[k]}" for k in old))
