#!/usr/bin/env bash
# The README's first command: `scripts/demo.sh [train_gpt.py args]` (default: 200 steps, a checkpoint every 20).
# Sets up what is missing (the package, torch), then trains a small GPT on CPU with the embedded default stack
# (tiers/local.toml: /dev/shm + ./checkpoints, a file index; no services). Run it again: it resumes from the
# newest complete checkpoint. Ctrl-C stops it cleanly.
# Which Python: scripts/python.sh.
set -euo pipefail
cd "$(dirname "$0")/.."

source scripts/python.sh  # sets PY (a venv where pip refuses to install outside one) and installs torch if missing
# -P: the working directory (this clone) is not put first on sys.path, so only an installed package is found
if ! "$PY" -P -c "import tiered_ckpt, xxhash" 2>/dev/null; then
    "$PY" -m pip install -q -e ".[xxhash]"
fi
if [ "$#" -eq 0 ]; then
    set -- --steps 200 --save-every 20
fi
exec "$PY" examples/train_gpt.py "$@"
