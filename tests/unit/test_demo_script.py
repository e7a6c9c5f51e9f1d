"""scripts/demo.sh installs the package from the clone (pip install -e) unless the Python it picked has it
installed: its check must not find the clone's folder itself (the script runs in the clone's root, where
`python -c` puts the working directory first on sys.path, and `import tiered_ckpt` needs none of its
dependencies, so from there it always succeeded: `tiered-ckpt` never landed on PATH and the example failed on a
dependency never installed)."""
import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("installed, installs", [
    (None, True),  # not installed: only the clone's folder has it
    ("this", False),  # installed (this clone's): nothing to do
])
def test_demo_installs_the_package_unless_it_is_installed(tmp_path, installed, installs):
    site = tmp_path / "site"  # stands for site-packages: xxhash and torch importable, tiered_ckpt as the case says
    site.mkdir()
    (site / "xxhash.py").write_text("")
    (site / "torch.py").write_text("")
    path = f"{site}:{REPO}" if installed == "this" else str(site)
    log = tmp_path / "calls"
    python = tmp_path / "python"  # a Python without the real site-packages that logs what the script asks of it
    python.write_text(f"""#!/bin/sh
echo "$*" >> {log}
case "$*" in
    *"pip install"*|*examples/train_gpt.py*) exit 0 ;;
esac
PYTHONPATH={path} exec {sys.executable} -S "$@"
""")
    python.chmod(python.stat().st_mode | stat.S_IXUSR)
    proc = subprocess.run([str(REPO / "scripts" / "demo.sh"), "--steps", "1"], cwd=REPO, capture_output=True,
                          text=True, timeout=60, env={**os.environ, "PYTHON": str(python)})
    assert proc.returncode == 0, proc.stderr
    calls = log.read_text().splitlines()
    assert any("pip install" in c and "-e .[xxhash]" in c for c in calls) is installs, calls
    assert calls[-1].endswith("examples/train_gpt.py --steps 1"), calls
