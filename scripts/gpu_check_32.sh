#!/usr/bin/env bash
# The GPU check of issue 32 (items 3 and 4), one script, about 7 minutes on an H200 including the wheel install.
# Writes everything under $OUT:
#   (a) blockwise_probe.json/.log   torch's native blockwise scaled_mm (and torchao's Triton GEMM): works? SQNR vs
#                                   the emulated reference; time vs a bf16 matmul at Llama-3-8B shapes
#   (b) tests_gpu.log               tests/gpu/test_gpu_blockwise_kernels.py + test_gpu_fp8_gemm.py (pytest)
#   (c) step_1b_eager.json/.log     llama3_1b, 1 x 8192, eager: bf16, fp8_current, fp8_blockwise, deepseek_v3
#                                   (both tables with --profile: device busy vs wall per step, host ops, syncs,
#                                   top kernels: is the gap the device's or the host's?)
#       step_1b_eager_unfused.json  the same eager rows with train.fused_casts=off (benchmarks/fp8_host_time.py:
#                                   on a CPU a compiled cast costs more host time than the eager one)
#       step_8b8_compile.json/.log  Llama-3-8B layer shapes, 8 layers, 1 x 8192, compile + selective AC: bf16 and
#                                   lowprec's FP8 recipes with torchao's as peer rows (rows written as they finish;
#                                   this step gets what is left of BUDGET_S=420 s: about 3 compiled rows; run with
#                                   BUDGET_S=600 for more)
# Needs the wheels in runs/gpu_wheels (pytest + deps, torchao 0.18.0): run(command="bash scripts/gpu_check_32.sh",
# carry=["runs/gpu_wheels"]). `bash scripts/gpu_check_32.sh --dry` checks the script on a CPU (no timing).
set -u
DRY=0
[ "${1:-}" = "--dry" ] && DRY=1
OUT=${OUT:-$(mktemp -d)}
T0=$(date +%s)
BUDGET=${BUDGET_S:-420}  # the whole script, seconds; the last step gets what is left
log() { echo "[$(date -u +%H:%M:%S) +$(( $(date +%s) - T0 ))s] $*" | tee -a "$OUT/progress.log"; }
left() { echo $(( BUDGET - ($(date +%s) - T0) )); }
export PYTHONPATH=$PWD

log "gpu_check_32 start (dry=$DRY), OUT=$OUT"
if [ $DRY = 0 ]; then
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"
  log "installing carried wheels"
  ls runs/gpu_wheels/*.whl > "$OUT/wheels.txt" 2>&1 || log "no wheels in runs/gpu_wheels: pytest and torchao rows will be skipped"
  timeout 60 pip install -q --no-index --no-deps --target /tmp/pyt runs/gpu_wheels/*.whl > "$OUT/pip.log" 2>&1 || log "pip install failed (see pip.log)"
  export PYTHONPATH=/tmp/pyt:$PWD
else
  timeout 60 pip install -q --no-index --no-deps --target "/tmp/pyt_dry_$$" runs/gpu_wheels/*.whl > "$OUT/pip.log" 2>&1 && log "wheels install (dry: not used)" || log "pip install of runs/gpu_wheels failed (see $OUT/pip.log)"
fi
python -c "import torch, importlib.util as u; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'gpu', torch.cuda.get_device_name(0) if torch.cuda.is_available() else None, 'torchao', u.find_spec('torchao') is not None, 'triton', u.find_spec('triton') is not None, 'pytest', u.find_spec('pytest') is not None)" 2>&1 | grep -v -i warn | tee -a "$OUT/gpu.txt"
PY="python -W ignore"
DRYFLAG=""
[ $DRY = 1 ] && DRYFLAG="--dry-run"

log "(a) blockwise GEMM probe"
timeout -k 5 75 $PY benchmarks/blockwise_gemm_probe.py --reps 10 --out "$OUT/blockwise_probe.json" $DRYFLAG > "$OUT/blockwise_probe.log" 2>&1
log "(a) rc=$?"; grep -v -i "warn" "$OUT/blockwise_probe.log" | tail -25

log "(b) tests/gpu"
if [ $DRY = 1 ]; then
  timeout -k 5 120 python -m pytest -q -p no:cacheprovider -o addopts="" -m gpu --collect-only tests/gpu/test_gpu_blockwise_kernels.py tests/gpu/test_gpu_fp8_gemm.py > "$OUT/tests_gpu.log" 2>&1
else
  timeout -k 5 100 python -m pytest -q -p no:cacheprovider -o addopts="" -m gpu -rs tests/gpu/test_gpu_blockwise_kernels.py tests/gpu/test_gpu_fp8_gemm.py > "$OUT/tests_gpu.log" 2>&1
fi
log "(b) rc=$?"; tail -8 "$OUT/tests_gpu.log"

STEPS=${STEPS:-8}
log "(c1) llama3_1b eager"
timeout -k 5 90 $PY benchmarks/gpu_step_vs_model.py --model llama3_1b --seq 8192 --steps "$STEPS" --eager --profile \
  --recipes bf16,fp8_current,fp8_blockwise,deepseek_v3 --out "$OUT/step_1b_eager.json" $DRYFLAG > "$OUT/step_1b_eager.log" 2>&1
log "(c1) rc=$?"; grep -v -E "^W1|Warning|warn" "$OUT/step_1b_eager.log" | tail -12

log "(c1b) llama3_1b eager, fused casts off (is the compiled casts' host cost worth it on a GPU?)"
timeout -k 5 60 $PY benchmarks/gpu_step_vs_model.py --model llama3_1b --seq 8192 --steps "$STEPS" --eager --profile \
  --fused-casts off --recipes bf16,fp8_current,deepseek_v3 --out "$OUT/step_1b_eager_unfused.json" $DRYFLAG \
  > "$OUT/step_1b_eager_unfused.log" 2>&1
log "(c1b) rc=$?"; grep -v -E "^W1|Warning|warn" "$OUT/step_1b_eager_unfused.log" | tail -9

T=$(left); [ "$T" -lt 60 ] && T=60
log "(c2) Llama-3-8B layer shapes, 8 layers, compile + selective AC (limit ${T}s)"
timeout -k 5 "$T" $PY benchmarks/gpu_step_vs_model.py --model llama3_8b --layers 8 --seq 8192 --steps "$STEPS" \
  --recipes bf16,fp8_blockwise,deepseek_v3,fp8_rowwise,torchao_rowwise,fp8_current,fp8_tensorwise,torchao_blockwise,torchao_blockwise_triton \
  --profile --out "$OUT/step_8b8_compile.json" $DRYFLAG > "$OUT/step_8b8_compile.log" 2>&1
log "(c2) rc=$? (124: cut by the time limit; the rows that finished are in step_8b8_compile.json)"
grep -v -E "^W1|Warning|warn" "$OUT/step_8b8_compile.log" | tail -14
log "gpu_check_32 done"
