#!/usr/bin/env bash
# The device check for a lent GPU (or a Delta GPU node): one prepared run, results in $OUT.
#   device tool:  run(command="bash scripts/gpu_check.sh", timeout_s=560)
#   Delta:        sbatch scripts/delta_gpu.sbatch
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1 OUT="${OUT:-bench/results}"
mkdir -p "$OUT"
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm --format=csv 2>&1 | tee "$OUT/nvidia-smi.txt"
PY="${PYTHON:-python3}"
"$PY" -c "import jax; print('jax', jax.__version__, jax.devices())" 2>&1 | tee "$OUT/jax.txt"
# moajax runs from the source tree: its runtime needs are jax, numpy and absl only
PYTHONPATH="$PWD:$PWD/tests${PYTHONPATH:+:$PYTHONPATH}" timeout 520 "$PY" scripts/gpu_check.py --budget 470 "$@" 2>&1 | tee "$OUT/gpu_check.log"
