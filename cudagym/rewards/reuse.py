"""No timing job twice for the same evidence: a submit reuses the timing of a profile of the same
episode that measured the same thing.

What a profile's timing depends on is its *evidence key* (`evidence_key`): the build it timed
(the content-addressed artifact's name), the solution's source files (their digest, taken before
any job of the profile ran the candidate's code), the task (the reference and its inputs, its dtype,
its tolerance), the device (its model), and every setting of the evaluator that decides a profile
(mode, timing protocol, verify settings, baselines, server mode, roofline slack, sandbox; all but
the reward's values, which are applied afterwards, and the cache's place), plus the timer's
protocol version, cudagym's and torch's. A submit whose own key equals that of an accepted
profile of its episode takes that profile's timing instead of running the timing job again, and
the verdict says so (`ProfileResult.reused`, its reason, `Verdict.timing_reused`); any change to
any of those runs it again. Verify always runs again: submit's correctness is judged afresh.

Why reuse gains a candidate nothing it could not gain in one run:

- The result reused is one timing job's, on this very build, under this very protocol, that
  passed every check a submit's own timing job must pass (`checks.PROFILE_CHECKS`: the re-checked
  outputs of timed calls, the audit of their ops and kernels, the parent's clock). So every
  verdict reached through reuse is one a single run of the submit's own job could have produced.
  The checks that depend on the submit's verify (permissive mode's foreign work per call against
  verify's trials, `Audit.timed_calls`) are applied again to the reused job's reported ops with
  the submit's verify, and its parameters path must be the one the submit's verify chose.
- A candidate that behaves differently across runs cannot choose which run is reused. The
  episode keeps the *first* accepted profile of each evidence key: profiling the same build again
  does not replace it, so re-rolling the timing of one build buys nothing.
- A candidate that escapes the timed-call checks only sometimes (say, wrong in a few calls that
  the re-checks miss with some probability) cannot be profiled until it escapes once and then
  submitted on that run: the first profile of an episode that the checks refused for its
  candidate's behaviour (anything but a harness failure, `INTERNAL` or `DEVICE_BUSY`) ends reuse
  for the rest of the episode (`ProfileMemo.closed`), so the submit runs its own timing job and
  the escape must happen there, as without reuse. Its chance to escape is that of one run.
- Left: an agent can still time textual variants of one solution (a comment changes the key)
  and submit the one that read fastest. What it selects among is the spread of honest medians
  across separate jobs, which the protocol holds under its targets (CV < 1% from 50 us, < 3%
  below; docs/timing.md): a few percent at most, against the milestones' 5% margins, and each
  variant passed every check. `EvaluatorConfig.reuse_profiles=False` turns reuse off.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field

from cudagym.core.verdict import ErrorKind, ProfileResult

REUSE_FORMAT = "1"  # bump when what a key covers changes
REUSED = "timing reused: "  # how the reason that names a reused timing begins

# refusals that say nothing about the candidate: a harness failure, another process on the GPU,
# a build that failed before any job ran
NOT_THE_CANDIDATES = frozenset({ErrorKind.INTERNAL, ErrorKind.DEVICE_BUSY, ErrorKind.COMPILE})


def evidence_key(*, build: str | None, files: str, task: str, device: str, settings: str, protocol: str) -> str:
    """The key of what a profile's timing measured (see the module's text): `build` the
    artifact's content-addressed name (None: no kernels/ build), `files` the source digest,
    `task` the task (serialized), `device` the device's model, `settings` the evaluator's settings
    that decide a profile (serialized), `protocol` the timer's protocol and the versions."""
    h = hashlib.sha256()
    for part in (REUSE_FORMAT, build or "-", files, task, device, settings, protocol):
        h.update(part.encode())
        h.update(b"\0")
    return h.hexdigest()


@dataclass
class ProfileMemo:
    """The profiles of one episode that its submit may reuse: the first accepted profile of each
    evidence key, until a profile refused for its candidate's behaviour closes reuse (see the
    module's text). The episode keeps it (`cudagym.env.tools.ToolContext`) and passes it to the
    submit (`Evaluator.aevaluate`); the evaluator decides whether one applies."""

    accepted: dict[str, ProfileResult] = field(default_factory=dict)
    closed: str | None = None  # why reuse is over for this episode

    def record(self, result: ProfileResult) -> None:
        """Keep a profile's result: accepted and keyed, the first of its key; refused for the
        candidate's behaviour, the end of reuse."""
        if result.ok and result.evidence and not result.reused:
            self.accepted.setdefault(result.evidence, result)
        elif not result.ok and result.error_kind is not None and result.error_kind not in NOT_THE_CANDIDATES \
                and self.closed is None:
            self.closed = f"a profile of this episode was refused ({result.error_kind.value})"

    def lookup(self, evidence: str) -> ProfileResult | None:
        """The accepted profile of `evidence`, unless reuse is closed."""
        return None if self.closed else self.accepted.get(evidence)
