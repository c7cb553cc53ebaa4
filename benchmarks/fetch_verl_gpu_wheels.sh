#!/usr/bin/env bash
# The wheels benchmarks/verl_gpu_path.py needs on the lent GPU machine beyond its image (Python 3.12,
# torch 2.11, transformers, numpy, pandas, pyarrow, aiohttp, ...) and beyond .whl (cudagym's own
# runtime dependencies: ../shared/device/fetch-wheels.sh), into .whl_verl/ (ignored through
# .git/info/exclude). docs/verl_gpu.md lists them with their sizes.
#
# The versions are the ones CI tests verl with (.ci/verl-nodeps.txt, the dev extra). Two are not
# PyPI's files as they are:
# - antlr4-python3-runtime 4.9.3 (hydra-core/omegaconf pin 4.9.*) is a source release only: built here
#   into a pure-Python wheel;
# - ray 2.60.0's wheel (76 MiB) is more than one device call carries (64 MiB with the working tree):
#   its Java jar and its dashboard's web client (42 MiB unpacked; neither is used by a Python driver
#   that starts Ray without a dashboard) are left out and its RECORD rewritten to match, giving ~38 MiB.
# Usage (from the repo root): bash benchmarks/fetch_verl_gpu_wheels.sh
set -euo pipefail
cd "$(git rev-parse --show-toplevel)"
grep -qx '/.whl_verl/' .git/info/exclude 2>/dev/null || echo '/.whl_verl/' >> .git/info/exclude
mkdir -p .whl_verl
pins=(
  verl==0.9.1 tensordict==0.10.0 pyvers==0.1.0 codetiming==1.4.0 orjson==3.13.0
  hydra-core==1.3.8 omegaconf==2.3.1 datasets==5.2.0 dill==0.4.1 multiprocess==0.70.19 torchdata==0.11.0
  transferqueue==0.1.11 pyzmq==27.3.0 msgspec==0.22.0
  jsonschema==4.26.0 jsonschema-specifications==2025.9.1 referencing==0.37.0 rpds-py==2026.9.1
  fastapi==0.115.12 starlette==0.46.2 uvicorn==0.54.0 cachetools==6.2.4
  datasketch==2.0.0  # cudagym's own (train prepare's contamination index), absent from the GPU image
)
plats=()
for p in manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_26_x86_64 manylinux_2_24_x86_64 \
         manylinux_2_17_x86_64 manylinux2014_x86_64 manylinux1_x86_64 any; do
  plats+=(--platform "$p")
done
dl=(python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp "${plats[@]}")
"${dl[@]}" -d .whl_verl "${pins[@]}"

tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
python3 -m pip download -q --no-deps --no-binary=:all: -d "$tmp" antlr4-python3-runtime==4.9.3
python3 -m pip wheel -q --no-deps --no-build-isolation -w .whl_verl "$tmp"/antlr4-python3-runtime-4.9.3.tar.gz

"${dl[@]}" -d "$tmp" ray==2.60.0
python3 - "$tmp"/ray-2.60.0-*.whl .whl_verl <<'EOF'
"""Copy ray's wheel without ray/jars/ and ray/dashboard/client/build/, its RECORD rewritten."""
import sys
import zipfile
from pathlib import Path

src, out_dir = Path(sys.argv[1]), Path(sys.argv[2])
drop = ("ray/jars/", "ray/dashboard/client/build/")
with zipfile.ZipFile(src) as zin, zipfile.ZipFile(out_dir / src.name, "w", zipfile.ZIP_DEFLATED, compresslevel=9) as zout:
    for info in zin.infolist():
        name = info.filename
        if name.startswith(drop):
            continue
        data = zin.read(info)
        if name.endswith(".dist-info/RECORD"):
            lines = data.decode().splitlines(keepends=True)
            data = "".join(line for line in lines if not line.startswith(drop)).encode()
        zout.writestr(info, data, compress_type=zipfile.ZIP_DEFLATED, compresslevel=9)
EOF
ls -l .whl_verl | awk 'NR > 1 {s += $5; printf "%8.2f MiB  %s\n", $5 / 1048576, $9} END {printf "%8.2f MiB  total\n", s / 1048576}'
du -sb .whl .whl_verl 2>/dev/null | awk '{s += $1} END {printf "with .whl: %.1f MiB to carry (the limit is 64 MiB with the working tree)\n", s / 1048576}'
