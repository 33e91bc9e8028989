#!/usr/bin/env bash
# Install ucp_store with its test extras into .venv and run the test suite.
# CPU torch is pinned through constraints-cpu.txt so no CUDA build is ever downloaded.
# As root, it also installs and starts a local PostgreSQL 15 so the PostgreSQL catalog tests run.
set -euo pipefail
cd "$(dirname "$0")/.."
bash tools/install.sh

if [ -z "${UCP_TEST_POSTGRES_URL:-}" ] && [ "$(id -u)" = 0 ]; then
  if ! command -v pg_ctlcluster >/dev/null 2>&1; then
    (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq postgresql >/dev/null) || true
  fi
  if command -v pg_ctlcluster >/dev/null 2>&1; then
    ver=$(ls /etc/postgresql | sort -n | tail -1)
    pg_ctlcluster "$ver" main start 2>/dev/null || true
    for _ in $(seq 1 30); do su postgres -c "pg_isready -q" && break; sleep 1; done
    su postgres -c "psql -qtAc \"SELECT 1 FROM pg_roles WHERE rolname='ucp'\"" | grep -q 1 \
      || su postgres -c "psql -qc \"CREATE USER ucp PASSWORD 'ucp' SUPERUSER\""
    su postgres -c "psql -qtAc \"SELECT 1 FROM pg_database WHERE datname='ucp_test'\"" | grep -q 1 \
      || su postgres -c "createdb -O ucp ucp_test"
    export UCP_TEST_POSTGRES_URL="postgresql+psycopg2://ucp:ucp@127.0.0.1:5432/ucp_test"
  fi
fi

# Static checks first: a finding fails the run (rules and strictness in pyproject.toml).
echo "ruff check ucp_store tests tools; mypy (files from pyproject: ucp_store, strict on the pure modules)"
.venv/bin/ruff check ucp_store tests tools
.venv/bin/mypy

export UCP_PROGRESS=0
# -n 2: tests/conftest.py spreads the files over the two workers (one unit per file, longest first)
exec .venv/bin/python -m pytest -q -n 2 --dist loadfile --durations=25 "$@"
