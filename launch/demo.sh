#!/usr/bin/env bash
# Set up (launch/setup.sh), then train a drafter on the shipped demo target and data and evaluate it.
set -euo pipefail
cd "$(dirname "$0")/.."
bash launch/setup.sh
source launch/python.sh
exec "$PY" train_drafter.py --overwrite "$@"  # the demo starts afresh each time
