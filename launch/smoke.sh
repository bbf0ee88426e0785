#!/usr/bin/env bash
# Two-process smoke run on the demo target: 1 target rank + 1 drafter rank, then colocated x2.
# Unchanged on CPU (gloo) and on two GPUs (NCCL): the device is picked automatically.
set -euo pipefail
cd "$(dirname "$0")/.."
source launch/python.sh
OUT=${OUT_DIR:-runs/smoke}
common=(--max-steps "${STEPS:-20}" --log-every 5 --eval-prompts 2 --eval-max-new-tokens 32 --report-to none
        --transport-timeout-s 120)
"$PY" -m torch.distributed.run --nproc_per_node 2 train_drafter.py --target-ranks 1 --output-dir "$OUT/split" "${common[@]}" "$@"
"$PY" -m torch.distributed.run --nproc_per_node 2 train_drafter.py --target-ranks colocated --output-dir "$OUT/colocated" "${common[@]}" "$@"
