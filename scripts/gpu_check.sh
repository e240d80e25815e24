#!/usr/bin/env bash
# zerostack's GPU checks (issue 17), for a machine with CUDA: one JSON line per check, then a
# summary; exit code 1 if any failed. About 3 minutes on one H200. See scripts/gpu_check.py.
set -uo pipefail
cd "$(dirname "$0")/.."
[ -x .venv/bin/python ] && . .venv/bin/activate
export TORCH_NCCL_ASYNC_ERROR_HANDLING=3 PYTHONPATH=src
python scripts/gpu_check.py "$@"
status=$?
gpus=$(python -c "import torch; print(torch.cuda.device_count())")
if [ "$gpus" -ge 2 ]; then
  # the parts that need two GPUs: pipeline (1F1B and interleaved) and tp 2 + sequence parallel
  for extra in "--pp 2" "--pp 2 --schedule interleaved" "--tp 2 --sequence-parallel"; do
    if timeout 600 python -m zerostack.cli train --nproc 2 --steps 20 --no-progress \
        --out "runs/gpu_check" $extra >/tmp/zs_gpu_check.log 2>&1; then
      echo "{\"check\": \"zerostack train $extra\", \"ok\": true}"
    else
      echo "{\"check\": \"zerostack train $extra\", \"ok\": false, \"log\": \"/tmp/zs_gpu_check.log\"}"
      status=1
    fi
  done
fi
exit $status
