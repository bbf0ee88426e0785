#!/usr/bin/env bash
# Set up (launch/setup.sh), then run the test suite (CPU; multi-process tests use gloo).
set -euo pipefail
cd "$(dirname "$0")/.."
bash launch/setup.sh
source launch/python.sh
exec "$PY" -m pytest -q "$@"
