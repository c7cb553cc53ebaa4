#!/usr/bin/env bash
# The GPU machine's one command: the GPU tests (`pytest -m gpu`), then the timing-fidelity
# benchmark (benchmarks/bench_baselines.py). Logs and the benchmark's raw numbers go to $OUT:
#   pytest_gpu.log, bench_baselines.log (progress and tables), bench_baselines.json
# A failing or timed-out pytest does not stop the benchmark; the exit status is 1 if either failed.
# A time limit interrupts with SIGINT, so pytest still prints its summary of failures so far.
# Wall time, under 10 minutes in all: pytest at most $PYTEST_TIMEOUT_S (default 240 s; the GPU
# tests need more than that on an H100, so the last ones are cut), the benchmark at most
# $BENCH_TIMEOUT_S (default 330 s; it took 230-300 s on an H100, and writes its JSON after each
# phase, so a cut run keeps what it measured).
# Wheels in ./.whl (the project's dependencies the GPU image lacks) are installed first, if present.
# Extra arguments go to bench_baselines.py (e.g. --quick, --problems a,b).
set -uo pipefail
cd "$(dirname "$0")/.."
: "${OUT:?set OUT to the folder that receives the logs}"
mkdir -p "$OUT"
PYTHON=${PYTHON:-python3}
export PYTHONUNBUFFERED=1
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
if compgen -G ".whl/*.whl" >/dev/null; then
  "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/cudagym-site .whl/*.whl \
    && export PYTHONPATH="$PYTHONPATH:/tmp/cudagym-site"
fi

start=$SECONDS
timeout -s INT -k 15 "${PYTEST_TIMEOUT_S:-240}" "$PYTHON" -m pytest -m gpu -q 2>&1 | tee "$OUT/pytest_gpu.log"
tests=${PIPESTATUS[0]}
echo "pytest -m gpu: exit $tests after $((SECONDS - start)) s (124: timed out)" | tee -a "$OUT/pytest_gpu.log"

start=$SECONDS
timeout -s INT -k 15 "${BENCH_TIMEOUT_S:-330}" "$PYTHON" benchmarks/bench_baselines.py --out "$OUT/bench_baselines.json" "$@" 2>&1 \
  | tee "$OUT/bench_baselines.log"
bench=${PIPESTATUS[0]}
echo "bench_baselines.py: exit $bench after $((SECONDS - start)) s (124: timed out)" | tee -a "$OUT/bench_baselines.log"

[ "$tests" -eq 0 ] && [ "$bench" -eq 0 ]
