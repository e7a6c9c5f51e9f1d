#!/usr/bin/env bash
# Set up and run the README's demo: `scripts/demo.sh [train_gpt.py args]` (default: 200 steps, a checkpoint
# every 20). Installs the package (torch too, if missing), then trains a small GPT on CPU with the embedded
# default stack (tiers/local.toml: /dev/shm + ./checkpoints, a file index; no services). Run it again: it
# resumes from the newest complete checkpoint. Then `tiered-ckpt ls` lists what it saved.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}

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
