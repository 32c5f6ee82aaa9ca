#!/usr/bin/env bash
# The one prepared GPU check of issue 16 (scripts/gpu_check.py says what it runs): on one H200
# in under 8 minutes, one JSON, OUT_DIR/gpu_check.json (default: $OUT, else runs/gpu_check).
# Run it from anywhere; it uses .venv/bin/python when there is one (else python3, e.g. the NGC
# container's), and installs this checkout into it (editable, no dependencies) if it is not yet.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=.venv/bin/python
[ -x "$PY" ] || PY=$(command -v python3)
if ! "$PY" -c "import megatron_ext.launch, megatron_ext.optimizers" 2>/dev/null; then
    "$PY" -m pip install --quiet --no-deps --no-build-isolation -e . || exit 1
fi
OUT_DIR=${1:-${OUT:-runs/gpu_check}}
exec "$PY" scripts/gpu_check.py --out "$OUT_DIR" --budget "${GPU_CHECK_BUDGET:-450}"
