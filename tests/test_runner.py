"""The episode runner: store, resume after SIGKILL, report, CLI."""

import asyncio
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from cudagym.agent.report import render_table, results_table, write_report
from cudagym.agent.runner import RunConfig, arun
from cudagym.agent.store import TrajectoryStore
from cudagym.errors import ConfigError
from cudagym.rewards.evaluator import EvaluatorConfig

REPO = Path(__file__).resolve().parent.parent
TASKS = "ew_scale_bias_gelu"


async def slow_policy(messages, tools, context):
    """Looks around for a few turns (slowly, so a kill lands mid-episode), then submits nothing."""
    await asyncio.sleep(0.4)
    if context.turn < 3:
        return 'Looking. <tool_call>{"name": "list_files", "arguments": {}}</tool_call>'
    return {"name": "submit", "arguments": {}}


def _cli(*args, env_extra=None, **kw):
    env = {**os.environ, "COLUMNS": "200", "PYTHONPATH": f"{REPO}{os.pathsep}{REPO / 'tests'}", **(env_extra or {})}
    # SIGINT as a user's terminal delivers it: a test run started in the background (a shell's `&`)
    # passes it on ignored, and an ignored SIGINT would decide the Ctrl-C test, not the runner
    return subprocess.Popen([sys.executable, "-c", "from cudagym.cli import main; main()", *args],
                            cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True, preexec_fn=_default_sigint, **kw)


def _default_sigint() -> None:
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _episode_records(out: Path):
    counts, turns = {}, {}
    for p in sorted((out / "episodes").glob("*.jsonl")):
        for line in p.read_text().splitlines():
            rec = json.loads(line)
            if rec["type"] == "episode":
                counts[rec["episode_id"]] = counts.get(rec["episode_id"], 0) + 1
            elif rec["type"] == "step":
                turns.setdefault(rec["episode_id"], []).append(rec["turn"])
    return counts, turns


def kill_midway(proc: subprocess.Popen, out: Path) -> set[str]:
    """SIGKILL the runner `proc` (its process group) once some episodes of `out` are complete
    and others in flight; the names of the complete ones."""
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        done = list((out / "episodes").glob("*.jsonl")) if (out / "episodes").is_dir() else []
        partial = list((out / "episodes").glob("*.partial")) if (out / "episodes").is_dir() else []
        if len(done) >= 2 and partial and any(p.stat().st_size > 0 for p in partial):
            break
        if proc.poll() is not None:
            pytest.fail("the runner finished before it could be killed:\n" + proc.stdout.read())
        time.sleep(0.05)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    proc.stdout.close()
    return {p.name for p in (out / "episodes").glob("*.jsonl")}


@pytest.mark.timeout(900)
def test_resume_after_sigkill(tmp_path):
    out = tmp_path / "run"
    args = ["run", "--tasks", TASKS, "--policy", "test_runner:slow_policy", "--episodes", "6",
            "--concurrency", "2", "--target", "cpu", "--out", str(out)]
    completed_before = kill_midway(_cli(*args), out)
    assert 2 <= len(completed_before) < 6
    assert list((out / "episodes").glob("*.partial"))

    proc = _cli(*args)
    output, _ = proc.communicate(timeout=600)
    assert proc.returncode == 0, output
    assert f"skipped {len(completed_before)} already complete" in output
    assert "pass rate" in output
    counts, turns = _episode_records(out)
    assert counts == {f"{TASKS}@{k}": 1 for k in range(6)}
    for eid, ts in turns.items():
        assert ts == list(range(len(ts))) == [0, 1, 2, 3], (eid, ts)  # each step once, in order
    assert not list((out / "episodes").glob("*.partial"))
    assert (out / "report.md").is_file() and (out / "speedup.png").stat().st_size > 1000
    summaries = TrajectoryStore(out).summaries()
    assert all(s["verdict"]["milestone"] == "failed" and s["reward"] == -1.0 for s in summaries)


@pytest.mark.timeout(900)
def test_ctrl_c_leaves_no_partial_episode_and_resume_completes(tmp_path):
    """Ctrl-C (SIGINT) stops the run: the episodes in flight are aborted (no .partial file left,
    no open trajectory), the complete ones stay, and the next run finishes the rest."""
    out = tmp_path / "run"
    args = ["run", "--tasks", TASKS, "--policy", "test_runner:slow_policy", "--episodes", "4",
            "--concurrency", "2", "--target", "cpu", "--out", str(out)]
    proc = _cli(*args)
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        partial = list((out / "episodes").glob("*.partial")) if (out / "episodes").is_dir() else []
        if partial and any(p.stat().st_size > 0 for p in partial):
            break
        if proc.poll() is not None:
            pytest.fail("the runner finished before it could be interrupted:\n" + proc.stdout.read())
        time.sleep(0.05)
    os.killpg(proc.pid, signal.SIGINT)
    output, _ = proc.communicate(timeout=120)
    assert proc.returncode != 0, output
    assert not list((out / "episodes").glob("*.partial")), output
    done_before = {p.name for p in (out / "episodes").glob("*.jsonl")}
    assert len(done_before) < 4
    proc = _cli(*args)
    output, _ = proc.communicate(timeout=600)
    assert proc.returncode == 0, output
    counts, _ = _episode_records(out)
    assert counts == {f"{TASKS}@{k}": 1 for k in range(4)}


async def test_runner_in_process_records_and_refuses_changed_settings(tmp_path):
    cfg = RunConfig(tasks=TASKS, policy="test_runner:slow_policy", episodes=2, concurrency=2,
                    evaluator=EvaluatorConfig(target="cpu"), out=tmp_path / "r", max_turns=2)
    from rich.console import Console

    quiet = Console(file=open(os.devnull, "w"))  # noqa: SIM115 - the console lives as long as the test
    summary = await arun(cfg, quiet)
    assert summary.ran == 2 and summary.skipped == 0
    store = TrajectoryStore(tmp_path / "r")
    s = store.summaries()
    assert [x["episode_id"] for x in s] == [f"{TASKS}@0", f"{TASKS}@1"]
    assert all(x["status"] == "truncated" and x["turns"] == 2 for x in s)  # scored at the turn budget
    steps = store.steps(f"{TASKS}@0")
    assert steps[-1]["truncated"] and steps[-1]["info"]["verdict"]["milestone"] == "failed"
    assert "list_files" in steps[0]["observation"] and steps[0]["action"]["content"].startswith("Looking")
    again = await arun(cfg, quiet)  # a complete run resumes to nothing
    assert again.ran == 0 and again.skipped == 2
    with pytest.raises(ConfigError, match="episodes"):
        await arun(cfg.model_copy(update={"episodes": 3}), quiet)


def _ep(eid, level, source, correct, se=None, sc=None, reward=-1.0):
    return {"type": "episode", "episode_id": eid, "reward": reward, "task": {"level": level, "source": source},
            "verdict": {"correct": correct, "speedup_vs_eager": se, "speedup_vs_compile": sc}}


def test_results_table_metrics(tmp_path):
    eps = [_ep("a", 1, "bundled", True, 2.0, 0.5, 2.0), _ep("b", 1, "bundled", True, 0.5, 0.25, 1.0),
           _ep("c", 2, "kb", False), _ep("d", 2, "kb", True, 8.0, 2.0, 3.0)]
    rows = {r.group: r for r in results_table(eps)}
    o = rows["overall"]
    assert (o.episodes, o.pass_rate, o.faster_than_eager, o.faster_than_compile) == (4, 0.75, 0.5, 0.25)
    assert o.geomean_vs_eager == pytest.approx(2.0) and o.geomean_vs_compile == pytest.approx(0.25 ** (1 / 3))
    assert o.mean_reward == pytest.approx(1.25)
    assert rows["level 1"].pass_rate == 1.0 and rows["level 2"].pass_rate == 0.5
    assert rows["source kb"].geomean_vs_eager == pytest.approx(8.0)
    # and from a run directory on disk
    store = TrajectoryStore(tmp_path)
    for e in eps:
        w = store.begin(e["episode_id"])
        w.write({"type": "step", "episode_id": e["episode_id"], "turn": 0})
        w.commit({k: v for k, v in e.items() if k != "type"})
    rows2, md, png = write_report(tmp_path)
    assert rows2[0] == o and "| overall | 4 | 75.0% | 50.0% | 25.0% | 2.000x | 0.630x (n=3) | +1.25 |" in md.read_text()
    assert png.read_bytes()[:4] == b"\x89PNG"


def test_each_geomean_names_its_own_population():
    """An episode without a torch.compile baseline (its compile failed) counts in the geomean
    against eager, not in the one against torch.compile, and the table says how many each has."""
    eps = [_ep("a", 1, "bundled", True, 2.0, 19.5, 3.0), _ep("b", 2, "bundled", True, 4.0, None, 2.0),
           _ep("c", 3, "bundled", True, 8.0, None, 2.0)]
    o = results_table(eps)[0]
    assert (o.n_timed, o.n_vs_compile) == (3, 1)
    assert o.geomean_vs_eager == pytest.approx(4.0) and o.geomean_vs_compile == pytest.approx(19.5)
    from rich.console import Console

    console = Console(width=250, record=True)
    console.print(render_table([o]))
    text = console.export_text()
    assert "4.000x (n=3)" in text and "19.500x (n=1)" in text


def test_report_command_and_help(tmp_path):
    store = TrajectoryStore(tmp_path)
    w = store.begin("x@0")
    w.commit({"episode_id": "x@0", "reward": 1.0, "task": {"level": 1, "source": "bundled"},
              "verdict": {"correct": True, "speedup_vs_eager": 1.5, "speedup_vs_compile": 1.1}})
    w = store.begin("x@1")  # an interrupted episode: not reported
    w.write({"type": "step", "episode_id": "x@1", "turn": 0})
    p = _cli("report", str(tmp_path))
    out, _ = p.communicate(timeout=120)
    assert p.returncode == 0, out
    assert "pass rate" in out and "100.0%" in out and "1.500x" in out
    p = _cli("run", "--help", env_extra={"COLUMNS": "200"})
    out, _ = p.communicate(timeout=120)
    for opt in ("--tasks", "--policy", "--episodes", "--concurrency", "--target", "--out", "--max-turns", "--mode",
                "--backend", "--ray-address"):
        assert opt in out


def test_spare_workers_reach_the_run_evaluator(tmp_path):
    from cudagym.agent.runner import make_evaluator

    cfg = EvaluatorConfig(target="cpu", sandbox={"backend": "local", "spare_workers": 1})
    with make_evaluator(RunConfig(evaluator=cfg, out=tmp_path)) as ev:
        assert ev.sandbox.config.spare_workers == 1
    with pytest.raises(ValueError):
        EvaluatorConfig(sandbox={"backend": "local", "spare_workers": -1})


def test_a_setting_that_moved_is_named_not_dropped():
    """A config written before the evaluator's settings were nested (a script's keyword
    arguments, a saved file) fails naming the field and where it lives now, rather than loading
    with the field silently ignored."""
    with pytest.raises(ValueError,
                       match=r"RunConfig\.spare_workers is now RunConfig\.evaluator\.sandbox\.spare_workers"):
        RunConfig(spare_workers=2)
    with pytest.raises(ValueError, match=r"RunConfig\.target is now RunConfig\.evaluator\.target"):
        RunConfig.model_validate_json('{"target": "cpu"}')
    with pytest.raises(ValueError,
                       match=r"EvaluatorConfig\.spare_workers is now EvaluatorConfig\.sandbox\.spare_workers"):
        EvaluatorConfig(spare_workers=2)
    with pytest.raises(ValueError, match=r"EvaluatorConfig\.docker is now"):
        EvaluatorConfig(docker={"image": "x"})
    assert EvaluatorConfig(sandbox="docker").sandbox.backend == "docker"  # a backend by name: its defaults
    saved = EvaluatorConfig(sandbox={"backend": "docker", "spare_workers": 3, "image": "x"}).model_dump_json()
    assert EvaluatorConfig.model_validate_json(saved).sandbox.image == "x"


async def test_a_run_directory_of_the_flat_settings_resumes(tmp_path):
    """A run directory whose run.json predates `RunConfig.evaluator` (target and mode at its top)
    resumes, and a changed target there is still refused."""
    from rich.console import Console

    quiet = Console(file=open(os.devnull, "w"))  # noqa: SIM115 - the console lives as long as the test
    cfg = RunConfig(tasks=TASKS, policy="test_runner:slow_policy", episodes=1, concurrency=1,
                    evaluator=EvaluatorConfig(target="cpu"), out=tmp_path / "r", max_turns=1)
    await arun(cfg, quiet)
    run_json = tmp_path / "r" / "run.json"
    saved = json.loads(run_json.read_text())
    flat = {k: v for k, v in saved.items() if k != "evaluator"} | {
        "target": "cpu", "mode": "strict", "sandbox": "local", "spare_workers": None}
    run_json.write_text(json.dumps(flat))
    again = await arun(cfg, quiet)
    assert again.ran == 0 and again.skipped == 1
    run_json.write_text(json.dumps(flat | {"target": "cuda"}))
    with pytest.raises(ConfigError, match="evaluator.target"):
        await arun(cfg, quiet)
