#!/usr/bin/env bash
# Throughput and memory benchmarks on a GPU host, results as JSON under $RESULTS (default
# runs/bench/results): the drafter step with fast and naive kernels, the memory sweep, the
# end-to-end training loop (fast vs naive, with a profile), the fast loop as on an 80 GiB card,
# and response regeneration and batch-1 decoding (greedy step, speculative cycle) with the
# 8B-shaped target. With two GPUs the two halves run side by
# side. SKIP_STEP_BENCH=1 leaves out the drafter-only runs (step and memory sweep).
#   PYTHON=python3 bash launch/bench_gpu.sh
set -uo pipefail
cd "$(dirname "$0")/.."
source launch/python.sh
RES=${RESULTS:-runs/bench/results}
BENCH=${BENCH_DIR:-runs/bench}
mkdir -p "$RES"
[ -f "$BENCH/assets/target/config.json" ] || "$PY" -m dflash.benchmarks.assets --out "$BENCH/assets" > "$RES/assets.log" 2>&1
second=$(( $("$PY" -c 'import torch; print(torch.cuda.device_count())') > 1 ? 1 : 0 ))
e2e() { "$PY" -m dflash.benchmarks.e2e --out "$BENCH" --steps "${STEPS:-40}" "$@"; }
(
  export CUDA_VISIBLE_DEVICES=0
  if [ -z "${SKIP_STEP_BENCH:-}" ]; then
    "$PY" -m dflash.benchmarks.step --output "$RES/step_fast.json" > "$RES/step_fast.log" 2>&1
    "$PY" -m dflash.benchmarks.step --kernels naive --output "$RES/step_naive.json" > "$RES/step_naive.log" 2>&1
    "$PY" -m dflash.benchmarks.step --memory-sweep --output "$RES/memory_sweep.json" > "$RES/memory_sweep.log" 2>&1
  fi
  e2e --kernels fast --profile-steps 0 --emulate-gb 80 --output "$RES/e2e_80gb.json" > "$RES/e2e_80gb.log" 2>&1
  rm -f "$BENCH/regen.jsonl" "$BENCH/regen.jsonl.partial"
  "$PY" -m dflash.regenerate --target "$BENCH/assets/target" --prompts "$BENCH/assets/train.jsonl" \
    --output "$BENCH/regen.jsonl" --limit "${REGEN_PROMPTS:-256}" --max-new-tokens 512 > "$RES/regen.log" 2>&1
  "$PY" -m dflash.benchmarks.decode --target "$BENCH/assets/target" --prompts "$BENCH/assets/train.jsonl" \
    --num-prompts 8 --output "$RES/decode.json" > "$RES/decode.log" 2>&1
) &
half=$!
[ "$second" = 1 ] || wait "$half"
CUDA_VISIBLE_DEVICES=$second e2e --output "$RES/e2e.json" > "$RES/e2e.log" 2>&1
wait
tail -n 3 "$RES"/*.log
