#!/usr/bin/env bash
# Create ./.venv with everything the trainer and the tests need (idempotent).
# On a machine without CUDA, torch 2.13.0 is the CPU build; with CUDA, pip picks the CUDA build.
# Everything else at the versions the suite was last run with (launch/constraints.txt).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip >/dev/null
.venv/bin/python -c "import torch" 2>/dev/null || .venv/bin/python -m pip install -q "torch==2.13.0"
.venv/bin/python -m pip install -q -r requirements.txt -c launch/constraints.txt
