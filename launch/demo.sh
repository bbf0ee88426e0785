#!/usr/bin/env bash
# Set up, then train a drafter on the shipped demo target and data and evaluate it.
set -euo pipefail
cd "$(dirname "$0")/.."
bash launch/setup.sh
exec .venv/bin/python train_drafter.py --overwrite "$@"  # the demo starts afresh each time
