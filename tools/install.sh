#!/usr/bin/env bash
# Create .venv and install ucp_store with its dev extras; CPU torch 2.13.0 pinned by constraints-cpu.txt.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
.venv/bin/pip install -q --disable-pip-version-check -c constraints-cpu.txt -e '.[dev]' 2>&1 \
  | grep -v '^WARNING: Location' || true
.venv/bin/python -c "import ucp_store, torch; assert torch.__version__.startswith('2.13.0'), torch.__version__" \
  || { echo "ucp_store did not install"; exit 1; }
