# The python every launch script runs, as PY (sourced from the repository root): $PYTHON when set
# (an environment used as it is); else the active virtual environment's, or the active conda
# environment's other than base; else ./.venv's (launch/setup.sh makes it); else python3.
if [ -n "${PYTHON:-}" ]; then
  PY=$PYTHON
elif [ -n "${VIRTUAL_ENV:-}" ]; then
  PY=$VIRTUAL_ENV/bin/python
elif [ -n "${CONDA_PREFIX:-}" ] && [ "${CONDA_DEFAULT_ENV:-base}" != base ]; then
  PY=$CONDA_PREFIX/bin/python
elif [ -x .venv/bin/python ]; then
  PY=.venv/bin/python
else
  PY=python3
fi
