#!/usr/bin/env bash
# The prepared GPU checks, one script: each check is a function below, picked by name on the command line (default:
# all, in the order listed by --list). Everything is written under $OUT (a new temporary folder when unset), with
# progress.log saying when each check started and its exit code.
#
#   bash scripts/gpu_check.sh [--dry] [--list] [CHECK ...]
#
#   gemm_tests       tests/gpu: FP8 GEMMs, block-scaled GEMMs, blockwise kernels (pytest)      tests_gpu.log
#   blockwise_probe  torch's native blockwise scaled_mm (and torchao's Triton GEMM): works? SQNR against the emulated
#                    reference; time against a bf16 matmul at Llama-3-8B shapes                 blockwise_probe.json
#   accumulation     Hopper's FP8 accumulator measured directly (fit it later on any machine)   hopper_accumulation.json
#   compile_probe    which FP8 recipes torch.compile(fullgraph=True) traces, and why not       compile_probe.json
#   step_1b_eager    llama3_1b, 1 x 8192, eager, --profile: device busy against wall per step, host ops, syncs, top
#                    kernels (is the gap the device's or the host's?)                          step_1b_eager.json
#   step_1b_unfused  the same with train.fused_casts=off (do the compiled casts' host costs pay on a GPU?)
#   step_1b_compile  llama3_1b, compile + selective AC                                         step_1b_compile.json
#   step_8b_compile  Llama-3-8B layer shapes, 8 layers, 1 x 8192, compile + selective AC: bf16 and lowprec's FP8
#                    recipes with torchao's as peer rows, rows written as they finish          step_8b8_compile.json
#
# Time: BUDGET_S (default 540 s, under the device tool's 600 s per command) is the whole script's; each check runs
# under the smaller of its own limit and what is left, and is skipped when under 30 s are left, so `all` does not
# fit: name the checks a session needs (the last one named gets what is left). STEPS (default 8) sets the step tables'
# steps; PROBE_MODEL (default debug) the compile probe's model.
#
# Wheels: the GPU machine's image has torch and triton but not pytest, torchao, MLflow or Hydra, and no network. The
# wheels in runs/gpu_wheels (Python 3.12 manylinux x86_64, made here with `pip download --only-binary=:all:
# --python-version 3.12 --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux2014_x86_64
# --platform any ...`, less what the image already has; antlr4-python3-runtime 4.9.3 has no wheel: `pip wheel
# antlr4-python3-runtime==4.9.3 --no-deps`) travel with the command and are installed with `pip install --no-index
# --no-deps --target /tmp/pyt`, then PYTHONPATH=/tmp/pyt:<repo>:
#
#   run(command="bash scripts/gpu_check.sh gemm_tests step_8b_compile", carry=["runs/gpu_wheels"])
#
# Without them the pytest check fails and the torchao peer rows are skipped with their reason. `--dry` checks the
# script on a CPU: arguments, recipes and shapes (--dry-run / --collect-only / --help of each step), no timing.
set -u

CHECKS=(gemm_tests blockwise_probe accumulation compile_probe step_1b_eager step_1b_unfused step_1b_compile
  step_8b_compile)
DRY=0
PICKED=()
for a in "$@"; do
  case "$a" in
    --dry) DRY=1 ;;
    --list) printf '%s\n' "${CHECKS[@]}"; exit 0 ;;
    -*) echo "gpu_check.sh: unknown option $a (--dry, --list)" >&2; exit 2 ;;
    *)
      if [[ " ${CHECKS[*]} " != *" $a "* ]]; then
        echo "gpu_check.sh: unknown check '$a'; known: ${CHECKS[*]}" >&2
        exit 2
      fi
      PICKED+=("$a")
      ;;
  esac
done
[ ${#PICKED[@]} -eq 0 ] && PICKED=("${CHECKS[@]}")

OUT=${OUT:-$(mktemp -d)}
T0=$(date +%s)
BUDGET=${BUDGET_S:-540}
STEPS=${STEPS:-8}
PYTHON=${PYTHON:-python}
PY="$PYTHON -W ignore"
DRYFLAG=""
[ $DRY = 1 ] && DRYFLAG="--dry-run"
log() { echo "[$(date -u +%H:%M:%S) +$(($(date +%s) - T0))s] $*" | tee -a "$OUT/progress.log"; }
left() { echo $((BUDGET - ($(date +%s) - T0))); }
quiet() { grep -v -E "^W1|Warning|warn" "$1" | tail -"$2"; }
# a script without --dry-run: --help at least imports it and its lowprec modules
help_only() { $PY "$1" --help > /dev/null; }

check_gemm_tests() {
  local files=(tests/gpu/test_gpu_fp8_gemm.py tests/gpu/test_gpu_block_scaled_gemm.py
    tests/gpu/test_gpu_blockwise_kernels.py)
  if [ $DRY = 1 ]; then
    timeout -k 5 "$1" $PYTHON -m pytest -q -p no:cacheprovider -o addopts="" -m gpu --collect-only "${files[@]}" \
      > "$OUT/tests_gpu.log" 2>&1
  else
    timeout -k 5 "$1" $PYTHON -m pytest -q -p no:cacheprovider -o addopts="" -m gpu -rs "${files[@]}" \
      > "$OUT/tests_gpu.log" 2>&1
  fi
  local rc=$?
  tail -8 "$OUT/tests_gpu.log"
  return $rc
}

check_blockwise_probe() {
  timeout -k 5 "$1" $PY benchmarks/blockwise_gemm_probe.py --reps 10 --out "$OUT/blockwise_probe.json" $DRYFLAG \
    > "$OUT/blockwise_probe.log" 2>&1
  local rc=$?
  quiet "$OUT/blockwise_probe.log" 25
  return $rc
}

check_accumulation() {
  [ $DRY = 1 ] && { help_only benchmarks/hopper_accumulation.py; return; }
  timeout -k 5 "$1" $PY benchmarks/hopper_accumulation.py --out "$OUT/hopper_accumulation.json" \
    > "$OUT/accumulation.log" 2>&1
  local rc=$?
  quiet "$OUT/accumulation.log" 60
  return $rc
}

check_compile_probe() {
  [ $DRY = 1 ] && { help_only benchmarks/compile_probe.py; return; }
  timeout -k 5 "$1" $PY benchmarks/compile_probe.py --model "${PROBE_MODEL:-debug}" --out "$OUT/compile_probe.json" \
    --recipes fp8_current,fp8_blockwise,deepseek_v3_tensorwise,deepseek_v3_no_fp8_cache,deepseek_v3 \
    > "$OUT/compile_probe.log" 2>&1
  local rc=$?
  quiet "$OUT/compile_probe.log" 20
  return $rc
}

# step NAME LIMIT ARGS...: one table of benchmarks/gpu_step_vs_model.py into NAME.json / NAME.log
step() {
  local name=$1 limit=$2
  shift 2
  timeout -k 5 "$limit" $PY benchmarks/gpu_step_vs_model.py --steps "$STEPS" "$@" --out "$OUT/$name.json" $DRYFLAG \
    > "$OUT/$name.log" 2>&1
  local rc=$?
  quiet "$OUT/$name.log" 12
  return $rc
}

check_step_1b_eager() {
  step step_1b_eager "$1" --model llama3_1b --seq 8192 --eager --profile \
    --recipes bf16,fp8_current,fp8_blockwise,deepseek_v3
}

check_step_1b_unfused() {
  step step_1b_eager_unfused "$1" --model llama3_1b --seq 8192 --eager --profile --fused-casts off \
    --recipes bf16,fp8_current,deepseek_v3
}

check_step_1b_compile() {
  step step_1b_compile "$1" --model llama3_1b --recipes bf16,fp8_current,deepseek_v3,fp8_blockwise
}

check_step_8b_compile() {
  step step_8b8_compile "$1" --model llama3_8b --layers 8 --seq 8192 --profile \
    --recipes bf16,fp8_blockwise,deepseek_v3,fp8_rowwise,torchao_rowwise,fp8_current,fp8_tensorwise,torchao_blockwise,torchao_blockwise_triton
}

# each check's own limit, seconds; the last check picked gets what is left instead
declare -A LIMIT=([gemm_tests]=150 [blockwise_probe]=75 [accumulation]=150 [compile_probe]=240 [step_1b_eager]=90
  [step_1b_unfused]=60 [step_1b_compile]=330 [step_8b_compile]=420)

export PYTHONPATH=$PWD
log "gpu_check start (dry=$DRY): ${PICKED[*]}; OUT=$OUT"
if compgen -G "runs/gpu_wheels/*.whl" > /dev/null; then
  ls runs/gpu_wheels/*.whl > "$OUT/wheels.txt"
  if [ $DRY = 0 ]; then
    timeout 60 pip install -q --no-index --no-deps --target /tmp/pyt runs/gpu_wheels/*.whl > "$OUT/pip.log" 2>&1 \
      || log "pip install of runs/gpu_wheels failed (see pip.log)"
    export PYTHONPATH=/tmp/pyt:$PWD
  else  # installed to see that they install, not used: this machine's environment has the packages
    timeout 60 pip install -q --no-index --no-deps --target "/tmp/pyt_dry_$$" runs/gpu_wheels/*.whl \
      > "$OUT/pip.log" 2>&1 && log "wheels install (dry: not used)" \
      || log "pip install of runs/gpu_wheels failed (see $OUT/pip.log)"
    rm -rf "/tmp/pyt_dry_$$"
  fi
else
  log "no wheels in runs/gpu_wheels: on the GPU machine the pytest check fails and the torchao rows are skipped"
fi
[ $DRY = 0 ] && nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"
$PYTHON -c "import torch, importlib.util as u; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'gpu', torch.cuda.get_device_name(0) if torch.cuda.is_available() else None, 'torchao', u.find_spec('torchao') is not None, 'triton', u.find_spec('triton') is not None, 'pytest', u.find_spec('pytest') is not None)" 2>&1 | grep -v -i warn | tee -a "$OUT/gpu.txt"

FAILED=0
LAST=${PICKED[${#PICKED[@]} - 1]}
for c in "${PICKED[@]}"; do
  T=$(left)
  if [ "$T" -lt 30 ]; then
    log "$c skipped: ${T}s of BUDGET_S=$BUDGET left"
    FAILED=1
    continue
  fi
  [ "$c" != "$LAST" ] && [ "${LIMIT[$c]}" -lt "$T" ] && T=${LIMIT[$c]}
  log "$c (limit ${T}s)"
  "check_$c" "$T"
  rc=$?
  [ $rc != 0 ] && FAILED=1
  log "$c rc=$rc$([ $rc = 124 ] && echo " (cut by the time limit; what finished is in its files)")"
done
log "gpu_check done"
exit $FAILED
