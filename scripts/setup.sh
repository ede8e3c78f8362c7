#!/usr/bin/env bash
# Create .venv (if missing) and install lowprec with the lab and test extras. Idempotent: a second call is quick.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
if ! .venv/bin/python -c "import lowprec, torch, torchao, bitsandbytes, hydra, mlflow, tokenizers, matplotlib, tqdm, scipy, statsmodels, filelock, markdown_it, jinja2, rich, psutil, submitit, datasets, pytest, xdist, playwright, mkdocs" 2>/dev/null \
    || [ ! -x .venv/bin/ruff ]; then
  .venv/bin/python -m pip install -q --upgrade pip
  if ! command -v nvidia-smi >/dev/null 2>&1; then
    # No GPU: the CPU build of torch (on the lab's CPU machines a local wheel; ~20 s).
    .venv/bin/python -m pip install -q "torch==2.13.0"
  fi
  # The library, the lab (`lab` extra: Hydra, MLflow, the report) and the test tools.
  .venv/bin/python -m pip install -q -e ".[lab,dev]"
fi
