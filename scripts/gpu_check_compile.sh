#!/usr/bin/env bash
# The second GPU check of 2026-11-26 (an H200 through the device tool): the compile probe on tiny and compiled
# llama3_1b step times. It bypassed cuda_compile_blocker then; that refusal is gone. Writes under $OUT.
set -u
export PYTHONPATH=$PWD
python -c "import torch; print('torch', torch.__version__, torch.cuda.get_device_name(0))"
echo "== compile probe (tiny)"; timeout 200 python benchmarks/compile_probe.py --model tiny --out $OUT/compile_probe_tiny.json --recipes fp8_current,deepseek_v3_no_fp8_cache,deepseek_v3,fp8_blockwise 2>&1 | grep -E "recipe|variant|probe:" | tee $OUT/compile_probe.log
echo "== step timing llama3_1b compile+selective AC"
timeout 330 python -c "
import sys
sys.path.insert(0, 'benchmarks')
import gpu_step_vs_model as g
sys.exit(g.main(['--model', 'llama3_1b', '--steps', '10', '--recipes', 'bf16,fp8_current,deepseek_v3,fp8_blockwise', '--out', '$OUT/step_llama3_1b.json']))
" 2>&1 | grep -vE "^W1|Warning|warn" | tail -15
