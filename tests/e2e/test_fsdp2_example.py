"""examples/train_fsdp2.py under torchrun: FSDP2 (`fully_shard`) + `tc.TrainState`, trained at 2 ranks, resumed
at 3 from the saved step; the resumed run follows the uninterrupted 2-rank run (equal up to floating-point
reduction order, which changes with the world size)."""
import math
import subprocess
import sys

import pytest

from .test_examples import REPO, losses, run_to_end, toml

pytestmark = pytest.mark.timeout(600)  # real processes (gloo, torchrun): slower than unit tests

EXAMPLE = str(REPO / "examples" / "train_fsdp2.py")


def torchrun(nproc: int, *args: str) -> subprocess.CompletedProcess:
    proc = run_to_end([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc), "--standalone",
                       EXAMPLE, "--tiny", "--save-every", "4", *args])
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc


def test_fsdp2_example_trains_at_2_ranks_and_resumes_at_3(tmp_path, shm_dir):
    straight = tmp_path / "straight.jsonl"
    torchrun(2, "--config", str(toml(tmp_path / "a", shm_dir / "a")), "--steps", "12", "--losses", str(straight))

    cfg = toml(tmp_path / "b", shm_dir / "b")
    log = tmp_path / "resumed.jsonl"
    first = torchrun(2, "--config", str(cfg), "--steps", "8", "--losses", str(log))
    assert "starting fresh at world size 2" in first.stdout
    assert "commit step     8  on disk" in first.stdout  # the run ends once its last save is on every tier
    at3 = torchrun(3, "--config", str(cfg), "--steps", "12", "--losses", str(log))
    assert "resumed from step 8 at world size 3" in at3.stdout, at3.stdout
    assert "commit step    12  on disk" in at3.stdout

    expected, got = losses(straight), losses(log)
    assert sorted(got) == list(range(1, 13))  # 1-8 at 2 ranks, then 9-12 at 3: the run went on from step 8
    for step, loss in got.items():
        assert math.isclose(loss, expected[step], rel_tol=1e-4), (step, loss, expected[step])
