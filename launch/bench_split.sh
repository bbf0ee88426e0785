#!/usr/bin/env bash
# Placement benchmark on one node with 2 GPUs: colocated x1, colocated x2 and split 1+1 on the
# same Qwen3-8B-shaped random target and chat data (300-2600 tokens), then one table of draft
# positions/s per GPU.   PYTHON=python3 STEPS=60 bash launch/bench_split.sh
set -euo pipefail
cd "$(dirname "$0")/.."
source launch/python.sh
OUT=${OUT_DIR:-runs/bench}
[ -f "$OUT/assets/target/config.json" ] || "$PY" -m dflash.benchmarks.assets --out "$OUT/assets"
common=(--target "$OUT/assets/target" --train-data "$OUT/assets/train.jsonl" --max-steps "${STEPS:-60}"
        --log-every 10 --eval-prompts 0 --report-to none --max-length 3072 --max-tokens "${MAX_TOKENS:-3072}"
        --transport-timeout-s 600 "$@")
run2() { "$PY" -m torch.distributed.run --nproc_per_node 2 --master_port "${MASTER_PORT:-29511}" train_drafter.py "$@"; }
"$PY" train_drafter.py --output-dir "$OUT/colocated-x1" "${common[@]}"
run2 --target-ranks colocated --output-dir "$OUT/colocated-x2" "${common[@]}"
run2 --target-ranks 1 --output-dir "$OUT/split-1+1" "${common[@]}"
"$PY" -m dflash.tools.throughput "$OUT/colocated-x1" "$OUT/colocated-x2" "$OUT/split-1+1"
