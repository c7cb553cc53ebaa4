#!/usr/bin/env bash
# Brings CuPy to the GPU machine, which lacks it, and runs the candidate-language GPU tests there.
# Its CUDA 13 wheel (69 MB) is larger than the 64 MiB one device call carries, so it travels in two
# parts over two consecutive calls; the machine keeps the tree's ignored files between calls only
# while it stays warm (about 30 s after a call), so issue the second call right after the first.
#
#   here:        bash benchmarks/stage_cupy.sh split [DIR]   # DIR holds cupy_cuda13x-*.whl and
#                                                            # cuda_pathfinder-*.whl (pip download
#                                                            # --no-deps --python-version 3.12 --only-binary=:all:)
#   device, 1st: bash benchmarks/stage_cupy.sh receive        # carry [".whl_cupy/part1"]
#   device, 2nd: bash benchmarks/stage_cupy.sh receive && OUT=$OUT bash benchmarks/stage_cupy.sh test
#                                                            # carry [".whl", ".whl_cupy/part2"]
#
# `split` writes .whl_cupy/part1 (the first 35 MiB and cuda-pathfinder) and .whl_cupy/part2 (the
# rest); .whl_cupy/ is ignored (.git/info/exclude). `receive` keeps the parts it was carried in
# /tmp/cupy_parts; `test` joins them, installs CuPy into /tmp/cupy-site and runs
# tests/test_candidate_languages.py's GPU tests through run_gpu_suite.sh (logs in $OUT).
set -euo pipefail
cd "$(dirname "$0")/.."
parts=/tmp/cupy_parts site=/tmp/cupy-site
case "${1:-}" in
  split)
    src=${2:-/tmp/cupyw}
    wheel=$(ls "$src"/cupy_cuda13x-*.whl | head -1)
    rm -rf .whl_cupy && mkdir -p .whl_cupy/part1 .whl_cupy/part2
    split -b 35m -d "$wheel" ".whl_cupy/part1/$(basename "$wheel")."
    mv .whl_cupy/part1/*.whl.0[1-9] .whl_cupy/part2/
    cp "$src"/cuda_pathfinder-*.whl .whl_cupy/part1/
    (cd "$(dirname "$wheel")" && sha256sum "$(basename "$wheel")") > .whl_cupy/part1/SHA256SUM
    du -sh .whl_cupy/part* ;;
  receive)
    mkdir -p "$parts"
    cp -v .whl_cupy/part*/* "$parts"/ ;;
  test)
    : "${OUT:?set OUT to the folder that receives the logs}"
    mkdir -p "$OUT"
    cd "$parts"
    wheel=$(ls cupy_cuda13x-*.whl.00 | sed 's/\.00$//')
    cat "$wheel".[0-9][0-9] > "$wheel"
    sha256sum -c SHA256SUM
    cd - >/dev/null
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$site" \
      "$parts/$wheel" "$parts"/cuda_pathfinder-*.whl
    export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"
    python3 - <<'PY' 2>&1 | tee "$OUT/cupy_import.log"  # CuPy finds NVRTC and runs a kernel on torch's memory
import cupy, torch
x = torch.zeros(4, device="cuda")
cupy.RawKernel('extern "C" __global__ void one(float* y) { y[threadIdx.x] = 1.0f; }', "one")((1,), (4,), (cupy.asarray(x),))
torch.cuda.synchronize()
print("cupy", cupy.__version__, "runtime", cupy.cuda.runtime.runtimeGetVersion(), "torch", torch.__version__, x.tolist())
PY
    bash benchmarks/run_gpu_suite.sh tests tests/test_candidate_languages.py -v "${@:2}" ;;
  *) echo "usage: bash benchmarks/stage_cupy.sh split [DIR] | receive | test [pytest args]" >&2; exit 2 ;;
esac
