#!/usr/bin/env bash
# The README's first command: `scripts/demo.sh [train_gpt.py args]` (default: 200 steps, a checkpoint every 20).
# Sets up what is missing (the package, torch), then trains a small GPT on CPU with the embedded default stack
# (tiers/local.toml: /dev/shm + ./checkpoints, a file index; no services). Run it again: it resumes from the
# newest complete checkpoint. Ctrl-C stops it cleanly.
#
# Which Python (the same rule as scripts/test.sh): $PYTHON if set; else the active virtual environment's; else
# ./.venv if it exists; else python3 itself when it may install packages; else a new ./.venv, made when python3
# refuses installs outside a venv (PEP 668, "externally-managed-environment") or has no pip. The venv sees the
# system's packages (--system-site-packages), so a torch the machine already has is used, not fetched again.
set -euo pipefail
cd "$(dirname "$0")/.."

pick_python() {
    if [ -n "${PYTHON:-}" ]; then echo "$PYTHON"; return; fi
    if python3 -c 'import sys; sys.exit(sys.prefix == sys.base_prefix)'; then echo python3; return; fi  # in a venv
    if [ -x .venv/bin/python ]; then echo .venv/bin/python; return; fi
    if python3 -m pip --version >/dev/null 2>&1 && python3 -c 'import os, sys, sysconfig
sys.exit(os.path.exists(os.path.join(sysconfig.get_path("stdlib"), "EXTERNALLY-MANAGED")))'; then
        echo python3; return
    fi
    echo "python3 may not install packages here (PEP 668, or no pip): creating ./.venv" >&2
    if ! python3 -m venv --system-site-packages .venv >&2; then
        echo "could not create ./.venv: install python3-venv (Debian/Ubuntu), or activate a venv of yours" >&2
        exit 1
    fi
    echo .venv/bin/python
}
PY=$(pick_python)
if [ "$PY" = .venv/bin/python ]; then  # as `source .venv/bin/activate` would: its tools come first on PATH
    export VIRTUAL_ENV="$PWD/.venv" PATH="$PWD/.venv/bin:$PATH"
fi

if ! "$PY" -c "import torch" 2>/dev/null; then
    "$PY" -m pip install -q "torch==2.13.0" || "$PY" -m pip install -q "torch>=2.4"
fi
if ! "$PY" -c "import tiered_ckpt, xxhash" 2>/dev/null; then
    "$PY" -m pip install -q -e ".[xxhash]"
fi
if [ "$#" -eq 0 ]; then
    set -- --steps 200 --save-every 20
fi
exec "$PY" examples/train_gpt.py "$@"
