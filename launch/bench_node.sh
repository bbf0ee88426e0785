#!/usr/bin/env bash
# The node-scale run on one host of NUM_GPUS GPUs (default 8), on the Qwen3-8B-shaped random
# target and realistic-length chats: colocated x1 on one GPU (the scaling baseline), then the
# DeepSpeed launcher with --target-ranks auto and with the T one below and one above what auto
# picked, then a run killed (SIGKILL) after its first checkpoint and resumed, whose losses are
# compared with the uninterrupted auto run's. Ends with one table of draft positions/s per GPU.
#   PYTHON=python3 NUM_GPUS=8 STEPS=60 bash launch/bench_node.sh
# TARGET and DATA replace the 8B-shaped assets; LAUNCHER=torchrun replaces the DeepSpeed launcher.
# A CPU dry run:  LAUNCHER=torchrun NUM_GPUS=2 STEPS=8 TARGET=assets/demo/target \
#   DATA=assets/demo/data/train.jsonl MAX_LENGTH=512 bash launch/bench_node.sh
set -euo pipefail
cd "$(dirname "$0")/.."
source launch/python.sh
OUT=${OUT_DIR:-runs/node}
N=${NUM_GPUS:-8}
STEPS=${STEPS:-60}
SAVE=$((STEPS / 2))
if [ -z "${TARGET:-}" ]; then
  [ -f "$OUT/assets/target/config.json" ] || "$PY" -m dflash.benchmarks.assets --out "$OUT/assets"
fi
common=(--target "${TARGET:-$OUT/assets/target}" --train-data "${DATA:-$OUT/assets/train.jsonl}" --max-steps "$STEPS" --log-every 5
        --eval-prompts 0 --report-to none --max-length "${MAX_LENGTH:-3072}" --transport-timeout-s 600 --overwrite "$@")
if [ "${LAUNCHER:-deepspeed}" = torchrun ]; then
  launcher=(-m torch.distributed.run --nproc_per_node "$N")
else
  launcher=(-m deepspeed.launcher.runner --num_gpus "$N")
fi
launch() { "$PY" "${launcher[@]}" --master_port "${MASTER_PORT:-29521}" train_drafter.py "$@"; }
targets_of() {  # T of a finished run: its GPUs minus its drafter ranks
  "$PY" -c "import json,sys; r=[json.loads(l) for l in open(sys.argv[1])][-1]; print(r['world_size'] - r['drafter_ranks'])" \
    "$1/metrics.jsonl"
}

CUDA_VISIBLE_DEVICES=0 "$PY" train_drafter.py --output-dir "$OUT/colocated-x1" "${common[@]}"
launch --target-ranks auto --save-every "$SAVE" --output-dir "$OUT/auto" "${common[@]}" 2>&1 | tee "$OUT/auto.log"
grep -A4 "FLOP model" "$OUT/auto.log" | head -5 || true
T=$(targets_of "$OUT/auto")  # 0: auto chose colocated
runs=("$OUT/colocated-x1" "$OUT/auto")
for t in $((T - 1)) $((T + 1)); do
  if [ "$t" -ge 1 ] && [ "$t" -lt "$N" ]; then
    launch --target-ranks "$t" --output-dir "$OUT/T$t" "${common[@]}"
    runs+=("$OUT/T$t")
  fi
done

# Kill after the first checkpoint, resume, compare the resumed steps with the auto run's.
killed=(--target-ranks "$([ "$T" = 0 ] && echo colocated || echo "$T")" --save-every "$SAVE" --output-dir "$OUT/killed")
setsid "$PY" "${launcher[@]}" --master_port 29531 train_drafter.py "${killed[@]}" "${common[@]}" > "$OUT/killed.log" 2>&1 &
leader=$!
until compgen -G "$OUT/killed/checkpoints/step_*/trainer_state.json" > /dev/null; do
  kill -0 "$leader" 2> /dev/null || { echo "the run to kill ended before its first checkpoint"; exit 1; }
  sleep 0.1
done
kill -KILL -- -"$leader"; wait "$leader" || true
[ ! -d "$OUT/killed/drafter" ] || { echo "the run finished before it was killed: raise STEPS"; exit 1; }
resume=("${common[@]/--overwrite/--resume}")
launch "${killed[@]}" "${resume[@]}" > "$OUT/resumed.log" 2>&1
"$PY" - "$OUT/auto" "$OUT/killed" "$SAVE" <<'EOF'
import json, sys
straight, resumed = ({r["step"]: r["loss"] for r in map(json.loads, open(f"{d}/metrics.jsonl"))} for d in sys.argv[1:3])
after = [s for s in sorted(resumed) if s > int(sys.argv[3])]
diff = max(abs(straight[s] - resumed[s]) for s in after)
print(f"resume: logged steps {after} after the checkpoint at step {sys.argv[3]}, max |loss difference| "
      f"against the uninterrupted run {diff:.3g}")
EOF
"$PY" -m dflash.tools.throughput "${runs[@]}"
