#!/usr/bin/env bash
# Creates .venv (if missing) and installs baton with its test extras. Safe to run again.
# torch: an existing install is kept (GPU users bring their own build); otherwise the CPU build
# torch==2.13.0 is installed first, so baton's `torch>=2.4` range pulls nothing larger.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ ! -x .venv/bin/python ]; then
    "${PYTHON:-python3}" -m venv .venv
fi
if ! .venv/bin/python -c "import torch" >/dev/null 2>&1; then
    .venv/bin/pip install --quiet --disable-pip-version-check torch==2.13.0
fi
.venv/bin/pip install --quiet --disable-pip-version-check -e ".[test]"
