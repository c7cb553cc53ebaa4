#!/usr/bin/env bash
# Brings CuPy to the GPU machine, which lacks it, and runs the candidate-language GPU tests there.
# Its CUDA 13 wheel (69 MB) is larger than the 64 MiB one device call carries. Two ways in:
#
# One call (preferred): the wheel repacked with LZMA, less the CUB/Thrust headers that only CuPy's
# own CUB-based kernels include (benchmarks/repack_wheel_lzma.py: 55.9 MB), which fits.
#   here:        bash benchmarks/stage_cupy.sh pack [DIR]    # DIR holds cupy_cuda13x-*.whl and
#                                                            # cuda_pathfinder-*.whl (pip download
#                                                            # --no-deps --python-version 3.12 --only-binary=:all:)
#   device:      OUT=$OUT bash benchmarks/stage_cupy.sh test  # carry [".whl", ".whl_cupy/packed"]
#
# Two calls: the wheel split in two parts, carried by consecutive calls. The machine keeps the
# tree's ignored files and /tmp between calls only while it stays warm (about 30 s after a call),
# so issue the second call right after the first.
#   here:        bash benchmarks/stage_cupy.sh split [DIR]
#   device, 1st: bash benchmarks/stage_cupy.sh receive        # carry [".whl_cupy/part1"]
#   device, 2nd: bash benchmarks/stage_cupy.sh receive && OUT=$OUT bash benchmarks/stage_cupy.sh test
#                                                            # carry [".whl", ".whl_cupy/part2"]
#
# .whl_cupy/ is ignored (.git/info/exclude). `test` installs CuPy into /tmp/cupy-site (from the
# parts it joins, else from .whl_cupy/packed), checks that CuPy runs a kernel on torch's memory and
# that its cache holds what `cudagym.sandbox.jit.cupy_kernels` reads (the cache and the kernel
# records go to $OUT/cupy_cache), then runs tests/test_candidate_languages.py's GPU tests through
# run_gpu_suite.sh (extra arguments go to pytest; logs in $OUT).
set -euo pipefail
cd "$(dirname "$0")/.."
parts=/tmp/cupy_parts site=/tmp/cupy-site
case "${1:-}" in
  pack)
    src=${2:-/tmp/cupyw}
    wheel=$(ls "$src"/cupy_cuda13x-*.whl | head -1)
    rm -rf .whl_cupy/packed && mkdir -p .whl_cupy/packed
    python3 benchmarks/repack_wheel_lzma.py "$wheel" ".whl_cupy/packed/$(basename "$wheel")" \
      --drop cupy/_core/include/cupy/_cccl/  # CUB, Thrust, libcu++: for CuPy's own CUB kernels only
    cp "$src"/cuda_pathfinder-*.whl .whl_cupy/packed/
    du -sh .whl_cupy/packed ;;
  split)
    src=${2:-/tmp/cupyw}
    wheel=$(ls "$src"/cupy_cuda13x-*.whl | head -1)
    rm -rf .whl_cupy/part1 .whl_cupy/part2 && mkdir -p .whl_cupy/part1 .whl_cupy/part2
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
    if compgen -G "$parts/cupy_cuda13x-*.whl.00" >/dev/null; then
      cd "$parts"
      wheel=$(ls cupy_cuda13x-*.whl.00 | sed 's/\.00$//')
      cat "$wheel".[0-9][0-9] > "$wheel"
      sha256sum -c SHA256SUM
      cd - >/dev/null
      wheels=("$parts/$wheel" "$parts"/cuda_pathfinder-*.whl)
    else
      wheels=(.whl_cupy/packed/*.whl)
    fi
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$site" "${wheels[@]}"
    export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"
    # CuPy finds NVRTC and runs a kernel on torch's memory (the tests skip, saying why, where it cannot)
    { python3 - <<'PY' 2>&1 || echo "CuPy's check failed"; } | tee "$OUT/cupy_import.log"
import cupy, torch
x = torch.zeros(4, device="cuda")
cupy.RawKernel('extern "C" __global__ void one(float* y) { y[threadIdx.x] = 1.0f; }', "one")((1,), (4,), (cupy.asarray(x),))
torch.cuda.synchronize()
print("cupy", cupy.__version__, "runtime", cupy.cuda.runtime.runtimeGetVersion(), "torch", torch.__version__, x.tolist())
PY
    # The example's kernel compiled as a job compiles it, and what the origin rule reads of its cache.
    rm -rf "$OUT/cupy_cache" && mkdir -p "$OUT/cupy_cache"
    { CUPY_CACHE_DIR="$OUT/cupy_cache" CUPY_CACHE_SAVE_CUDA_SOURCE=1 PYTHONPATH="$PWD:$PYTHONPATH" python3 - <<'PY' 2>&1 \
      || echo "the cache check failed"; } | tee -a "$OUT/cupy_import.log"
import hashlib, importlib.util, os, pathlib, torch
spec = importlib.util.spec_from_file_location("model_new", "examples/solutions/ew_scale_bias_gelu/cupy/model_new.py")
m = importlib.util.module_from_spec(spec)
spec.loader.exec_module(m)
from cudagym.sandbox.jit import cupy_kernels
from cudagym.sandbox.origin import image_extent
x = torch.randn(8, 16, device="cuda")
y = m.ModelNew(16, 1.7).cuda()(x)
torch.cuda.synchronize()
cache = pathlib.Path(os.environ["CUPY_CACHE_DIR"])
for f in sorted(cache.iterdir()):
    data = f.read_bytes()
    if f.suffix == ".cubin":
        payload = data[40:]
        print(f.name, len(data), "hash ok:", data[:40] == hashlib.sha1(payload).hexdigest().encode(),
              "head:", payload[:8], "extent:", image_extent(payload), "of", len(payload))
print("cupy_kernels:", cupy_kernels(cache))
PY
    bash benchmarks/run_gpu_suite.sh tests tests/test_candidate_languages.py -v "${@:2}" ;;
  *) echo "usage: bash benchmarks/stage_cupy.sh pack [DIR] | split [DIR] | receive | test [pytest args]" >&2; exit 2 ;;
esac
