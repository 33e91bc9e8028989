#!/usr/bin/env bash
# Install ucp_store into .venv (CPU torch pinned) and run the end-to-end demo (tools/demo.py).
set -euo pipefail
cd "$(dirname "$0")/.."
bash tools/install.sh
exec .venv/bin/python tools/demo.py "$@"
