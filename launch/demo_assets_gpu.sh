#!/usr/bin/env bash
# Rebuild the embedded demo target and its data on a GPU host, from the stdlib copy in
# $DFLASH_DEMO_CORPUS (the committed assets come from Python 3.11's stdlib), then measure the
# answers' quality. Everything lands in one tarball, $RESULTS/${NAME}.tar.gz, holding
# target/, data/ and the logs. TARGET_FLAGS passes more build_target flags.
#   DFLASH_DEMO_CORPUS=runs/corpus311 MINUTES=6 PYTHON=python3 RESULTS=/tmp/out bash launch/demo_assets_gpu.sh
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
RES=${RESULTS:-runs/demo_assets}
NAME=${NAME:-demo_assets}
WORK=$(mktemp -d)
mkdir -p "$RES" "$WORK/data"
"$PY" -m dflash.demo.build_target --output-dir "$WORK/target" --device cuda --batch-size "${BATCH:-128}" \
  --workers "${WORKERS:-12}" --minutes "${MINUTES:-6}" --warmup-steps "${WARMUP:-200}" ${TARGET_FLAGS:-} > "$WORK/build_target.log" 2>&1
"$PY" -m dflash.demo.build_data --target-dir "$WORK/target" --train-out "$WORK/data/train.jsonl" \
  --heldout-out "$WORK/data/heldout.jsonl" --device cuda --batch-size 256 > "$WORK/build_data.log" 2>&1
for split in train heldout; do
  "$PY" -m dflash.demo.quality "$WORK/data/$split.jsonl" --tokenizer "$WORK/target" >> "$WORK/quality.log"
done
cat "$WORK/quality.log"
tar -czf "$RES/$NAME.tar.gz" -C "$WORK" target data build_target.log build_data.log quality.log
