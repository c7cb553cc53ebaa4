#!/usr/bin/env bash
# Ray for a machine whose Python lacks it (the GPU machines' image): the Ray wheel trimmed to what
# an `EvalPool` needs (no Java jars, no RLlib/Tune/Train/Data/Serve/LLM libraries, no dashboard
# web client), with jsonschema and its dependencies (Ray's one core requirement that image lacks),
# unpacked and packed again as one xz tarball, about 40 MB (the wheel is 79 MB, over what a
# device call may carry).
#
# Here, once (downloads with pip; needs network):
#   bash benchmarks/ray_bundle.sh [PYTHON_VERSION]     # default 3.12, the GPU image's
#   -> .raysite/ray-site-cpXY.tar.xz  (.raysite is ignored through .git/info/exclude)
# There, in the command (carry .raysite):
#   mkdir -p /tmp/ray-site && tar xJf .raysite/ray-site-cp312.tar.xz -C /tmp/ray-site \
#     && export PYTHONPATH=/tmp/ray-site${PYTHONPATH:+:$PYTHONPATH}
# (`EvalPool.start` hands PYTHONPATH to Ray's workers.)
set -euo pipefail
cd "$(dirname "$0")/.."
pyver=${1:-3.12}
tag=cp${pyver/./}
RAY_VERSION=${RAY_VERSION:-2.60.0}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
python3 -m pip download -q --no-deps --only-binary=:all: --python-version "$pyver" --implementation cp \
  --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64 \
  -d "$work/whl" "ray==$RAY_VERSION" jsonschema jsonschema-specifications referencing rpds-py
mkdir -p "$work/site"
for w in "$work"/whl/*.whl; do
  python3 -m zipfile -e "$w" "$work/site"
done
rm -rf "$work"/site/ray/{jars,rllib,tune,train,data,serve,llm} "$work"/site/ray/dashboard/client/build
find "$work/site" -name '__pycache__' -prune -exec rm -rf {} +
chmod +x "$work"/site/ray/core/src/ray/gcs/gcs_server "$work"/site/ray/core/src/ray/raylet/raylet
mkdir -p .raysite
grep -qx '/.raysite/' .git/info/exclude 2>/dev/null || echo '/.raysite/' >> .git/info/exclude
tar -C "$work/site" -cJf ".raysite/ray-site-$tag.tar.xz" .
ls -la ".raysite/ray-site-$tag.tar.xz"
