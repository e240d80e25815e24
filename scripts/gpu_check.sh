#!/usr/bin/env bash
# zerostack's GPU checks (issues 17, 37), for a machine with CUDA: one JSON line per check as it
# ends, then a summary line; exit code 1 if any failed. Each check runs in its own process with
# at most 120 s, the whole within GPU_CHECK_BUDGET seconds (540: one device call of 10 minutes
# with room to spare); a check the budget no longer fits is reported skipped. The lines also go
# to $OUT/gpu_check.jsonl (the device tool brings $OUT back), stderr to $OUT/gpu_check.err.
#
# The lent machine's image has torch but not pydantic: without it, the wheels in .whl/ (made
# here by scripts/gpu_wheels.sh, carried along) are installed with pip --no-index into a
# temporary folder first. See docs/guides/gpu.md.
set -uo pipefail
cd "$(dirname "$0")/.."
[ -x .venv/bin/python3 ] && . .venv/bin/activate
PY=python3
out=${OUT:-$(mktemp -d)}
mkdir -p "$out"
log="$out/gpu_check.jsonl"
: >"$log"
deadline=$((SECONDS + ${GPU_CHECK_BUDGET:-540}))
line() { echo "$1" | tee -a "$log"; }

if ! $PY -c "import pydantic" 2>/dev/null; then
  if ! ls .whl/*.whl >/dev/null 2>&1; then
    line '{"check": "install", "ok": false, "why": "no pydantic and no .whl/: run scripts/gpu_wheels.sh here and carry .whl"}'
    exit 1
  fi
  site=$(mktemp -d)/site
  if ! $PY -m pip install --quiet --no-index --target "$site" .whl/*.whl 2>>"$out/gpu_check.err"; then
    line '{"check": "install", "ok": false, "why": "pip install --no-index .whl/*.whl failed (see gpu_check.err)"}'
    exit 1
  fi
  export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONPATH="src${PYTHONPATH:+:$PYTHONPATH}"
export TORCH_NCCL_ASYNC_ERROR_HANDLING=3 OMP_NUM_THREADS=${OMP_NUM_THREADS:-4}

# run NAME SECONDS CMD...: CMD's JSON lines into the log; a timeout or a crash is a failed line
run() {
  local name=$1 limit=$2 left=$((deadline - SECONDS))
  shift 2
  if ((left < 30)); then
    line "{\"check\": \"$name\", \"ok\": null, \"skipped\": \"out of time (GPU_CHECK_BUDGET)\"}"
    return
  fi
  ((limit > left)) && limit=$left
  local tmp
  tmp=$(mktemp)
  timeout --kill-after=10 "$limit" "$@" >"$tmp" 2>>"$out/gpu_check.err"
  local rc=$?
  grep '^{' "$tmp" | tee -a "$log"
  if ((rc == 124)); then
    line "{\"check\": \"$name\", \"ok\": false, \"timeout_s\": $limit}"
  elif ((rc != 0)) && ! grep -q '"ok": false' "$tmp"; then
    line "{\"check\": \"$name\", \"ok\": false, \"exit\": $rc, \"log\": \"gpu_check.err\"}"
  fi
  rm -f "$tmp"
}

for check in $($PY scripts/gpu_check.py --list); do
  run "$check" 120 $PY scripts/gpu_check.py --only "$check"
done
gpus=$($PY -c "import torch; print(torch.cuda.device_count())" 2>/dev/null || echo 0)
for extra in "--pp 2" "--pp 2 --schedule interleaved" "--tp 2 --sequence-parallel"; do
  name="zerostack train $extra"
  if ((gpus < 2)); then
    line "{\"check\": \"$name\", \"ok\": null, \"skipped\": \"needs 2 GPUs\"}"
    continue
  fi
  # two GPUs: pipeline (1F1B, interleaved) and tp 2 + sequence parallelism on NCCL
  run "$name" 120 bash -c "$PY -m zerostack.cli train --nproc 2 --steps 20 --no-progress \
    --out runs/gpu_check $extra >/dev/null && echo '{\"check\": \"$name\", \"ok\": true}'"
done
$PY scripts/gpu_check.py --summary "$log"
