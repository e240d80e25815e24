#!/usr/bin/env bash
# Set up, lint, run the whole test suite (unit tests and multi-process gloo tests). Its last line
# is pytest's summary. The mutation gate is run by .ci/run (or by hand: scripts/mutants.py).
set -euo pipefail
cd "$(dirname "$0")/.."
t0=$SECONDS
bash scripts/setup.sh
echo "setup: $((SECONDS - t0)) s"
. .venv/bin/activate
export OMP_NUM_THREADS=1
t0=$SECONDS
ruff check src tests benchmarks examples scripts
echo "lint: $((SECONDS - t0)) s"
python -m pytest -q "$@"
