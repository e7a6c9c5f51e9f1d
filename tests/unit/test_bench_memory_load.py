"""`python -m tiered_ckpt.bench.memory_load`: a memory-tier load and its steps, timed apart on the same files
(docs/benchmarks.md, *Where a target is missed*). Checked for what it reports, never for how fast."""
import json
import subprocess
import sys

from .test_cli import REPO


def test_the_steps_of_a_memory_tier_load_are_each_measured(shm_dir):
    proc = subprocess.run([sys.executable, "-m", "tiered_ckpt.bench.memory_load", "--size", "8MiB", "--repeats", "1",
                           "--shm", str(shm_dir), "--json"], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    result = json.loads(proc.stdout)
    assert 0.99 * (8 << 20) <= result["bytes"] <= 8 << 20 and result["checksum"] in ("xxh3", "crc32c")
    for step in ("load", "fixed", "verified_loop", "read", "read_hash", "memcpy", "map_touch", "map_populate"):
        assert result[step] > 0, step
    assert result["fixed"] < result["load"]  # a part of the load, timed on its own
    assert not list(shm_dir.iterdir())  # its memory tier's folder is gone with it
