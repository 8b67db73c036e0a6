#!/usr/bin/env bash
# The GPU checks, for a machine with CUDA, torch and Triton but no Ray or FastAPI: the Triton
# kernel matrix and the engine on CUDA (pytest -m gpu), the kernel benchmark, and one engine
# step of random-weight models (benchmarks/step_time.py) at every shape (Llama, MoE, MLA),
# compiled and eager. Each log lands in $OUT (default ./gpu-checks); a failing step does not
# stop the later ones.
#
#   bash scripts/gpu_checks.sh [warm|pytest|kernels|step]...    # default: all four
#
# `warm` compiles every shape's runner in the background while the steps before `kernels` run,
# so the timed steps find Inductor's cache filled (their "ready" times are then warm-cache ones;
# warm.log has the cold ones, taken side by side with pytest). `kernels` and `step` wait for it,
# so nothing else runs on the device while they time.
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-gpu-checks}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
python=${PYTHON:-python3}
steps=${*:-warm pytest kernels step}
shapes=${STEP_SHAPES:-1b 100m mixtral-100m deepseek-100m}
status=0
warm_pid=
marks=$(mktemp -d)  # a shape the warm-up could not compile

run() {  # run LOG SECONDS CMD...: CMD's output to the terminal and $out/LOG
  local log=$1 limit=$2
  shift 2
  echo "== $* (limit ${limit}s)"
  timeout "$limit" "$@" 2>&1 | tee "$out/$log" || { echo "== FAILED ($?): $*"; status=1; }
}

quiet() {  # wait for the background warm-up, so that a timed step runs alone
  if [ -n "$warm_pid" ]; then wait "$warm_pid"; warm_pid=; echo "== warm-up done"; fi
}

step_modes() {  # compiled and eager; eager alone where the warm-up could not compile the shape
  if [ -e "$marks/no_compile_$1" ]; then echo eager; else echo compiled,eager; fi
}

nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.max.sm --format=csv \
  | tee "$out/device.txt"
$python -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__,
torch.cuda.get_device_name())" | tee -a "$out/device.txt"
for step in $steps; do
  case $step in
    warm)
      (
        for shape in $shapes; do
          { timeout 300 $python benchmarks/step_time.py --device cuda --shape "$shape" \
              --dtype bfloat16 --modes compiled --batches 1 --repeats 1 > "$out/warm_$shape.log" 2>&1 \
              || touch "$marks/no_compile_$shape"; } &
        done
        wait
        for log in "$out"/warm_*.log; do  # one file back per step: $OUT returns 8 at most
          echo "== $log"; grep "ready in" "$log" || tail -25 "$log"
        done > "$out/warm.log"
        rm "$out"/warm_*.log
      ) &
      warm_pid=$! ;;
    pytest) run pytest_gpu.log 300 $python -m pytest -m gpu tests/kernels -q -p no:cacheprovider \
              -o cache_dir=/tmp/pytest-cache ;;
    kernels) quiet; run kernels.log 150 $python benchmarks/gpu_kernels.py ;;
    step)
      quiet
      for shape in $shapes; do
        run "step_$shape.log" 150 $python benchmarks/step_time.py --device cuda --shape "$shape" \
          --dtype bfloat16 --modes "$(step_modes "$shape")" --batches 1,4,32,64
      done ;;
    *) echo "unknown step $step"; exit 2 ;;
  esac
done
quiet
exit $status
