#!/usr/bin/env bash
# Set up, then train the reference GPT on the bundled corpus on 2 CPU ranks (a few minutes).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
. .venv/bin/activate
zerostack train "$@"
