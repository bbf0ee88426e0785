#!/usr/bin/env bash
# The measurement behind --cut-replies' default: the target answers LeetCode + ShareGPT prompts with
# a length limit; one drafter trains on every reply, those cut at the limit kept as cut (no
# end-of-turn token: `keep`), one drops the cut replies (`drop`), and one trains on the replies'
# text alone, as a file without regeneration's target_reply record is trained (`closed`: every
# reply re-tokenized and closed by the template's end-of-turn token, cut or not); all at the same
# step budget and recipe, then evaluated on the same held-out ShareGPT prompts in bfloat16 against
# the fast greedy loop:
# at 128 new tokens by the training run's own final eval (<run>/<variant>/eval.json), at the
# lengths of EVAL_NEW by dflash.eval.
#   bash launch/ab_cut_replies.sh
# On one H200 with Qwen2.5-Coder-0.5B, SAMPLES=9000 STEPS=300 (BENCHMARKS.md): the GGUF's conversion
# 52 s, the regeneration 70 s, each variant about 8 min (its 300 steps 3.5-4.5 min, the rest set-up
# and evals).
# Knobs (environment), besides PYTHON, MODEL and TARGET of launch/real.sh:
#   RUN=runs/ab_cut    output: data/, keep/ and drop/ (runs), eval_<variant>_<tokens>.json
#   SAMPLES=12000      prompts regenerated (LeetCode's 1,405 first, then ShareGPT)
#   MAX_NEW=384        the reply length limit
#   STEPS=400          optimizer steps per variant
#   EVAL_PROMPTS=64    held-out prompts per eval
#   EVAL_NEW=384       further eval lengths (new tokens per prompt; "" for none)
#   VARIANTS="keep drop closed"
#   EXTRA_TRAIN_FLAGS  more train_drafter.py flags for both variants
set -euo pipefail
cd "$(dirname "$0")/.."

RUN=${RUN:-runs/ab_cut}
DATA=$RUN/data
LEETCODE=1
source launch/real_inputs.sh
if [ -f "$DATA/regen.jsonl" ]; then
  echo "reusing $DATA/regen.jsonl (delete it to regenerate)"
else
  cat "$DATA/leetcode_prompts.jsonl" "$DATA/train_prompts.jsonl" > "$DATA/prompts.jsonl"
  "$PY" -m dflash.regenerate --target "$TARGET" --prompts "$DATA/prompts.jsonl" --output "$DATA/regen.jsonl" \
    --max-new-tokens "${MAX_NEW:-384}" --limit "${SAMPLES:-12000}"
fi

if [[ " ${VARIANTS:-keep drop closed} " == *" closed "* && ! -f "$DATA/regen_closed.jsonl" ]]; then
  "$PY" -c 'import json, sys
for line in sys.stdin:
    record = json.loads(line)
    record.pop("target_reply", None)
    print(json.dumps(record, ensure_ascii=False))' < "$DATA/regen.jsonl" > "$DATA/regen_closed.jsonl"
fi

for variant in ${VARIANTS:-keep drop closed}; do
  data=$DATA/regen.jsonl policy=$variant
  [ "$variant" != closed ] || { data=$DATA/regen_closed.jsonl; policy=keep; }
  # shellcheck disable=SC2086  # EXTRA_TRAIN_FLAGS is a list of flags
  "$PY" train_drafter.py --target "$TARGET" --train-data "$data" --eval-data "$DATA/heldout.jsonl" \
    --output-dir "$RUN/$variant" --overwrite --max-length 2048 --epochs 1000 --max-steps "${STEPS:-400}" \
    --max-tokens 32768 --preset "$PRESET" --cut-replies "$policy" --eval-every "${STEPS:-400}" --eval-dtype bfloat16 \
    --eval-prompts "${EVAL_PROMPTS:-64}" --eval-max-new-tokens 128 --report-to none \
    ${MASK_ID:+--mask-token-id "$MASK_ID"} ${EXTRA_TRAIN_FLAGS:-}
  # shellcheck disable=SC2086  # EVAL_NEW is a list of lengths
  evaluate bfloat16 "$RUN/$variant/drafter" "$RUN/eval_$variant" ${EVAL_NEW-384}
done

"$PY" - "$RUN" ${VARIANTS:-keep drop closed} <<'EOF'
import json, pathlib, sys
run = pathlib.Path(sys.argv[1])
print("RESULT cut-replies A/B (held-out ShareGPT, bfloat16, speed-up against the fast greedy loop)")
for variant in sys.argv[2:]:
    reports = [("128", json.load(open(run / variant / "eval.json"))["trained"])]
    for path in sorted(run.glob(f"eval_{variant}_*.json"), key=lambda p: int(p.stem.split("_")[-1])):
        reports.append((path.stem.split("_")[-1], json.load(open(path))["drafter"]))
    for tokens, r in reports:
        print(f"  {variant:5s} {tokens:>4s} tokens, {r['prompts']} prompts: tau {r['tau']:.2f}, "
              f"speedup {r['speedup']:.2f}x, acceptance 1..4 {' '.join(f'{a:.2f}' for a in r['acceptance'][:4])}")
EOF
