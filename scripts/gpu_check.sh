#!/usr/bin/env bash
# One prepared GPU check (session of 2026-11-26): accumulator measurement, tests/gpu GEMM tests, compile probe.
set -u
export PYTHONPATH=$PWD
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee $OUT/gpu.txt
python -c "import torch; print('torch', torch.__version__, torch.version.cuda, torch.cuda.get_device_name(0))" | tee -a $OUT/gpu.txt
date +%s > $OUT/t0
echo "== accumulation"; timeout 150 python benchmarks/hopper_accumulation.py --out $OUT/hopper_accumulation.json 2>&1 | tee $OUT/accumulation.log | tail -60
echo "== tests/gpu"; pip install -q --no-index --no-deps --target /tmp/pyt runs/gpu_wheels/*.whl >/dev/null 2>&1
PYTHONPATH=/tmp/pyt:$PWD timeout 150 python -m pytest -q -m gpu -o addopts="" -p no:cacheprovider tests/gpu/test_gpu_fp8_gemm.py tests/gpu/test_gpu_block_scaled_gemm.py 2>&1 | tee $OUT/tests_gpu.log | tail -15
echo "== compile probe"; timeout 240 python benchmarks/compile_probe.py --out $OUT/compile_probe.json --recipes fp8_current,deepseek_v3_tensorwise,deepseek_v3_no_fp8_cache,deepseek_v3 2>&1 | grep -v "^W1\|Warning" | tee $OUT/compile_probe.log | tail -20
echo "elapsed $(( $(date +%s) - $(cat $OUT/t0) )) s"
