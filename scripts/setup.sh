#!/usr/bin/env bash
# Create .venv with the CPU build of torch 2.13.0 first (so nothing pulls a CUDA build), then
# zerostack and its test tools. Safe to run again.
set -euo pipefail
cd "$(dirname "$0")/.."
[ -x .venv/bin/python ] || python3 -m venv .venv
. .venv/bin/activate
python -m pip install -q --upgrade pip >/dev/null
python -m pip install -q torch==2.13.0
python -m pip install -q -e ".[dev,docs]"
# the optional monitors' packages (extras tensorboard, wandb), pinned: tests/test_monitor.py
python -m pip install -q "tensorboard==2.21.0" "wandb==0.31.0"
# Hugging Face models, Trainer and Accelerate (extra hf), Lightning (extra lightning), pinned:
# tests/test_hf.py, test_hf_trainer.py, test_deepspeed_name.py, examples/hf_*.py
python -m pip install -q "transformers==5.24.0" "peft==0.21.2" "accelerate==1.16.0" \
    "lightning==2.6.6"
# TRL's trainers (extra trl), pinned: tests/test_trl.py, examples/trl_*.py
python -m pip install -q "trl==1.16.0" "datasets==5.2.0"
