#!/usr/bin/env bash
# Install everything the trainer and the tests need (idempotent) into the environment the launch
# scripts run (launch/python.sh): the active virtual or conda environment, else ./.venv, made here
# from python3. $PYTHON names an environment that is used as it is: nothing is installed.
# Without CUDA, torch 2.13.0 is the CPU build; with CUDA, pip picks the CUDA build, and an installed
# torch stays. Everything else at the versions the suite was last run with (launch/constraints.txt).
set -euo pipefail
cd "$(dirname "$0")/.."
source launch/python.sh
[ -z "${PYTHON:-}" ] || exit 0
if [ "$PY" = python3 ]; then
  python3 -m venv .venv
  PY=.venv/bin/python
fi
"$PY" -m pip install -q --upgrade pip >/dev/null
"$PY" -c "import torch" 2>/dev/null || "$PY" -m pip install -q "torch==2.13.0"
# pytest runs the suite; setuptools builds the package in its install test
"$PY" -m pip install -q -r requirements.txt pytest setuptools -c launch/constraints.txt
