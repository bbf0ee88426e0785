#!/usr/bin/env bash
# One node:   NPROC=8 bash launch/torchrun.sh --target-ranks auto --target ... --train-data ...
# Several:    NNODES=2 NODE_RANK=0 MASTER_ADDR=host0 NPROC=8 bash launch/torchrun.sh ...  (on every node)
set -euo pipefail
cd "$(dirname "$0")/.."
source launch/python.sh
exec "$PY" -m torch.distributed.run --nnodes "${NNODES:-1}" --node_rank "${NODE_RANK:-0}" \
    --master_addr "${MASTER_ADDR:-127.0.0.1}" --master_port "${MASTER_PORT:-29500}" \
    --nproc_per_node "${NPROC:-8}" train_drafter.py "$@"
