#!/usr/bin/env bash
# Set up, lint, and run the whole test suite (unit tests and multi-process gloo tests).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
. .venv/bin/activate
export OMP_NUM_THREADS=1
ruff check src tests benchmarks examples
python -m pytest -q
