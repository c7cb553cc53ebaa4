"""The docker sandbox backend on a real daemon: the job protocol and what a container isolates.

The evaluator-level checks (crashes, hangs, memory, fork bombs, writes outside the workspace,
network, every CPU reward hack) run on this backend too: `tests/test_sandbox_robustness.py` and
`tests/test_reward_hacking.py` parametrize their evaluators over both backends.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from cudagym.sandbox.protocol import LimitsConfig
from cudagym.sandbox.worker.wire import Job

from conftest import REPO, require_docker

pytestmark = pytest.mark.docker


def probe(source: str, timeout_s: float = 120.0) -> Job:
    return Job(kind="probe", nonce=uuid.uuid4().hex, task_id="docker", probe=source,
               limits=LimitsConfig(timeout_s=timeout_s))


@pytest.fixture(scope="module")
def sandbox(tmp_path_factory: pytest.TempPathFactory):
    require_docker()
    from cudagym.sandbox.config import DockerSandboxConfig
    from cudagym.sandbox.docker import DockerSandbox

    sb = DockerSandbox(DockerSandboxConfig(spare_workers=1), home=tmp_path_factory.mktemp("home"))
    try:
        yield sb
    finally:
        sb.close()


@pytest.mark.timeout(600)
def test_results_exit_codes_and_timeouts(sandbox) -> None:
    answered = sandbox.run_sync(probe("RESULT = 6 * 7"), "cpu")
    exited = sandbox.run_sync(probe("import os; os._exit(3)"), "cpu")
    crashed = sandbox.run_sync(probe("import ctypes; ctypes.string_at(0)"), "cpu")
    hung = sandbox.run_sync(probe("import time; time.sleep(600)", timeout_s=2.0), "cpu")
    assert answered.final is not None and answered.final["result"] == "42", answered.output
    assert exited.final is None and exited.returncode == 3
    assert crashed.final is None and crashed.returncode == -signal.SIGSEGV, crashed.output
    assert hung.timed_out and hung.final is None and hung.returncode == -signal.SIGKILL


ISOLATION_PROBE = """\
import errno, os, socket
def attempt(f):
    try:
        f()
        return "allowed"
    except OSError as e:
        return errno.errorcode.get(e.errno, str(e.errno))
caps = [l.split()[1] for l in open("/proc/self/status") if l.startswith("CapEff:")][0]
RESULT = {
    "uid": os.getuid(),
    "caps": int(caps, 16),
    "write_root": attempt(lambda: open("/escape", "w")),
    "write_usr": attempt(lambda: open("/usr/escape", "w")),
    "write_tmp": attempt(lambda: open("/tmp/escape", "w")),
    "connect": attempt(lambda: socket.create_connection(("1.1.1.1", 80), timeout=3)),
    "interfaces": sorted(name for _, name in socket.if_nameindex()),
    "chown": attempt(lambda: os.chown("/cudagym/job/tmp", 0, 0)),
}
"""


@pytest.mark.timeout(600)
def test_container_isolation(sandbox) -> None:
    """Non-root, no capabilities, read-only root and system directories, a /tmp it cannot
    write, no network but a loopback."""
    o = sandbox.run_sync(probe(ISOLATION_PROBE), "cpu")
    assert o.final is not None and o.final.get("ok"), (o.final, o.output)
    seen = eval(o.final["result"])  # noqa: S307 - a dict of plain values, repr'd by the harness
    assert seen["uid"] != 0 and seen["caps"] == 0, seen
    assert seen["write_root"] in ("EROFS", "EACCES") and seen["write_usr"] in ("EROFS", "EACCES"), seen
    assert seen["write_tmp"] == "EACCES", seen
    assert seen["connect"] == "ENETUNREACH" and seen["interfaces"] == ["lo"], seen
    assert seen["chown"] == "EPERM", seen
    assert sandbox.isolation["non_root_user"] and sandbox.isolation["read_only_root"]


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_check_command_on_the_docker_backend(tmp_path: Path) -> None:
    """`cudagym check --sandbox docker`: an honest solution is compiled, verified and timed in containers."""
    require_docker()
    task = "ew_scale_bias_gelu"
    r = subprocess.run([sys.executable, "-m", "cudagym", "check", task,
                        str(REPO / "examples" / "solutions" / task / "cpu"),
                        "--json", "--target", "cpu", "--sandbox", "docker", "--no-compile-baseline",
                        "--cache-dir", str(tmp_path / "cache")],
                       capture_output=True, text=True, timeout=800, cwd=REPO,
                       env={**os.environ, "PYTHONPATH": str(REPO)})
    assert r.returncode == 0, (r.stdout[-3000:], r.stderr[-3000:])
    verdict = json.loads(r.stdout.strip().splitlines()[-1])
    assert verdict["reward"] >= 1 and verdict["correct"], verdict
    assert verdict["eager_ms"] and verdict["candidate_ms"] and verdict["speedup_vs_eager"], verdict  # timed


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_load_inline_extension_built_and_run_in_containers(eval_cache: Path, build_ws) -> None:
    """The extension jobs: `compile_inline` runs the solution to see what it builds, `build_inline`
    builds it in a writable staging directory copied back to the parent, and verify and profile
    load the pre-built module (strict mode: a reward means the extension itself ran)."""
    from cudagym.rewards.evaluator import Evaluator
    from test_inline_build import BUILT_IN_INIT, EXT_CPP, TASK, unique

    from conftest import backend_config

    name = unique("ext")
    with Evaluator(backend_config("docker", eval_cache)) as ev:
        ws = build_ws(TASK, BUILT_IN_INIT.format(cpp=EXT_CPP, name=name))
        c = ev.compile(TASK, ws)
        assert c.ok and c.inline_modules == [name], c.errors
        v = ev.evaluate(TASK, ws)
    assert v.reward >= 1 and v.audit is not None and v.audit.passed, v.summary()


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_load_inline_manifest_names_the_workspace_files_a_container_build_read(eval_cache: Path, build_ws) -> None:
    """A build in a container reads the workspace's copy at the container's path; its manifest
    names those files where the evaluator can hash them, so the same call with another included
    file builds again (a variant is never reused whatever that file holds)."""
    from cudagym.rewards.evaluator import Evaluator
    from test_inline_build import check_included_file_gets_its_own_module

    from conftest import backend_config

    with Evaluator(backend_config("docker", eval_cache)) as ev:
        check_included_file_gets_its_own_module(ev, build_ws)
