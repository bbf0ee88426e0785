#!/usr/bin/env bash
# Decoding and regeneration speed of a target on one GPU, HF's path against the static-cache one:
# batch-1 greedy and speculative cycles (dflash.benchmarks.decode), then batched regeneration
# tokens/s with --engine hf on a few prompts and --engine fast on all of them.
#   TARGET=model.gguf PROMPTS=train_prompts.jsonl HELDOUT=heldout.jsonl RUN_DIR=runs/bench_decode bash launch/bench_decode.sh
# Knobs: HF_LIMIT=128 (prompts for the slow HF engine), LIMIT=0 (fast engine: 0 = all),
#        MAX_NEW=384, BATCH_TOKENS=0 (regeneration batch cap, 0: from memory, as launch/real.sh), PYTHON (launch/python.sh).
set -euo pipefail
cd "$(dirname "$0")/.."
source launch/python.sh
: "${TARGET:?set TARGET}" "${PROMPTS:?set PROMPTS}" "${HELDOUT:?set HELDOUT}"
OUT=${RUN_DIR:-runs/bench_decode}
mkdir -p "$OUT"
"$PY" -m dflash.benchmarks.decode --target "$TARGET" --prompts "$HELDOUT" --num-prompts 16 --plain-prompts 2 \
  --output "$OUT/decode.json"
for engine in hf fast; do
  limit=$([ $engine = hf ] && echo "${HF_LIMIT:-128}" || echo "${LIMIT:-0}")
  rm -f "$OUT/regen_$engine.jsonl.partial"
  "$PY" -m dflash.regenerate --target "$TARGET" --prompts "$PROMPTS" --output "$OUT/regen_$engine.jsonl" \
    --engine $engine --limit "$limit" --max-new-tokens "${MAX_NEW:-384}" --batch-tokens "${BATCH_TOKENS:-0}" 2>&1 \
    | tee "$OUT/regen_$engine.log" | grep -E "generated|wrote"
done
