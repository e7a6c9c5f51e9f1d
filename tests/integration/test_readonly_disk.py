"""A disk that turns read-only in the middle of a save (ext4's `errors=remount-ro`), on a real read-only bind
mount in a private mount namespace (readonly_disk.py): the save fails on that tier and says so (it never
hangs), the memory tier still commits, a delete that cannot remove the data says so (status 1) and keeps
the checkpoint buried, and a buried checkpoint is never listed or loaded again."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

HELPER = str(Path(__file__).with_name("readonly_disk.py"))


def mount_namespaces_work() -> str | None:
    probe = subprocess.run(["unshare", "--mount", "true"], capture_output=True, text=True)
    return None if probe.returncode == 0 else (probe.stderr.strip() or f"unshare exited {probe.returncode}")


def run_in_mount_namespace(helper: str, tmp_path) -> dict:
    """Run a helper script in a private mount namespace (skipped where the kernel refuses one); its last line of
    output, as JSON."""
    if (reason := mount_namespaces_work()) is not None:
        pytest.skip(f"needs a private mount namespace (root): {reason}")
    run = subprocess.run(["unshare", "--mount", sys.executable, helper, str(tmp_path)], capture_output=True,
                         text=True, timeout=280)
    assert run.returncode == 0, run.stderr[-3000:]
    return json.loads(run.stdout.strip().splitlines()[-1])


@pytest.mark.timeout(300)
def test_a_disk_turning_read_only_mid_save_fails_the_tier_and_a_delete_it_refuses_is_not_reported_done(tmp_path):
    if (reason := mount_namespaces_work()) is not None:
        pytest.skip(f"needs a private mount namespace (root): {reason}")
    run = subprocess.run(["unshare", "--mount", sys.executable, HELPER, str(tmp_path)], capture_output=True,
                         text=True, timeout=280)
    phases = {p["phase"]: p for p in map(json.loads, (l for l in run.stdout.splitlines() if l.startswith("{")))}
    assert run.returncode == 0, run.stderr[-3000:]
    assert "Task exception was never retrieved" not in run.stderr
    step2 = phases["step2"]
    # not "hang"; the memory tier held, so the save is a checkpoint and only the disk's failure is named
    assert step2["error"] is None and step2["failed"] == ["disk"] and step2["committed"] == ["host"], step2
    assert "Read-only file system" in step2["message"]
    delete = phases["delete"]
    assert delete["rc"] == 1, delete
    assert "could not be removed" in delete["out"] and "buried" in delete["out"]
    load = phases["load"]
    assert load["listed"] == [2] and load["step"] == 2 and load["exact"], load  # never step 1 "forgotten"
    assert phases["load1"]["error"] == "IncompleteCheckpoint"
