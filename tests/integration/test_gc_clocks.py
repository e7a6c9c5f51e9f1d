"""gc beside a trainer whose clock is two hours behind its own (gc may run on another node). With a Redis index,
whether a save may still be writing is judged on the index server's clock; with a file index, whose records
the trainer stamps with its own clock, by the live writer's lease: a save begun while it holds the lease is
its own. Either way gc keeps the save in flight (and the save completes) instead of removing it as two hours
old (the file index's case failed before: the lease said a writer lived, and its save went all the same)."""
import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tiered_ckpt.testing.configs import faults, stack_dict, write_toml

HELPER = str(Path(__file__).with_name("skewed_trainer.py"))


@pytest.mark.timeout(300)
@pytest.mark.parametrize("index", ["redis", "file"])
def test_gc_keeps_a_save_in_flight_of_a_trainer_whose_clock_is_behind(tmp_path, shm_dir, redis_server, index):
    url = redis_server().url if index == "redis" else f"file://{tmp_path}/index"
    raw = stack_dict(tmp_path, {"kind": "memory", "keep_last": 3}, "faulty", shm=shm_dir, job="clocks", index=url)
    config, disk = write_toml(tmp_path / "tiers.toml", raw), faults(raw)
    disk.inject("stall", keys="step-000000000002/")  # the trainer's disk holds step 2 until cleared
    trainer = subprocess.Popen([sys.executable, HELPER, str(config)], stdout=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        while disk.stalled() == 0:  # step 2 is being written to the disk
            assert trainer.poll() is None and time.monotonic() < deadline, "the trainer never held step 2's write"
            time.sleep(0.01)
        gc = subprocess.run([sys.executable, "-m", "tiered_ckpt.cli", "--config", str(config), "gc", "--json"],
                            capture_output=True, text=True, timeout=120)
        assert gc.returncode == 0, gc.stderr
        report = json.loads(gc.stdout)
        assert 2 not in report["checkpoints"], report
        assert not [r for r in report["removed"] if r["step"] == 2], report  # neither its data nor its records
        assert any(k.startswith("step 2") and "may still" in k for k in report["kept"]), report
    finally:
        disk.clear()
        out, _ = trainer.communicate(timeout=120)
    assert json.loads(out.strip().splitlines()[-1]) == {"step2": "ok"}
