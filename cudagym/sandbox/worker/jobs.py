"""The job kinds a worker runs, by the name a `Job` carries (`JOBS`), and the modules whose code
the integrity snapshot covers (`HARNESS_MODULES`: importing this module imports them all).

Every job function takes the job, the channel to the parent and the worker's state, and ends with
one final frame (`Channel.final`); a failure of the candidate's is raised as `CandidateError`.
"""

from __future__ import annotations

import sys
from collections.abc import Callable

from cudagym.sandbox.worker import build, dtypes, failures, integrity, problem, state, telemetry, timed, verify, wire
from cudagym.sandbox.worker.state import WorkerState
from cudagym.sandbox.worker.wire import Channel, Job

JobFn = Callable[[Job, Channel, WorkerState], None]

JOBS: dict[str, JobFn] = {
    "verify": verify.run_verify, "reference": verify.run_reference_outputs,
    "profile": timed.run_profile, "baseline": timed.run_baseline, "ncu": timed.run_ncu,
    "compile_inline": build.run_compile_inline, "build_inline": build.run_build_inline, "probe": build.run_probe,
}

# the harness's modules: every callable they name, and their own functions, are snapshot before
# any candidate code runs (`integrity.take_snapshot`)
HARNESS_MODULES = (wire, dtypes, failures, state, telemetry, integrity, problem, verify, timed, build,
                   sys.modules[__name__])
