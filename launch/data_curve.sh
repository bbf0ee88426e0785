#!/usr/bin/env bash
# Held-out tau against distinct training samples at one GPU budget. dflash.data.prompts builds the
# largest size's prompts (ShareGPT's turns with context and alone, LeetCode, ChatterBot, then user
# turns the target writes itself), the target answers them once, and for each size K of SIZES a
# drafter trains MINUTES minutes on the first K replies (--max-minutes: the same GPU time for every
# size; the prompts are shuffled, so each K samples the same mix). Each run's final eval decodes the
# held-out ShareGPT prompts in bfloat16 at 128 new tokens against the fast greedy loop; EVAL_NEW adds
# lengths through dflash.eval.
#   SIZES="10000 30000" MINUTES=4 bash launch/data_curve.sh
# Knobs (environment), besides PYTHON, MODEL and TARGET of launch/real.sh:
#   RUN=runs/data_curve  output: data/, n<K>/ (one run per size), eval_n<K>_<tokens>.json, curve.json
#   SIZES="10000 30000 100000"  distinct prompts per run
#   CODE_SHARE=0.5     share of code requests among the prompts
#   MAGPIE_NEW=512     tokens of a user turn the target writes (longer ones are cut and dropped)
#   MAX_NEW=384        the reply length limit
#   MINUTES=4          training minutes per run (steps, periodic evals and checkpoints)
#   EVAL_EVERY=250     steps between periodic held-out taus
#   EVAL_PROMPTS=64    held-out prompts per eval
#   EVAL_NEW=""        further eval lengths (new tokens per prompt)
#   EXTRA_TRAIN_FLAGS  more train_drafter.py flags for every run
set -euo pipefail
cd "$(dirname "$0")/.."

RUN=${RUN:-runs/data_curve}
DATA=$RUN/data
SIZES=${SIZES:-10000 30000 100000}
PROMPTS=$(printf '%s\n' $SIZES | sort -n | tail -1)
source launch/real_inputs.sh
if [ -f "$DATA/regen.jsonl" ] && [ "$(wc -l < "$DATA/regen.jsonl")" -eq "$PROMPTS" ]; then
  echo "reusing $DATA/regen.jsonl (delete it to regenerate)"
else
  "$PY" -m dflash.regenerate --target "$TARGET" --prompts "$TRAIN_PROMPTS" --output "$DATA/regen.jsonl" \
    --max-new-tokens "${MAX_NEW:-384}"
fi

for size in $SIZES; do
  head -n "$size" "$DATA/regen.jsonl" > "$DATA/regen_n$size.jsonl"
  # shellcheck disable=SC2086  # EXTRA_TRAIN_FLAGS is a list of flags
  "$PY" train_drafter.py --target "$TARGET" --train-data "$DATA/regen_n$size.jsonl" --eval-data "$DATA/heldout.jsonl" \
    --output-dir "$RUN/n$size" --overwrite --max-length 2048 --epochs 1000 --max-minutes "${MINUTES:-4}" \
    --max-tokens 32768 --preset "$PRESET" --eval-every "${EVAL_EVERY:-250}" --eval-dtype bfloat16 \
    --eval-prompts "${EVAL_PROMPTS:-64}" --eval-max-new-tokens 128 --report-to none \
    ${MASK_ID:+--mask-token-id "$MASK_ID"} ${EXTRA_TRAIN_FLAGS:-}
  # shellcheck disable=SC2086  # EVAL_NEW is a list of lengths
  evaluate bfloat16 "$RUN/n$size/drafter" "$RUN/eval_n$size" ${EVAL_NEW:-}
done

"$PY" - "$RUN" $SIZES <<'EOF_PY'
import json, pathlib, sys
run, sizes = pathlib.Path(sys.argv[1]), [int(s) for s in sys.argv[2:]]
print("RESULT data curve (held-out ShareGPT, bfloat16, speed-up against the fast greedy loop)")
curve = []
for size in sizes:
    replies = [json.loads(line) for line in open(run / "data" / f"regen_n{size}.jsonl")]
    finished = sum(r.get("target_reply", {}).get("finish_reason") == "stop" for r in replies)
    steps = json.loads((run / f"n{size}" / "metrics.jsonl").read_text().splitlines()[-1])["step"]
    reports = [(128, json.load(open(run / f"n{size}" / "eval.json"))["trained"])]
    reports += [(int(p.stem.split("_")[-1]), json.load(open(p))["drafter"])
                for p in sorted(run.glob(f"eval_n{size}_*.json"), key=lambda p: int(p.stem.split("_")[-1]))]
    for tokens, r in reports:
        curve.append({"prompts": size, "finished_replies": finished, "steps": steps, "new_tokens": tokens,
                      "eval_prompts": r["prompts"], "tau": r["tau"], "speedup": r["speedup"]})
        print(f"  {size:>7d} prompts ({finished} replies finished), {steps} steps, {tokens:>4d} tokens, "
              f"{r['prompts']} prompts: tau {r['tau']:.2f}, speedup {r['speedup']:.2f}x")
(run / "curve.json").write_text(json.dumps(curve, indent=1) + "\n")
EOF_PY
