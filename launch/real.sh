#!/usr/bin/env bash
# The real-model pipeline on a GPU host, in one command: Qwen2.5-Coder-0.5B-Instruct (a Q4_K_M GGUF
# that six registry packages ship in parts, joined and checked by dflash.target.packaged) is the
# target; it answers the registry packages' prompts (ShareGPT's human turns, LeetCode, ChatterBot); a
# drafter trains on those answers and is evaluated on held-out ShareGPT conversations in bfloat16
# (speed) and float32 (output identical to greedy). Nothing is downloaded from a model hub; the
# packages come from PyPI, or from wheels installed beforehand.
#   bash launch/real.sh
#   SAMPLES=2000 EPOCHS=1 bash launch/real.sh       # a short pass
# Knobs (environment):
#   PYTHON             interpreter with requirements.txt installed; unset: launch/setup.sh installs
#                      into the active environment or ./.venv (launch/python.sh)
#   MODEL=qwen2.5-coder-0.5b  the packaged target: qwen2.5-coder-0.5b | smollm2-135m |
#                      qwen2.5-coder-1.5b (its 22 part packages install on first use)
#   TARGET             any other target model (an HF folder or a .gguf); overrides MODEL
#   RUN=runs/real      output: data/ (prompts, regen.jsonl), drafter/, metrics.jsonl, eval_*.json
#   SAMPLES=0          train prompts to regenerate and train on (0: all of PROMPTS)
#   PROMPTS=registry   the train prompts: registry (every prompt of the registry packages, built by
#                      dflash.data.prompts --n 0: ShareGPT's human turns with their context and its later
#                      turns asked alone, LeetCode, ChatterBot; 63,671) | sharegpt (ShareGPT's turns with
#                      their context alone, 41,565) | N (N prompts, the target writing what the registry
#                      lacks: CODE_SHARE=0.5, MAGPIE_NEW=512 tokens of a user turn it writes)
#   MAX_NEW=384        reply tokens the target writes per prompt
#   BATCH_TOKENS=0     regeneration batch cap, rows x (longest prompt + MAX_NEW); 0: sized from the
#                      target's shapes and the free GPU memory
#   EPOCHS=3           training epochs (SmolLM2-135M: 3 took 16 minutes on an H200, tau 3.19 at 384 tokens)
#   MINUTES            train this many minutes instead (--max-minutes; EPOCHS then only caps the run)
#   BUDGET_MINUTES     regeneration and training in this many minutes, from the regeneration's start to the
#                      exported drafter: training gets what the regeneration leaves, less SETUP_MINUTES=0.8
#                      for its set-up and export (the clock of --max-minutes starts at its first step);
#                      overrides MINUTES. 20 on one H100: BENCHMARKS.md "Qwen2.5-Coder-0.5B"
#   WARMUP=1           with BUDGET_MINUTES: beside the regeneration, a throwaway 12-step run on 600 ShareGPT
#                      training conversations ($DATA/train_conversations.jsonl) fills the compile caches, so
#                      the budget's training starts compiled; 0: none
#   MAX_TOKENS=32768   tokens per micro-batch (a 135M target leaves the GPU idle at the recipe's 8192)
#   PRESET             train_drafter.py --preset: small (3 layers, B=8, 128 anchors, a 32,768-token draft
#                      vocabulary, cut replies kept) for the packaged targets; auto for a TARGET
#   MASK_ID            the drafter's mask token (default: a spare embedding row, found automatically;
#                      16, <empty_output>, for smollm2-135m, whose tokenizer uses every row)
#   EVAL_PROMPTS=64    held-out prompts decoded at the end
#   EVAL_NEW="128 MAX_NEW"  new tokens per held-out prompt in the bfloat16 evals (the speed ones), one
#                      eval per length: what a chat user reads first, and as long as the replies trained on
#   LOSSLESS_NEW=128   new tokens per prompt in the float32 eval (identical to greedy, or exit 1);
#                      float32 decodes slowly, and exactness does not depend on the length
#   EXTRA_TRAIN_FLAGS  more train_drafter.py flags, e.g. "--resume" or "--overwrite" for a rerun
# A rerun reuses $RUN/data/regen.jsonl: delete it to regenerate (after changing SAMPLES or MAX_NEW).
set -euo pipefail
cd "$(dirname "$0")/.."

RUN=${RUN:-runs/real}
DATA=$RUN/data
PROMPTS=${PROMPTS:-registry}
source launch/real_inputs.sh
budget_start=$SECONDS
# a GGUF's conversion, made once here, so the regeneration and the warm-up beside it both reuse it
"$PY" -c 'import sys; from dflash.target.gguf import resolve_target; resolve_target(sys.argv[1])' "$TARGET"
warmup=none
if [ -n "${BUDGET_MINUTES:-}" ] && [ "${WARMUP:-1}" = 1 ]; then
  conversations=$DATA/train_conversations.jsonl
  [ -f "$conversations" ] || { echo "WARMUP=1 trains on $conversations, which is missing: delete $DATA/heldout.jsonl" \
    "to build the prompts again (dflash.data.sharegpt --conversations writes it), or pass WARMUP=0" >&2; exit 2; }
  head -n 600 "$conversations" > "$RUN/warmup.jsonl"
  # 20 s in, once the regeneration has sized its batches from the free GPU memory; the compile
  # caches are the machine's, so the budget run finds the same drafter (EXTRA_TRAIN_FLAGS too) compiled
  # shellcheck disable=SC2086
  { sleep 20 && exec "$PY" train_drafter.py --target "$TARGET" --train-data "$RUN/warmup.jsonl" --output-dir "$RUN/warmup" \
    --overwrite --max-length 2048 --max-steps 12 --max-tokens 8192 --preset "$PRESET" ${MASK_ID:+--mask-token-id "$MASK_ID"} \
    --eval-every 0 --final-eval false ${EXTRA_TRAIN_FLAGS:-}; } > "$RUN/warmup.log" 2>&1 &
  warmup=$!
  trap 'kill "$warmup" 2>/dev/null || true' EXIT  # a failed regeneration leaves no warm-up behind
fi
if [ -f "$DATA/regen.jsonl" ]; then
  echo "reusing $DATA/regen.jsonl (delete it to regenerate)"
else
  "$PY" -m dflash.regenerate --target "$TARGET" --prompts "$TRAIN_PROMPTS" --output "$DATA/regen.jsonl" \
    --max-new-tokens "${MAX_NEW:-384}" --batch-tokens "${BATCH_TOKENS:-0}" --limit "${SAMPLES:-0}"
fi
if [ "$warmup" != none ]; then
  wait "$warmup" || { echo "the warm-up run failed ($RUN/warmup.log):" >&2; tail -5 "$RUN/warmup.log" >&2; exit 1; }
  echo "warm-up done ($RUN/warmup.log): the compile caches are filled"
fi

started=$SECONDS
epochs=${EPOCHS:-3}
if [ -n "${BUDGET_MINUTES:-}" ]; then
  MINUTES=$("$PY" -c 'import sys; budget, spent, setup = map(float, sys.argv[1:])
left = budget - spent / 60 - setup
sys.exit(f"BUDGET_MINUTES={budget:g}: the regeneration (and the warm-up beside it) took {spent / 60:.1f} minutes and {setup:g} more go to set-up and export: no time is left to train") if left <= 0 else print(round(left, 2))' \
    "$BUDGET_MINUTES" "$((SECONDS - budget_start))" "${SETUP_MINUTES:-0.8}")
  echo "BUDGET_MINUTES=$BUDGET_MINUTES: training for $MINUTES minutes"
fi
[ -z "${MINUTES:-}" ] || epochs=${EPOCHS:-1000}  # the minutes end the run
# shellcheck disable=SC2086  # EXTRA_TRAIN_FLAGS is a list of flags
"$PY" train_drafter.py --target "$TARGET" --train-data "$DATA/regen.jsonl" --eval-data "$DATA/heldout.jsonl" \
  --output-dir "$RUN" --max-length 2048 --epochs "$epochs" ${MINUTES:+--max-minutes "$MINUTES"} \
  --max-tokens "${MAX_TOKENS:-32768}" --preset "$PRESET" ${MASK_ID:+--mask-token-id "$MASK_ID"} ${EXTRA_TRAIN_FLAGS:-}
train_seconds=$((SECONDS - started))

# shellcheck disable=SC2086  # EVAL_NEW is a list of lengths
lengths=$(printf '%s\n' ${EVAL_NEW:-128 ${MAX_NEW:-384}} | awk '!seen[$0]++')
# shellcheck disable=SC2086
evaluate bfloat16 "$RUN/drafter" "$RUN/eval_bf16" $lengths  # eval_bf16_<length>.json
lossless=0
evaluate float32 "$RUN/drafter" "$RUN/eval_fp32" "${LOSSLESS_NEW:-128}" || lossless=$?  # eval_fp32_<length>.json

# shellcheck disable=SC2086
"$PY" - "$RUN" "$DATA/regen.jsonl" "$train_seconds" "${LOSSLESS_NEW:-128}" $lengths <<'EOF'
import json, sys
run, regen, train_seconds, lossless_new, lengths = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4], sys.argv[5:]
fp32 = json.load(open(f"{run}/eval_fp32_{lossless_new}.json"))["drafter"]
steps = json.loads(open(f"{run}/metrics.jsonl").read().splitlines()[-1])["step"]
samples = sum(1 for _ in open(regen))
def per_second(report, kind):  # the report's own figure where dflash.eval writes one
    return report.get(f"{kind}_tokens_per_second", report["tokens"] / report[f"{kind}_seconds"])
for new in lengths:
    bf16 = json.load(open(f"{run}/eval_bf16_{new}.json"))["drafter"]
    print(f"RESULT bf16, at most {new} new tokens ({bf16['tokens'] / bf16['prompts']:.0f} per prompt): "
          f"tau {bf16['tau']:.2f}, acceptance by position 1..4 "
          f"{' '.join(f'{a:.2f}' for a in bf16['acceptance'][:4])}, speedup {bf16['speedup']:.2f}x, "
          f"{per_second(bf16, 'greedy'):.0f} tokens/s greedy -> {per_second(bf16, 'speculative'):.0f} speculative")
print(f"RESULT fp32: tau {fp32['tau']:.2f}, speedup {fp32['speedup']:.2f}x, identical to greedy on "
      f"{fp32['prompts'] - fp32['diverged']}/{fp32['prompts']} | {samples} samples, "
      f"training {train_seconds // 3600}h{train_seconds // 60 % 60:02d}m{train_seconds % 60:02d}s ({steps} steps)")
EOF
exit "$lossless"
