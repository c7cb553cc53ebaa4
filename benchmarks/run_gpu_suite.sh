#!/usr/bin/env bash
# The GPU machine's commands, one per device call (each fits its 10-minute limit):
#   OUT=$OUT bash benchmarks/run_gpu_suite.sh tests   # `pytest -m gpu` (over 15 min on an H100 since session 30:
#       split it over three calls, `tests tests/test_[a-f]*.py`, `tests tests/test_g*.py`, `tests tests/test_[h-z]*.py`;
#       `test_[a-g]*` alone took 563 s, and its teardown ran past a 570 s limit)
#   OUT=$OUT bash benchmarks/run_gpu_suite.sh bench   # benchmarks/bench_baselines.py (3 min on an H100, 4+ on an H200)
#   OUT=$OUT bash benchmarks/run_gpu_suite.sh verl    # benchmarks/verl_gpu_path.py (carry .whl and .whl_verl)
# Logs and the benchmark's raw numbers go to $OUT: pytest_gpu.log, bench_baselines.log,
# bench_baselines.json (written after every problem, so a run cut short keeps what it measured);
# verl_gpu_path.log, verl_gpu_path.json (written after every stage) and verl_gpu_run.log.
# A time limit ($TIMEOUT_S, default 540 s) interrupts with SIGINT, so pytest still prints its
# summary of failures so far.
# Wheels in ./.whl (the project's dependencies the GPU image lacks) are installed first, if present,
# and for `verl` those in ./.whl_verl (verl and what it imports: benchmarks/fetch_verl_gpu_wheels.sh).
# Extra arguments go to pytest or bench_baselines.py (e.g. -x; --quick, --problems a,b).
set -uo pipefail
cd "$(dirname "$0")/.."
: "${OUT:?set OUT to the folder that receives the logs}"
what=${1:?say tests or bench}
shift
mkdir -p "$OUT"
PYTHON=${PYTHON:-python3}
export PYTHONUNBUFFERED=1
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
wheels=(.whl/*.whl) site=/tmp/cudagym-site
# verl's wheels apart: verl's and TransferQueue's also install top-level `tests`, `recipe` and `scripts`
[ "$what" = verl ] && wheels+=(.whl_verl/*.whl) && site=/tmp/cudagym-verl-site
if compgen -G "${wheels[0]}" >/dev/null; then
  "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$site" "${wheels[@]}" \
    && export PYTHONPATH="$PYTHONPATH:$site"
fi
start=$SECONDS
case "$what" in
  tests)
    timeout -s INT -k 15 "${TIMEOUT_S:-540}" "$PYTHON" -m pytest -m gpu -q -rf "$@" 2>&1 | tee "$OUT/pytest_gpu.log"
    status=${PIPESTATUS[0]}
    echo "pytest -m gpu: exit $status after $((SECONDS - start)) s (124: timed out)" | tee -a "$OUT/pytest_gpu.log" ;;
  bench)
    timeout -s INT -k 15 "${TIMEOUT_S:-540}" "$PYTHON" benchmarks/bench_baselines.py --out "$OUT/bench_baselines.json" "$@" 2>&1 \
      | tee "$OUT/bench_baselines.log"
    status=${PIPESTATUS[0]}
    echo "bench_baselines.py: exit $status after $((SECONDS - start)) s (124: timed out)" | tee -a "$OUT/bench_baselines.log" ;;
  verl)
    timeout -s INT -k 15 "${TIMEOUT_S:-540}" "$PYTHON" benchmarks/verl_gpu_path.py --out "$OUT" "$@" 2>&1 \
      | tee "$OUT/verl_gpu_run.log"
    status=${PIPESTATUS[0]}
    echo "verl_gpu_path.py: exit $status after $((SECONDS - start)) s (124: timed out)" | tee -a "$OUT/verl_gpu_run.log" ;;
  *) echo "usage: OUT=dir bash benchmarks/run_gpu_suite.sh tests|bench|verl [args]" >&2; exit 2 ;;
esac
exit "$status"
