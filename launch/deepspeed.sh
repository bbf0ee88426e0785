#!/usr/bin/env bash
# One node, N GPUs, DeepSpeed launcher:  NUM_GPUS=8 bash launch/deepspeed.sh --target-ranks auto --target ... --train-data ...
# Several nodes: put the hosts in a hostfile and set HOSTFILE=hosts (docs/placement.md, "Multi-node").
set -euo pipefail
cd "$(dirname "$0")/.."
source launch/python.sh
exec "$PY" -m deepspeed.launcher.runner ${HOSTFILE:+--hostfile "$HOSTFILE"} --num_gpus "${NUM_GPUS:-8}" train_drafter.py "$@"
