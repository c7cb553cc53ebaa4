"""The sandboxed worker: the process that runs one job next to the candidate's code, and the
wire protocol it speaks with the evaluator.

- `wire`: the protocol, both ends (the `Job` line, the frames, the worker's `Channel`, the
  parent's `FrameReader`); `dtypes`: the tensor dtypes it carries. The parent imports these two.
- `entry` (`python -m cudagym.sandbox.worker`): the process's life; `prewarm`: its start-up.
- `state`: the one `WorkerState` passed to everything below.
- `integrity`: tamper snapshots and checks, the audit hook, the dispatcher's table, allocator
  poisoning; `failures`: how a failure of the candidate's is named.
- `problem`: the reference and candidate models; the job families `verify`, `timed` (profile,
  baseline, ncu) and `build` (compile_inline, build_inline, probe), by kind in `jobs`;
  `telemetry`: NVML readings and phase times.

Importing the package imports nothing else (a spawned worker times its imports itself).
"""
