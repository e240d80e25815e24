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
lint-imports --no-cache  # pyproject.toml's layers: imports only point down
NO_MKDOCS_2_WARNING=1 mkdocs build --strict -q --site-dir "$(mktemp -d)"  # docs: pages, links
echo "lint: $((SECONDS - t0)) s"
# Two workers, a test file each at a time (the suite is CPU-bound on 2 cores: four workers took
# as long). The downstream examples run on ranks forked from tests/support/script_server.py.
python -m pytest -q -n 2 --dist loadfile "$@"
