"""An engine with role = "auto" (the default) opened on a tier it cannot write, a real read-only bind mount in a
private mount namespace (readonly_open.py): open() warns naming the tier and why, and writes nothing (an "auto"
engine may only read: it must open on a read-only copy, and leave the tiers as they were); role = "reader"
says nothing; the first save still fails naming the tier (before: "auto" said nothing until that save)."""
from pathlib import Path

import pytest

from .test_readonly_disk import run_in_mount_namespace

HELPER = str(Path(__file__).with_name("readonly_open.py"))


@pytest.mark.timeout(300)
def test_an_auto_engine_warns_at_open_of_a_tier_it_cannot_write_and_writes_nothing(tmp_path):
    result = run_in_mount_namespace(HELPER, tmp_path)
    (warning,) = [m for m in result["warned"]["auto"] if "cannot be written" in m]
    assert warning.startswith("tier 'disk' cannot be written") and "read-only file system" in warning, warning
    assert 'role = "reader"' in warning
    assert not [m for m in result["warned"]["reader"] if "cannot be written" in m], result
    assert result["created"] == ["disk"], result  # the opens wrote nothing: no index, no memory tier folder
    assert result["save"] is not None and "tier 'disk'" in result["save"], result
