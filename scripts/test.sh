#!/usr/bin/env bash
# The README's second command, and CI's (.ci/run): `scripts/test.sh [pytest args]` sets up what the tests need,
# then runs pytest with those arguments (every test by default: the quick subset, then the tests marked slow).
# Installs the package with its test extras (torch from the local wheel cache where the machine has one) and
# redis-server if it is missing (the Redis tests start their own servers from it).
# Which Python: scripts/python.sh.
set -euo pipefail
cd "$(dirname "$0")/.."

source scripts/python.sh  # sets PY (a venv where pip refuses to install outside one) and installs torch if missing
"$PY" -m pip install -q -e ".[test]"
# torchtitan 0.3 for tests/multirank/test_torchtitan.py (tiered_ckpt.integrations.torchtitan): without its training
# stack (datasets, torchdata, wandb, ...), which the checkpoint manager does not use; tyro and spmd_types it imports
if ! "$PY" -c "import torchtitan.components.checkpointer" 2>/dev/null; then
    { "$PY" -m pip install -q --no-deps "torchtitan==0.3.0" "spmd_types==0.2.3" && "$PY" -m pip install -q tyro; } \
        || echo "warning: could not install torchtitan 0.3 (its test is skipped)" >&2
fi

if ! command -v redis-server >/dev/null 2>&1 && command -v apt-get >/dev/null 2>&1; then
    (apt-get update -qq && apt-get install -y -qq redis-server) >/dev/null || echo "warning: could not install redis-server" >&2
fi

# Four pytest workers (pytest-xdist) by default, whatever the core count: most of a test's time is spent waiting
# (process start-up, rendezvous, fault timeouts, a frozen node), so four share two cores well (the slow phase took
# 29 minutes in one worker on a 2-core machine, 20 in four). TIERED_CKPT_TEST_WORKERS=0 runs in one process.
WORKERS=(-n "${TIERED_CKPT_TEST_WORKERS:-4}" --dist worksteal)

if [ "$#" -eq 0 ]; then  # every test: the quick subset first (a broken change shows in minutes), then the slow
    # tests that start real processes (tests/conftest.py marks them); both phases always run and both are reported
    quick=0; "$PY" -m pytest -q "${WORKERS[@]}" --durations=10 -m "not slow" || quick=$?
    slow=0; "$PY" -m pytest -q "${WORKERS[@]}" --durations=25 -m slow || slow=$?
    echo "scripts/test.sh: quick subset exit $quick, slow tests exit $slow"
    [ "$quick" -eq 0 ] && [ "$slow" -eq 0 ]
    exit
fi
exec "$PY" -m pytest -q "$@"
