#!/usr/bin/env bash
# Create .venv (if missing) with the CPU build of torch and the pinned dependencies, and
# install tensorpar in editable mode. Safe to run again: it only installs what is missing.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
. .venv/bin/activate
# (pip's warnings about this machine's local package mirrors are filtered; errors still fail the script)
pip_q() { python -m pip install -q --disable-pip-version-check "$@" 2> >(grep -v "is ignored" >&2); }
# The CPU wheel first: a loose torch requirement would otherwise pull a multi-GB CUDA build.
python -c "import torch" 2>/dev/null || pip_q torch==2.13.0
pip_q -r requirements-dev.txt
pip_q --no-deps -e .
python -c "import torch, transformers, tensorpar; print('tensorpar ready: torch', torch.__version__)"
