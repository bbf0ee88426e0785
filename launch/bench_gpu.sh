#!/usr/bin/env bash
# Throughput and memory benchmarks on a GPU host, results as JSON under $RESULTS (default
# runs/bench/results): the drafter step with fast and naive kernels, the memory sweep, and the
# end-to-end training loop (fast vs naive). With two GPUs the drafter-step runs use GPU 0 and
# the end-to-end runs GPU 1, side by side.      PYTHON=python3 bash launch/bench_gpu.sh
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
RES=${RESULTS:-runs/bench/results}
mkdir -p "$RES"
second=$(( $("$PY" -c 'import torch; print(torch.cuda.device_count())') > 1 ? 1 : 0 ))
(
  export CUDA_VISIBLE_DEVICES=0
  "$PY" -m dflash.benchmark --output "$RES/step_fast.json" > "$RES/step_fast.log" 2>&1
  "$PY" -m dflash.benchmark --kernels naive --output "$RES/step_naive.json" > "$RES/step_naive.log" 2>&1
  "$PY" -m dflash.benchmark --memory-sweep --output "$RES/memory_sweep.json" > "$RES/memory_sweep.log" 2>&1
) &
steps=$!
[ "$second" = 1 ] || wait "$steps"
CUDA_VISIBLE_DEVICES=$second "$PY" -m dflash.e2e_benchmark --out "${BENCH_DIR:-runs/bench}" --steps "${STEPS:-40}" \
    --output "$RES/e2e.json" ${E2E_EXTRA:+--extra "$E2E_EXTRA"} > "$RES/e2e.log" 2>&1
wait
tail -n 3 "$RES"/*.log
