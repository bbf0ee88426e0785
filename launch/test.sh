#!/usr/bin/env bash
# Set up, then run the test suite (CPU; multi-process tests use gloo).
set -euo pipefail
cd "$(dirname "$0")/.."
bash launch/setup.sh
exec .venv/bin/python -m pytest -q "$@"
