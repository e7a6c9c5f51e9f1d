"""scripts/local_stack.py, the docker-compose stack without Docker (redis-server, moto_server in MinIO's place,
2 ranks under torchrun with tiers/compose.toml): checkpoints complete on S3, and the resume from an emptied
memory tier continues from the last step of the first run."""
import json
import os
import subprocess
import sys

import pytest

from .hung_processes import wait_or_fail
from .test_compose import REPO

pytestmark = pytest.mark.timeout(600)  # real processes (two servers, torchrun twice): slower than unit tests


def test_the_local_stack_trains_lists_and_resumes(tmp_path):
    summary_file = tmp_path / "summary.json"
    # PYTHONFAULTHANDLER: on a hang, wait_or_fail's SIGABRT makes every Python process print where each thread is
    # (the ranks too: torchrun starts each in a session of its own, so they are found by parent, not by session)
    proc = subprocess.Popen([sys.executable, str(REPO / "scripts" / "local_stack.py"), "--tiny", "--steps", "16",
                             "--save-every", "4", "--summary", str(summary_file)],
                            cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True, env={**os.environ, "PYTHONFAULTHANDLER": "1"})
    output = wait_or_fail(proc, 480, "scripts/local_stack.py", quiet=("moto_server",))
    assert proc.returncode == 0, output[-5000:]

    summary = json.loads(summary_file.read_text())
    # the first run waited for every save, so its last step was complete when the resume began; the memory
    # tier was emptied in between (a new container's /dev/shm), so another tier served it
    assert summary["resumed_from"] == 16 and summary["resumed_tier"] in ("peer", "disk", "s3"), summary
    assert 24 in summary["complete_on_s3"], summary  # the resumed run's last save reached S3 too
    assert "s3*" in output and "resumed from step 16 at world size 2" in output  # `tiered-ckpt ls`, rank 0
