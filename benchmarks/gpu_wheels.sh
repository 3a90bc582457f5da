#!/usr/bin/env bash
# Fetches the wheels that benchmarks/gpu.sh needs on a GPU machine without
# keras (the lent machines have Python 3.12, jax, torch and timm, but not
# keras, namex or optree) into .whl/, which git ignores. Run it where pip can
# reach the package index; the versions are the ones installed here, so the GPU
# run uses the keras that the tests pass with.
#
#   bash benchmarks/gpu_wheels.sh          # PY_VERSION=3.12 by default
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
version() { "$PY" -c "import importlib.metadata as m; print(m.version('$1'))"; }
mkdir -p .whl
rm -f .whl/*.whl
"$PY" -m pip download -q --no-deps --only-binary=:all: \
    --python-version "${PY_VERSION:-3.12}" --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    -d .whl "keras==$(version keras)" "namex==$(version namex)" "optree==$(version optree)"
ls -l .whl
