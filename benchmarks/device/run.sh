#!/usr/bin/env bash
# One prepared device run: environment, GPU tests, attention, train step, decode, serving.
#
#   bash benchmarks/device/run.sh [--dry-run] [--budget SECONDS] [--sections a,b,...]
#
# Writes device.json, device.md, run.log and tests.log to $OUT (default
# benchmarks/results/device). Installs the wheels carried in .whl/ (not in a dry run) into
# /tmp/site, never reaches the network, and ends within the budget (default 540 s, plus
# 30 s of grace before this script kills the driver). PYTHON picks the interpreter
# (default python3). See benchmarks/device/README.md.
set -uo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
cd "$ROOT" || exit 2
PY="${PYTHON:-python3}"
OUT="${OUT:-$ROOT/benchmarks/results/device}"
mkdir -p "$OUT"
OUT="$(cd "$OUT" && pwd)"
export OUT

BUDGET=540
DRY=0
args=("$@")
while [ $# -gt 0 ]; do
    case "$1" in
        --budget) BUDGET="${2:?--budget needs seconds}"; shift ;;
        --budget=*) BUDGET="${1#--budget=}" ;;
        --dry-run) DRY=1 ;;
    esac
    shift
done
BUDGET="${BUDGET%.*}"

SITE=/tmp/site
if [ "$DRY" = 1 ]; then
    EDL_DEVICE_WHEELS="not installed (dry run)"
elif compgen -G ".whl/*.whl" >/dev/null; then
    if "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target "$SITE" .whl/*.whl; then
        EDL_DEVICE_WHEELS="installed: $(cd .whl && ls -- *.whl | tr '\n' ' ')"
    else
        EDL_DEVICE_WHEELS="pip install of .whl/*.whl FAILED"
    fi
else
    EDL_DEVICE_WHEELS="none (no .whl/ folder)"
fi
export EDL_DEVICE_WHEELS
echo "wheels: $EDL_DEVICE_WHEELS"

export PYTHONPATH="$ROOT:$SITE${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
# Nothing here may reach the network (the device has none; a dry run must not either).
export PIP_NO_INDEX=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_DATASETS_OFFLINE=1

timeout -k 10 "$((BUDGET + 30))" "$PY" -m benchmarks.device.run --out "$OUT" ${args[@]+"${args[@]}"} \
    2>&1 | tee "$OUT/run.log"
exit "${PIPESTATUS[0]}"
