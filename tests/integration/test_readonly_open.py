"""An engine with role = "auto" (the default) opened on a tier it cannot write, a real read-only bind mount in a
private mount namespace (readonly_open.py): open() warns naming the tier and why, and writes nothing (an "auto"
engine may only read: it must open on a read-only copy, and leave the tiers as they were); role = "reader"
says nothing; the first save still fails naming the tier (before: "auto" said nothing until that save)."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

from .test_readonly_disk import mount_namespaces_work

HELPER = str(Path(__file__).with_name("readonly_open.py"))


@pytest.mark.timeout(300)
def test_an_auto_engine_warns_at_open_of_a_tier_it_cannot_write_and_writes_nothing(tmp_path):
    if (reason := mount_namespaces_work()) is not None:
        pytest.skip(f"needs a private mount namespace (root): {reason}")
    run = subprocess.run(["unshare", "--mount", sys.executable, HELPER, str(tmp_path)], capture_output=True,
                         text=True, timeout=280)
    assert run.returncode == 0, run.stderr[-3000:]
    result = json.loads(run.stdout.strip().splitlines()[-1])
    (warning,) = [m for m in result["warned"]["auto"] if "cannot be written" in m]
    assert warning.startswith("tier 'disk' cannot be written") and "read-only file system" in warning, warning
    assert 'role = "reader"' in warning
    assert not [m for m in result["warned"]["reader"] if "cannot be written" in m], result
    assert result["created"] == ["disk"], result  # the opens wrote nothing: no index, no memory tier folder
    assert result["save"] is not None and "tier 'disk'" in result["save"], result
