#!/usr/bin/env bash
# Set up, lint, run the whole test suite (unit tests and multi-process gloo tests), then the
# mutation gate (each planted bug must be caught by the tests meant to catch it).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
. .venv/bin/activate
export OMP_NUM_THREADS=1
ruff check src tests benchmarks examples scripts
python -m pytest -q
python scripts/mutants.py
