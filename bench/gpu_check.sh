#!/usr/bin/env bash
# The GPU check on a bare GPU machine (torch there, no network): install aegis' dependencies
# from the wheels carried in .whl/ (`make gpu-wheels` makes them), then run every part of
# bench/gpu_check.py, writing results to $OUT (the device tool's output folder) or
# bench/results. One command: `bash bench/gpu_check.sh`.
set -uo pipefail
cd "$(dirname "$0")/.."
OUTDIR="${OUT:-bench/results}"
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl || exit 2
  export PYTHONPATH="/tmp/site:${PYTHONPATH:-}"
fi
export PYTHONPATH="$PWD:${PYTHONPATH:-}" PYTHONUNBUFFERED=1 OMP_NUM_THREADS=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > "$OUTDIR/nvidia-smi.txt" 2>&1
df -h /dev/shm >> "$OUTDIR/nvidia-smi.txt" 2>&1
python3 bench/gpu_check.py --outdir "$OUTDIR" "$@" 2>&1 | tee "$OUTDIR/gpu_check.log"
