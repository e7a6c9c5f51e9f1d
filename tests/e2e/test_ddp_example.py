"""examples/train_gpt_ddp.py under torchrun: crash at 2 ranks, resume at 3, then at 1; the losses follow the
uninterrupted 2-rank run (equal up to floating-point reduction order, which changes with the world size). Ctrl-C
stops every rank after the same step."""
import json
import math
import re
import subprocess
import sys

import pytest

from .test_examples import REPO, STOPPED, interrupt_after_a_commit, losses, run_to_end, toml

pytestmark = pytest.mark.timeout(600)  # real processes (gloo, torchrun): slower than unit tests

EXAMPLE = str(REPO / "examples" / "train_gpt_ddp.py")


def torchrun(nproc: int, *args: str, tiny: bool = True) -> subprocess.CompletedProcess:
    return run_to_end([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc), "--standalone",
                       EXAMPLE, *(["--tiny"] if tiny else []), "--save-every", "4", *args])


def test_ddp_example_resumes_at_other_world_sizes(tmp_path, shm_dir):
    straight_log = tmp_path / "straight.jsonl"
    cfg = toml(tmp_path / "a", shm_dir / "a")
    done = torchrun(2, "--config", str(cfg), "--steps", "16", "--losses", str(straight_log))
    assert done.returncode == 0, done.stderr[-3000:]
    # rank 0 alone reports: one line per save, one per tier that commits it (or skips it for a newer save)
    assert re.findall(r"^save   step +(\d+) ", done.stdout, re.M) == ["4", "8", "12", "16"], done.stdout
    assert len(re.findall(r"^(?:commit|skip  ) step +\d+  on (?:host|disk):", done.stdout, re.M)) == 8, done.stdout

    cfg = toml(tmp_path / "b", shm_dir / "b")
    log = tmp_path / "resumed.jsonl"
    crashed = torchrun(2, "--config", str(cfg), "--steps", "16", "--stop-after", "10", "--losses", str(log))
    assert crashed.returncode != 0 and "simulated crash after step 10" in crashed.stdout, crashed.stderr[-3000:]
    at3 = torchrun(3, "--config", str(cfg), "--steps", "12", "--losses", str(log))
    assert at3.returncode == 0, at3.stderr[-3000:]
    # the lazy save of step 8 may still have been in flight when the crash hit: then step 4 is the newest
    resumed_from = int(at3.stdout.split("resumed from step ")[1].split()[0])
    assert resumed_from in (4, 8) and "at world size 3" in at3.stdout
    at1 = torchrun(1, "--config", str(cfg), "--steps", "16", "--losses", str(log))
    assert at1.returncode == 0, at1.stderr[-3000:]
    assert "resumed from step 12 at world size 1" in at1.stdout

    expected = losses(straight_log)
    rows = [json.loads(line) for line in log.read_text().splitlines()]
    resumed = {r["step"]: r["loss"] for r in rows if r["world"] != 2}
    assert sorted(resumed) == list(range(resumed_from + 1, 17))
    for step, loss in resumed.items():
        assert math.isclose(loss, expected[step], rel_tol=1e-4), (step, loss, expected[step])


def test_ctrl_c_stops_every_rank_after_the_same_step_then_a_rerun_has_nothing_left(tmp_path, shm_dir):
    cfg = toml(tmp_path, shm_dir)
    argv = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--standalone", EXAMPLE, "--tiny",
            "--save-every", "4", "--config", str(cfg), "--steps", "100000"]
    _, out = interrupt_after_a_commit(argv, tmp_path / "err")  # torchrun and both workers get SIGINT, as in a terminal
    err = (tmp_path / "err").read_text()
    # torchrun reports the signal with a traceback of its own; no worker raised (no frame of the example's)
    assert not re.search(r'File ".*train_gpt(_ddp)?\.py"', err), err[-3000:]
    assert out.count("Ctrl-C: every rank stopped after step") == 1, out  # rank 0 speaks for all
    stopped, newest = map(int, STOPPED.search(out).groups())
    assert newest % 4 == 0 and newest <= stopped
    again = torchrun(2, "--config", str(cfg), "--steps", str(newest))
    assert again.returncode == 0, again.stderr[-3000:]
    assert f"resumed from step {newest} at world size 2" in again.stdout and "nothing left to train" in again.stdout


def test_a_resume_at_the_same_world_size_follows_the_uninterrupted_run_bit_for_bit(tmp_path, shm_dir):
    """The docstring's claim: DDP keeps its gradient buckets (find_unused_parameters=True), so every loss after
    the resume is the uninterrupted run's to the last bit (DDP's default rebuild of its buckets after a
    process's first step made them differ from the first step after the resume). Three ranks (a sum of two
    values is the same in either order, of three it is not) and the full model (several buckets; the tiny one
    fits in DDP's first)."""
    straight = tmp_path / "straight.jsonl"
    assert torchrun(3, "--config", str(toml(tmp_path / "a", shm_dir / "a")), "--steps", "8", "--losses",
                    str(straight), tiny=False).returncode == 0
    cfg, log = toml(tmp_path / "b", shm_dir / "b"), tmp_path / "resumed.jsonl"
    crashed = torchrun(3, "--config", str(cfg), "--steps", "8", "--stop-after", "6", "--losses", str(log), tiny=False)
    assert "simulated crash after step 6" in crashed.stdout, crashed.stderr[-3000:]
    again = torchrun(3, "--config", str(cfg), "--steps", "8", "--losses", str(log), tiny=False)
    assert again.returncode == 0 and "resumed from step 4 at world size 3" in again.stdout, again.stdout[-3000:]
    rows = [json.loads(line) for line in log.read_text().splitlines()]
    resumed = {r["step"]: r["loss"] for r in rows[6:]}  # the rows the resumed run wrote
    assert sorted(resumed) == [5, 6, 7, 8]
    expected = losses(straight)
    assert {s: expected[s] for s in resumed} == resumed  # exact, not isclose
