#!/usr/bin/env bash
# Set up and run the whole test suite: `scripts/test.sh [pytest args]`.
# Installs the package with its test extras (torch from the local wheel cache where the machine has one)
# and redis-server if it is missing (the Redis tests of later issues start their own servers from it).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}

if ! "$PY" -c "import torch" 2>/dev/null; then
    "$PY" -m pip install -q "torch==2.13.0" || "$PY" -m pip install -q "torch>=2.4"
fi
"$PY" -m pip install -q -e ".[test]"

if ! command -v redis-server >/dev/null 2>&1 && command -v apt-get >/dev/null 2>&1; then
    (apt-get update -qq && apt-get install -y -qq redis-server) >/dev/null || echo "warning: could not install redis-server" >&2
fi

exec "$PY" -m pytest -q "$@"
