#!/usr/bin/env bash
# The GPU checks, for a machine with CUDA, torch and Triton but no Ray or FastAPI: the Triton
# kernel matrix and the engine on CUDA (pytest -m gpu), the kernel benchmark, and one engine
# step of random-weight models (benchmarks/step_time.py) at both shapes, compiled and eager.
# Each log lands in $OUT (default ./gpu-checks); a failing step does not stop the later ones.
#
#   bash scripts/gpu_checks.sh [pytest|kernels|step]...    # default: all three
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-gpu-checks}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
python=${PYTHON:-python3}
steps=${*:-pytest kernels step}
status=0

run() {  # run LOG SECONDS CMD...: CMD's output to the terminal and $out/LOG
  local log=$1 limit=$2
  shift 2
  echo "== $* (limit ${limit}s)"
  timeout "$limit" "$@" 2>&1 | tee "$out/$log" || { echo "== FAILED ($?): $*"; status=1; }
}

nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.max.sm --format=csv \
  | tee "$out/device.txt"
$python -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__,
torch.cuda.get_device_name())" | tee -a "$out/device.txt"
for step in $steps; do
  case $step in
    pytest) run pytest_gpu.log 240 $python -m pytest -m gpu tests/kernels -q -p no:cacheprovider \
              -o cache_dir=/tmp/pytest-cache ;;
    kernels) run kernels.log 150 $python benchmarks/kernels.py ;;
    step)
      for shape in 100m 1b; do
        run "step_$shape.log" 150 $python benchmarks/step_time.py --device cuda --shape "$shape" \
          --dtype bfloat16 --modes compiled,eager --batches 1,4,32,64
      done ;;
    *) echo "unknown step $step"; exit 2 ;;
  esac
done
exit $status
