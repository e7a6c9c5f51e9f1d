"""scripts/local_stack.py, the docker-compose stack without Docker (redis-server, moto_server in MinIO's place,
2 ranks under torchrun with tiers/compose.toml): checkpoints complete on S3, and the resume from an emptied
memory tier continues from the last step of the first run."""
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from .test_compose import REPO

pytestmark = pytest.mark.timeout(600)  # real processes (two servers, torchrun twice): slower than unit tests


def test_the_local_stack_trains_lists_and_resumes(tmp_path):
    summary_file = tmp_path / "summary.json"
    # its own session: on a timeout the whole group goes (the script, its servers, torchrun and the ranks)
    # PYTHONFAULTHANDLER: on a hang, the SIGABRT below makes every Python process print where each thread is
    proc = subprocess.Popen([sys.executable, str(REPO / "scripts" / "local_stack.py"), "--tiny", "--steps", "16",
                             "--save-every", "4", "--summary", str(summary_file)],
                            cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True, env={**os.environ, "PYTHONFAULTHANDLER": "1"})
    try:
        output, _ = proc.communicate(timeout=480)
    except subprocess.TimeoutExpired:
        aborted = abort_python_processes(proc.pid)  # not the script: it passes their output on
        try:
            output, _ = proc.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            output, _ = proc.communicate()
        os.killpg(proc.pid, signal.SIGKILL) if proc.poll() is None else None
        pytest.fail(f"scripts/local_stack.py did not finish in 480 s; aborted {aborted} to show their "
                    f"stacks:\n{output[-20000:]}")
    assert proc.returncode == 0, output[-5000:]

    summary = json.loads(summary_file.read_text())
    # the first run waited for every save, so its last step was complete when the resume began; the memory
    # tier was emptied in between (a new container's /dev/shm), so another tier served it
    assert summary["resumed_from"] == 16 and summary["resumed_tier"] in ("peer", "disk", "s3"), summary
    assert 24 in summary["complete_on_s3"], summary  # the resumed run's last save reached S3 too
    assert "s3*" in output and "resumed from step 16 at world size 2" in output  # `tiered-ckpt ls`, rank 0


def abort_python_processes(session: int) -> list[str]:
    """SIGABRT to the Python processes of `session` other than its leader, ranks first (torchrun then stops);
    with PYTHONFAULTHANDLER set, each prints every thread's stack first. Returns what was aborted."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
            cmdline = (stat.parent / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue  # gone meanwhile
        pid = int(stat.parent.name)
        if int(fields[3]) == session and pid != session and "python" in cmdline and "moto_server" not in cmdline:
            found.append((pid, cmdline))
    found.sort(key=lambda p: "torch.distributed.run" in p[1])  # the ranks before their agent
    for pid, cmdline in found:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGABRT)
        time.sleep(2)
    return [f"{pid}: {cmdline[:200]}" for pid, cmdline in found]
