"""The timing protocol, run inside a worker, driven by the parent.

The parent decides every call: the worker asks it for the next call (`drive_calls`), and gets
the seed of that call's inputs or the word to stop. Which calls are warm-up and which are timed,
and how many there are, is the parent's decision (`cudagym.sandbox.feed.CallFeed`), made with its
own clock; the worker cannot tell them apart, and neither can the callee. Before every call the
call's input buffers are refilled with values generated from its seed: same pointers, new
contents, so neither pointer- nor content-keyed result caches can replay. Each call's time is
computed as soon as the call is over and goes to the parent with the next request; no record of
past calls stays in the worker.

CUDA: CUDA events on the caller's stream, no profiler. Per call:
1. synchronize the device: the GPU is idle;
2. on the caller's stream: reset persisting L2 lines, then the *open gate* kernel. It runs as
   many 256-thread blocks as the GPU keeps resident at once (every SM full: no other kernel's
   block can run beside them). Its blocks hold their SMs for the launch window
   (`TimingConfig.launch_window_us`), then copy this call's input values from a staging copy
   into the call's input buffers, then flush the L2 cache by reading a buffer twice its size (a
   read leaves clean lines: the call pays for no write-backs). Then the start event;
3. call. The call is launched while the window runs, so the host's work of getting its
   launches to the GPU is hidden up to the window (as launch latency is in Triton's
   `do_bench`, where the flush alone does it). None of its kernels, on any stream, can start
   before the gate ends: the SMs are full. During the window the input buffers still hold an
   earlier call's values, so host work there cannot compute this call's answer (say on the
   CPU, copied in by a copy engine, which the gate does not hold): only work ordered after
   the start event sees the inputs;
4. the *close gate* kernel, on the same stream (the stream the call started on, even if the call
   changed the current stream): the same blocks, which go on only once all of them have been
   resident at once, so once no kernel of the call, on any stream, still holds an SM. While they
   all still hold the SMs they read the call's output samples (`DeviceTimer.read_at_end`: secret
   positions from a seed drawn after the call returned) and project every element of every
   output on secret +-1 weights from the same seed (`projection`), then exit. Then the end
   event. The close kernel is issued after the call returned on the host, so host work that
   ends after the window is timed, and every page of the output is read (a lazily mapped or
   managed one is there) before the end event;
5. synchronize the device, then a last event; the call's time is read.

A call's time is end event less start event, less the close's *read phase* (from its last block's
arrival to its last block's exit, on the device clock: `DeviceTimer.stamps_ns`; at most
`READ_SLACK_NS` more than the calibration's, plus the calibrated time per element projected
beyond the calibration's output, plus `READ_SLACK_REL` of it), less the harness's overhead: that same
interval for a call that launches nothing (its output read by the close as a call's is), the
median of `CALIBRATION_CALLS` calls, measured by each timing job before any candidate code is
loaded (`harness.job_timer`), at most `MAX_OVERHEAD_NS`. So a call that launches nothing reads
0, and a kernel's time holds its own launch on the GPU, as Nsight Compute counts it. Why each
part (H100, 10 fresh processes, `benchmarks/probe_stamps.py`):
- one stream: with the gates on a stream of their own, the two hand-overs between it and the
  caller's stream added 1-2.5 us to a one-kernel call, a different amount for each kernel
  (relu 16x16384 read 4.3 us against Nsight Compute's 3.3, a 32 MB relu 22.2 against 20.2);
- the read phase: it took 9.5-11.2 us, with the outputs' number, size and place (a sum's 16
  values against softmax's 2048 samples), and was the rest of the kernel-to-kernel variation;
  left out, five one-op problems of 2.8-20 us read within 0.8 us of Nsight Compute, and all 14
  one-kernel problems of `benchmarks/bench_baselines.py` within 0.4 us below 10 us, on an H100
  and an H200;
- a call that launches nothing: a probe kernel's interval less its stamped own time left out
  the probe's launch, which Nsight Compute counts as a kernel's: a 4 KB relu read 0.4-0.9 us
  against 2.8.
The read phase's cap bounds what a forged stamp could take off a call.

What the SMs do not show is work on a stream the caller's stream never waits for that is not
running when the close kernel's blocks all become resident: a copy engine's copy, or a kernel
that becomes ready at that moment and loses the race for the SMs to the close kernel (on an
H100, a device-to-device `cudaMemcpyAsync` on such a stream read 0.066 ms where the honest call
read 0.061, and its output was complete when sampled after the end event, as the harness then
did). So the samples are read inside the close kernel, not after it:
- at the close: an output still being written by a copy, or not yet written by a kernel that
  could not start, is read as it is: a mismatch; if the close kernel gives up
  (`CLOSE_TIMEOUT_NS`: something held an SM that long), the call runs to the last event, less
  `TAIL_ALLOWANCE_MS`;
- during the launch window: a copy may run, but the inputs do not yet hold the call's values
  (step 3); only the gate's copy and flush (tens of microseconds) run after they do and before
  the start event.

No profiler, because the CUDA profiler's concurrent-kernel tracing (the way to see kernels on
every stream) instruments kernels: it slowed kernels of many short-lived blocks by 9-12% on an
H200 and left torch's, cuBLAS's and Triton's alone (`benchmarks/probe_ncu_gap.py`), a bias
against honest candidates of a common style.

CPU: the wall clock around the call, after reading a buffer larger than the LLC and then writing
the call's input values (so the inputs start the call in cache, where on a GPU the gate copies them
before its flush: a thread of the candidate's that computed the answer while the flush ran, from
inputs already written, had the flush's few milliseconds untimed, +3 in a red-team attempt with
three passes of work). The interval
holds the call, then the *CPU close*: `after` (the harness's: it checks the outputs and registers
each with `read_at_end`, which allocates its evidence buffers), then one call into the harness's
own native library (`cudagym_cpu_close` in opwatch.cpp, compiled by the parent, bound by ctypes
before any candidate code loads) that draws a seed with getrandom(), gathers the values at
positions drawn from it, then reads every element of every output (in chunks, in an order drawn
from the seed; a contiguous output through process_vm_readv, so a page the candidate protected
fails the close, TAMPER, instead of reaching a fault handler of its) and projects it as the GPU's
close kernel does (`projection`); then the evidence is sent on the pipe as raw bytes, and only
then does the clock stop. What is left out of the interval is what the GPU's leaves out: the
overhead of a call that does nothing (its output read as a call's is) and the close's own
projection pass (timed by the close), at most what the timing job's calibration measured for
outputs of that size (`DeviceTimer.calibrate`, before any candidate code loads:
`CPU_CALIBRATION`). Why in one native call, inside the interval, and the send too:
- before, the positions were drawn after the clock stopped with `torch.randint` and the values
  gathered with ATen ops, in the candidate's process; a RecordFunction callback or a Python
  profile hook the candidate left behind ran there, and either did the whole call's work untimed
  (+3 with nothing computed inside the call) or computed only the 2048 positions it read from
  randint's output. Now no code but the harness's native code runs between the draw and the
  read: no Python (a ctypes call makes no profile event), no ATen op;
- then a red team (2026-11-26) returned zeros and had a native thread, holding the GIL after the
  close, write the right values at the drawn positions of the evidence buffers before Python
  sent them (+3). Now the projections of the whole output, made inside the close, are checked by
  the parent on the CPU as on a GPU: samples rewritten afterwards leave projections of zeros
  (MISMATCH), and rewriting those too needs the whole output computed, which, since the evidence
  leaves inside the interval, is timed;
- anything a hook does after the call returns and before the close runs inside the interval,
  and pages a fault handler fills on first read are filled, and timed, in the close.
A Python profile, trace or monitoring hook found right after the call (`foreign_hooks`) is
`TimerTamperedError`. Left: native code that edits the interpreter's or torch's state directly
(the harness's clock, its pipe): the candidate's native code shares the worker's process. Cost
(2 shared cores, fp32): ~4 ns per element projected, left out of the time up to its calibration.

Evidence (what the parent re-checks, `cudagym.rewards.compare`): each output's samples, their
positions and its projections are sent on the pipe before the worker asks for the next call (on
a GPU, copied to the host's pageable memory on the call's stream right after the close kernel,
so no kernel launched after the call's last event can rewrite them; on the CPU target, sent from
inside the interval), so nothing the candidate runs later (its next call, a finalizer, a kernel writing the
worker's page-locked result memory) can change them. The projections make a sample rewritten
before that (by code running beside the harness) worthless without the whole output: the
weights are drawn after the call returned, so an honest output's projections differ from the
reference's by a Rademacher sum of its per-element errors (bounded by the tolerance), and an
output computed only where it was sampled differs by a sum of large ones. Cost per GPU call (H100,
`benchmarks/probe_evidence_cost.py`): 2.6 ps of close kernel per fp32 element (+1.5 us at 1 MB,
+42 us at 64 MB), left out of the reported time; ~40 us of host time per output to send it.

Per-call times are in milliseconds. Statistics are computed by the parent (`TimingStats`).

The package's modules: `timer` (`DeviceTimer`, the calibration, the calls the parent drives,
`projection`: every function the timed path calls, in one module, whose functions the harness
pins against rebinding), `gate` (the gate kernels' CUDA source and their loading) and `evidence`
(what a call's close reads of its outputs).
"""

from cudagym.sandbox.timing.evidence import MAX_CPU_DIMS, Evidence
from cudagym.sandbox.timing.gate import (CLOSE_TIMEOUT_NS, GATE_THREADS, MAX_SAMPLED_DIMS, MAX_SAMPLED_OUTPUTS,
                                         PROJECTED_KINDS, Gate, gate_kernels, gate_source)
from cudagym.sandbox.protocol import (CALIBRATION_ELEMENTS, MAX_OVERHEAD_NS, READ_SLACK_NS, READ_SLACK_REL,
                                      TAIL_ALLOWANCE_MS, Calibration, call_ms_from)
from cudagym.sandbox.timing.timer import (CALIBRATION_CALLS, CPU_CALIBRATION, LARGE_CALIBRATION_CALLS,
                                          LARGE_CALIBRATION_ELEMENTS, PLACEMENT_BYTES, PROJECTIONS, PROTOCOL_VERSION,
                                          SAMPLE_SIZE, STRIDED_CALIBRATION_ELEMENTS, DeviceTimer, TimerTamperedError,
                                          call_ms, drive_calls, foreign_hooks, harness_calibration, projection,
                                          reference_projection, refill_, touch_pages, use_native_close)

__all__ = ["call_ms_from", "CALIBRATION_CALLS", "CALIBRATION_ELEMENTS", "CPU_CALIBRATION",
           "CLOSE_TIMEOUT_NS", "GATE_THREADS", "LARGE_CALIBRATION_CALLS",
           "LARGE_CALIBRATION_ELEMENTS", "MAX_CPU_DIMS", "MAX_OVERHEAD_NS", "MAX_SAMPLED_DIMS", "MAX_SAMPLED_OUTPUTS",
           "PLACEMENT_BYTES",
           "PROJECTED_KINDS", "PROJECTIONS", "PROTOCOL_VERSION", "READ_SLACK_NS", "READ_SLACK_REL", "SAMPLE_SIZE",
           "STRIDED_CALIBRATION_ELEMENTS", "TAIL_ALLOWANCE_MS", "Calibration", "DeviceTimer", "Evidence", "Gate",
           "TimerTamperedError", "call_ms", "drive_calls", "foreign_hooks", "gate_kernels", "gate_source",
           "harness_calibration", "projection", "reference_projection", "refill_", "touch_pages", "use_native_close"]
