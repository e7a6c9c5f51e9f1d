# Sourced by scripts/demo.sh and scripts/test.sh: sets PY to the Python that installs and runs the project.
#
# $PYTHON if set; else the active virtual environment's; else ./.venv if it exists; else python3 itself when it
# may install packages; else a new ./.venv, made when python3 refuses installs outside a venv (PEP 668,
# "externally-managed-environment") or has no pip. The venv sees the system's packages (--system-site-packages),
# so a torch the machine already has is used, not fetched again. With ./.venv, its tools come first on PATH (as
# `source .venv/bin/activate` would: the tests find moto_server there). Then torch, if missing: torch==2.13.0
# (a CPU wheel where the machine has one cached), else the newest torch>=2.4.

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
if [ "$PY" = .venv/bin/python ]; then
    export VIRTUAL_ENV="$PWD/.venv" PATH="$PWD/.venv/bin:$PATH"
fi
if ! "$PY" -c "import torch" 2>/dev/null; then
    "$PY" -m pip install -q "torch==2.13.0" || "$PY" -m pip install -q "torch>=2.4"
fi
