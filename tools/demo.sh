#!/usr/bin/env bash
# Install ucp_store into .venv (core dependencies only; CPU torch pinned by constraints-cpu.txt) and run
# `ucp demo` (arguments pass through: --dir DIR, --steps N, --deepspeed).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
.venv/bin/pip install -q --disable-pip-version-check -c constraints-cpu.txt -e . 2>&1 | grep -v '^WARNING: Location' || true
exec .venv/bin/ucp demo "$@"
