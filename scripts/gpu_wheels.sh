#!/usr/bin/env bash
# The wheels the lent GPU machine lacks, into .whl/ (git-ignored; the device tool carries it):
# pydantic and its dependencies, at the dev environment's versions, for its image (CPython 3.12,
# manylinux x86-64, no network). Ends by installing them with pip --no-index into a scratch
# folder for that platform, as scripts/gpu_check.sh does there.
set -euo pipefail
cd "$(dirname "$0")/.."
[ -x .venv/bin/python ] && . .venv/bin/activate
platform=(--only-binary=:all: --python-version 3.12 --implementation cp --abi cp312
  --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64)
pins=$(python - <<'PY'
import importlib.metadata as md
print(" ".join(f"{p}=={md.version(p)}" for p in
      ("pydantic", "pydantic-core", "annotated-types", "typing-inspection", "typing-extensions")))
PY
)
rm -rf .whl
python -m pip download --quiet --no-deps "${platform[@]}" -d .whl $pins
scratch=$(mktemp -d)
python -m pip install --quiet --no-index --no-deps "${platform[@]}" --target "$scratch" .whl/*.whl
ls "$scratch" | grep -q '^pydantic$'
rm -rf "$scratch"
echo "gpu_wheels: $(ls .whl | tr '\n' ' ')"
