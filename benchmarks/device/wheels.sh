#!/usr/bin/env bash
# Download into .whl/ the wheels the lent GPU machine lacks (it has no network), pinned to
# the versions installed in this environment's Python, for CPython 3.12 on x86-64 Linux.
#
#   bash benchmarks/device/wheels.sh          # PYTHON=... picks the interpreter to read
#                                             # versions from (default: .venv, else python3)
#
# What the device's image lacks (benchmarks/device/README.md):
#   beartype   tests/conftest.py checks every edl function's annotations with it
#   starlette  edl.serve.server imports it at module level, and conftest imports every
#   uvicorn    edl module (collection fails without them)
# Their own dependencies (anyio, typing_extensions; click, h11) are on the device already.
# run.sh installs .whl/*.whl into /tmp/site there; .whl/ is git-ignored and travels only
# when a run names it in `carry`. Older versions of these packages left in .whl/ are
# removed (two versions of one package stop the whole install).
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
cd "$ROOT"
if [ -n "${PYTHON:-}" ]; then
    PY="$PYTHON"
elif [ -x .venv/bin/python ]; then
    PY=.venv/bin/python
else
    PY=python3
fi
PACKAGES=(beartype starlette uvicorn)

mkdir -p .whl
for name in "${PACKAGES[@]}"; do
    version="$("$PY" -c "import importlib.metadata as m; print(m.version('$name'))")"
    # Keep one version per package: drop any other of this name.
    for old in .whl/"$name"-*.whl; do
        [ -e "$old" ] && [[ "$old" != .whl/"$name-$version"-* ]] && rm -v -- "$old"
    done
    "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
        --implementation cp --platform manylinux_2_28_x86_64 \
        --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
        -d .whl "$name==$version"
done
ls -l .whl
du -sh .whl
