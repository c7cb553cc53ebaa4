"""Verify's layout and limits for large problems (`VerifyConfig.layout`, `Evaluator.averify`).

Each task file (a KernelBench-format `.py`) is verified twice on one evaluator with its reference
submitted as its own candidate (permissive, no own-kernel share: what `cudagym tasks selfcheck`
does): first unmeasured (side by side; once more reference first if a job ran out of memory),
then with the footprint the first verify's reference-only job measured. Printed per verify: the
verdict, whether the reference's job ran first, the seconds of a discarded out-of-memory try,
the candidate's host memory limit, and the footprint.

Usage: python benchmarks/probe_kb_layout.py TASK.py [TASK.py ...] [--target cuda]
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path
from typing import Any

from cudagym.rewards.evaluator import Evaluator, EvaluatorConfig
from cudagym.sandbox.protocol import VerifyConfig
from cudagym.sandbox.workspace import Workspace
from cudagym.selfcheck import reference_as_candidate
from cudagym.tasks.loaders import load_tasks


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("tasks", nargs="+")
    ap.add_argument("--target", default="auto")
    args = ap.parse_args()
    cfg = EvaluatorConfig(target=args.target, mode="permissive", verify=VerifyConfig(min_own_share=0.0),
                          compile_baseline=False)
    rows: list[dict[str, Any]] = []
    with Evaluator(cfg) as ev, tempfile.TemporaryDirectory() as tmp:
        for n, path in enumerate(args.tasks):
            (task,) = load_tasks(path)
            for attempt in ("unmeasured", "measured"):
                ws = Workspace.create(Path(tmp) / f"ws{n}{attempt}", task)
                ws.write("model_new.py", reference_as_candidate(task.code))
                # the limit the candidate's job starts with (the probe looks at what verify will use)
                limit = ev._candidate_limits(task.for_target(ev.target)).memory_mb
                r = ev.verify(task, ws)
                fp = ev.footprint(task)
                row = {"task": task.id, "verify": attempt, "ok": r.ok, "seconds": round(r.seconds, 1),
                       "reference_first": r.breakdown.get("reference_first"),
                       "out_of_memory_try_s": r.breakdown.get("side_by_side_out_of_memory_s"),
                       "candidate_memory_mb_at_start": limit,
                       "footprint_gib": None if fp is None else {
                           "host": round(fp.host_bytes / 2**30, 2),
                           "device": None if fp.device_bytes is None else round(fp.device_bytes / 2**30, 2)},
                       "error": (r.error or "")[:600] if not r.ok else ""}
                rows.append(row)
                print(json.dumps(row), flush=True)
    print(json.dumps({"device": ev.device_name, "rows": rows}))


if __name__ == "__main__":
    main()
