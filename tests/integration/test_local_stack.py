"""scripts/local_stack.py, the docker-compose stack without Docker (redis-server, moto_server in MinIO's place,
2 ranks under torchrun with tiers/compose.toml): checkpoints complete on S3, and the resume from an emptied
memory tier continues from the last step of the first run."""
import json
import os
import signal
import subprocess
import sys

import pytest

from .test_compose import REPO

pytestmark = pytest.mark.timeout(600)  # real processes (two servers, torchrun twice): slower than unit tests


def test_the_local_stack_trains_lists_and_resumes(tmp_path):
    summary_file = tmp_path / "summary.json"
    # its own session: on a timeout the whole group goes (the script, its servers, torchrun and the ranks)
    proc = subprocess.Popen([sys.executable, str(REPO / "scripts" / "local_stack.py"), "--tiny", "--steps", "16",
                             "--save-every", "4", "--summary", str(summary_file)],
                            cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        output, _ = proc.communicate(timeout=540)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        output, _ = proc.communicate()
        pytest.fail(f"scripts/local_stack.py did not finish in 540 s:\n{output[-5000:]}")
    assert proc.returncode == 0, output[-5000:]

    summary = json.loads(summary_file.read_text())
    # the first run waited for every save, so its last step was complete when the resume began; the memory
    # tier was emptied in between (a new container's /dev/shm), so another tier served it
    assert summary["resumed_from"] == 16 and summary["resumed_tier"] in ("peer", "disk", "s3"), summary
    assert 24 in summary["complete_on_s3"], summary  # the resumed run's last save reached S3 too
    assert "s3*" in output and "resumed from step 16 at world size 2" in output  # `tiered-ckpt ls`, rank 0
