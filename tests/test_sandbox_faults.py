"""A fault costs one job, never the evaluator; a timing job has the cores alone; no privilege.

- A worker that spins (and a process it started in a session of its own) gets a `timeout` and
  leaves no process; a candidate's code that spins while the compile step runs it gets the job's
  limit, not the compiler's.
- SIGTERM or SIGKILL to the evaluator's process mid-job leaves no worker and no fork server.
- A candidate's request for real-time scheduling (SCHED_FIFO/RR, from any thread, through
  Python or pthreads) or a lower niceness fails: the worker has no capability left.
- A noisy neighbour (a job whose processes each run in a session of their own) is frozen during
  another job's timed loops: none of its processes makes progress inside them.
"""

from __future__ import annotations

import asyncio
import errno
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import psutil
import pytest

from cudagym.rewards.evaluator import Evaluator
from cudagym.sandbox.config import LocalSandboxConfig
from cudagym.sandbox.local import LocalSandbox
from cudagym.sandbox.protocol import LimitsConfig
from cudagym.sandbox.worker.wire import Job

from conftest import REPO, cpu_config, require_docker, task_of

GRACE_S = 60.0  # what a killed job may take beyond its limit on a loaded 2-core host (measured: < 1 s)


def probe(source: str, timeout_s: float = 120.0, workspace: str = "") -> Job:
    return Job(kind="probe", nonce=uuid.uuid4().hex, task_id="faults", probe=source, workspace=workspace,
               limits=LimitsConfig(timeout_s=timeout_s))


def marked(mark: str) -> list[psutil.Process]:
    """Live processes whose name (comm) or command line carries `mark`."""
    out = []
    for p in psutil.process_iter(["name", "cmdline", "status"]):
        if p.info["status"] == psutil.STATUS_ZOMBIE:
            continue
        if mark[:15] in (p.info["name"] or "") or any(mark in a for a in p.info["cmdline"] or []):
            out.append(p)
    return out


def gone(pids: list[int], deadline_s: float = 30.0) -> list[int]:
    """The pids still alive (not zombies) after waiting up to `deadline_s` for them to go."""
    end = time.monotonic() + deadline_s
    while True:
        alive = []
        for pid in pids:
            try:
                if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                    alive.append(pid)
            except psutil.Error:
                pass
        if not alive or time.monotonic() > end:
            return alive
        time.sleep(0.1)


def spinner(mark: str) -> str:
    """Probe source: a process in a session of its own and the worker itself spin for ever."""
    return textwrap.dedent(f"""
        import ctypes, subprocess, sys
        subprocess.Popen([sys.executable, "-c", "MARK = {mark!r}\\nwhile True: pass"], start_new_session=True)
        ctypes.CDLL(None).prctl(15, {mark[:15].encode()!r}, 0, 0, 0)  # PR_SET_NAME
        while True:
            pass
        """)


@pytest.fixture(scope="module", params=[True, False], ids=["forked", "spawned"])
def sandbox(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    sb = LocalSandbox(LocalSandboxConfig(spare_workers=1, fork_server=request.param),
                      home=tmp_path_factory.mktemp("home"))
    try:
        yield sb
    finally:
        sb.close()


# -- a spinning worker -------------------------------------------------------------------------
@pytest.mark.timeout(600)
def test_a_spinning_worker_times_out_and_leaves_no_process(sandbox: LocalSandbox) -> None:
    mark = f"cgspin{uuid.uuid4().hex[:8]}"
    out = sandbox.run_sync(probe(spinner(mark), timeout_s=5.0), "cpu")
    assert out.timed_out and out.final is None, out
    assert out.seconds < 5.0 + GRACE_S, out.seconds
    assert marked(mark) == [] or not gone([p.pid for p in marked(mark)]), \
        f"left running: {[(p.pid, p.info['cmdline']) for p in marked(mark)]}"
    after = sandbox.run_sync(probe("RESULT = 6 * 7"), "cpu")  # the next job is served as usual
    assert after.final is not None and after.final["result"] == "42", after.output


INLINE_SPIN = """\
import torch
from torch.utils.cpp_extension import load_inline  # the compile step runs this file for its extensions

while True:  # spins in the compile step's run of model_new.py
    pass
"""


@pytest.mark.timeout(600)
def test_candidate_code_run_by_the_compile_step_gets_the_job_limit(eval_cache: Path, build_ws) -> None:
    task = task_of("red_row_sum")
    limit = 5.0
    ev = Evaluator(cpu_config(eval_cache, limits=LimitsConfig(timeout_s=limit)))
    try:
        result = ev.compile(task, build_ws(task, INLINE_SPIN, {}))
    finally:
        ev.close()
    assert not result.ok
    assert any("timed out" in e for e in result.errors), result.errors
    # the job's limit (5 s), not the compiler's (toolchain.timeout_s x 3 = 540 s)
    assert result.seconds < limit + GRACE_S, result.seconds


# -- the evaluator dies mid-job ------------------------------------------------------------------
EVALUATOR_SCRIPT = """\
import sys
from pathlib import Path
from cudagym.sandbox.config import LocalSandboxConfig
from cudagym.sandbox.local import LocalSandbox
from cudagym.sandbox.protocol import LimitsConfig
from cudagym.sandbox.worker.wire import Job

sb = LocalSandbox(LocalSandboxConfig(spare_workers=1, fork_server=sys.argv[1] == "forked"), home=Path(sys.argv[2]))
sb.run_sync(Job(kind="probe", nonce="n", task_id="faults", probe=sys.stdin.read(),
                limits=LimitsConfig(timeout_s=600)), "cpu")
"""


@pytest.mark.timeout(600)
@pytest.mark.parametrize("server", ["forked", "spawned"])
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL], ids=["SIGTERM", "SIGKILL"])
def test_an_evaluator_killed_mid_job_leaves_no_worker_or_fork_server(tmp_path: Path, sig: int, server: str) -> None:
    mark = f"cgorph{uuid.uuid4().hex[:8]}"
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.Popen([sys.executable, "-c", EVALUATOR_SCRIPT, server, str(tmp_path)], stdin=subprocess.PIPE,
                            env=env, start_new_session=True)
    assert proc.stdin is not None
    proc.stdin.write(spinner(mark).encode())
    proc.stdin.close()
    try:
        end = time.monotonic() + 300
        while len(marked(mark)) < 2:  # the worker and its process are spinning
            assert proc.poll() is None and time.monotonic() < end, "the job never started"
            time.sleep(0.2)
        ours = [p.pid for p in psutil.Process(proc.pid).children(recursive=True)] + [p.pid for p in marked(mark)]
        servers = [p.pid for p in psutil.Process(proc.pid).children()
                   if "cudagym.sandbox.forkserver" in " ".join(p.cmdline())]
        assert servers or server == "spawned"
        proc.send_signal(sig)
        proc.wait(timeout=60)
        left = gone(ours)
        assert not left, f"alive after the evaluator's {signal.Signals(sig).name}: " + str(
            [(pid, psutil.Process(pid).cmdline()[:4]) for pid in left if psutil.pid_exists(pid)])
    finally:
        if proc.poll() is None:
            proc.kill()
        for p in marked(mark):  # never leave a spinner behind, whatever failed
            p.kill()


# -- no privilege --------------------------------------------------------------------------------
PRIVILEGE_PROBE = """\
import ctypes, errno, json, os, threading
res = {}
def attempt(name, f):
    try:
        f()
        res[name] = 0
    except OSError as e:
        res[name] = e.errno
fifo = lambda: os.sched_setscheduler(0, os.SCHED_FIFO, os.sched_param(1))
attempt("fifo", fifo)
attempt("rr", lambda: os.sched_setscheduler(0, os.SCHED_RR, os.sched_param(1)))
attempt("nice", lambda: os.setpriority(os.PRIO_PROCESS, 0, -5))
class Param(ctypes.Structure):
    _fields_ = [("priority", ctypes.c_int)]
libc = ctypes.CDLL(None)
libc.pthread_self.restype = ctypes.c_ulong
res["pthread"] = libc.pthread_setschedparam(ctypes.c_ulong(libc.pthread_self()), 1, ctypes.byref(Param(1)))
t = threading.Thread(target=lambda: attempt("thread_fifo", fifo))
t.start(); t.join()
status = dict(line.split(":", 1) for line in open("/proc/self/status").read().splitlines() if ":" in line)
res["status"] = {k: status[k].strip() for k in ("CapInh", "CapPrm", "CapEff", "CapBnd", "CapAmb", "NoNewPrivs")}
res["threads"] = {}
for tid in os.listdir("/proc/self/task"):
    try:  # a thread may exit between the listing and the reads (the joined one, under load)
        st = open(f"/proc/self/task/{tid}/status").read()
        res["threads"][tid] = [st.split("CapEff:")[1].split()[0], os.sched_getscheduler(int(tid))]
    except (FileNotFoundError, ProcessLookupError):
        pass
RESULT = json.dumps(res)
"""


def assert_unprivileged(result: str) -> None:
    res = json.loads(eval(result))  # noqa: S307 - the probe's repr() of a JSON string
    for k in ("fifo", "rr", "thread_fifo"):
        assert res[k] == errno.EPERM, res
    assert res["pthread"] == errno.EPERM, res
    assert res["nice"] == errno.EACCES, res
    for k in ("CapInh", "CapPrm", "CapEff", "CapBnd", "CapAmb"):
        assert int(res["status"][k], 16) == 0, res["status"]
    assert res["status"]["NoNewPrivs"] == "1", res["status"]
    for tid, (cap_eff, policy) in res["threads"].items():  # torch's threads, started before the job
        assert int(cap_eff, 16) == 0 and policy == os.SCHED_OTHER, (tid, cap_eff, policy)


@pytest.mark.timeout(600)
def test_real_time_scheduling_and_capabilities_are_refused(sandbox: LocalSandbox) -> None:
    out = sandbox.run_sync(probe(PRIVILEGE_PROBE), "cpu")
    assert out.final is not None and out.final.get("ok"), out.output
    assert_unprivileged(out.final["result"])


@pytest.mark.docker
@pytest.mark.timeout(900)
def test_real_time_scheduling_and_capabilities_are_refused_in_a_container(tmp_path: Path) -> None:
    require_docker()
    from cudagym.sandbox.config import DockerSandboxConfig
    from cudagym.sandbox.docker import DockerSandbox

    sb = DockerSandbox(DockerSandboxConfig(spare_workers=1), home=tmp_path / "home")
    try:
        out = sb.run_sync(probe(PRIVILEGE_PROBE), "cpu")
    finally:
        sb.close()
    assert out.final is not None and out.final.get("ok"), out.output
    assert_unprivileged(out.final["result"])


# -- a noisy neighbour during a baseline ---------------------------------------------------------
NEIGHBOURS = 12


def neighbour(mark: str, log_dir: str) -> str:
    """Probe source: NEIGHBOURS busy processes, each in a session of its own, each appending its
    CLOCK_MONOTONIC (ns) to its log every few ms; then the job waits for the file `stop`."""
    child = "\n".join([
        "import os, time",
        f"MARK = {mark!r}",
        f"f = open(os.path.join({log_dir!r}, str(os.getpid())), 'a')",
        "while True:",
        "    t = time.monotonic_ns()",
        "    while time.monotonic_ns() - t < 1_000_000:",
        "        pass",
        "    f.write(str(time.monotonic_ns()) + ' ')",
        "    f.flush()",
        "    time.sleep(0.004)",
    ])
    stop = os.path.join(log_dir, "stop")
    return "\n".join([
        "import os, subprocess, sys, time",
        f"for _ in range({NEIGHBOURS}):",
        f"    subprocess.Popen([sys.executable, '-c', {child!r}], start_new_session=True)",
        f"while not os.path.exists({stop!r}):",
        "    time.sleep(0.1)",
    ])


@pytest.mark.timeout(900)
def test_a_noisy_neighbour_is_frozen_during_a_baselines_timed_loops(tmp_path: Path) -> None:
    task = task_of("red_row_sum")
    mark = f"cgnoise{uuid.uuid4().hex[:8]}"
    logs = tmp_path / "ws"
    logs.mkdir()
    sb = LocalSandbox(LocalSandboxConfig(spare_workers=2), home=tmp_path / "home")
    ev = Evaluator(cpu_config(tmp_path / "cache"), sandbox=sb)
    pool = ThreadPoolExecutor(1)
    try:
        noisy = pool.submit(sb.run_sync, probe(neighbour(mark, str(logs)), timeout_s=600, workspace=str(logs)), "cpu")
        end = time.monotonic() + 300
        while len([p for p in logs.iterdir() if p.stat().st_size]) < NEIGHBOURS:
            assert not noisy.done() and time.monotonic() < end, noisy.result() if noisy.done() else "never started"
            time.sleep(0.2)
        base = asyncio.run(ev.abaselines(task))
        assert "error" not in base, base
        device, report = sb.quiet_reports[-1]
        assert device == "cpu" and report["windows"] >= 1, report
        assert report["frozen_jobs"] >= 1 and report["frozen_processes"] >= NEIGHBOURS + 1, report
        assert "other_cores" in report, report
        (logs / "stop").write_text("")
        done = noisy.result(timeout=120)
        assert done.final is not None and done.final.get("ok"), done.output
    finally:
        (logs / "stop").write_text("")
        for p in marked(mark):
            p.kill()
        ev.close()
        pool.shutdown()
    ticks = [int(x) for p in logs.iterdir() if p.name.isdigit() for x in p.read_text().split()]
    margin = 10_000_000  # 10 ms: a write of a tick read just before the freeze
    inside = [(t, b, e) for b, e in report["spans_ns"] for t in ticks if b + margin < t < e - margin]
    assert not inside, f"{len(inside)} neighbour ticks inside the timed loops' windows, e.g. {inside[:3]}"
    assert any(t > report["spans_ns"][-1][1] for t in ticks), "the neighbour went on after the loops"
