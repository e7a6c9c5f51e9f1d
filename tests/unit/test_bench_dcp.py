"""`python -m tiered_ckpt.bench.dcp_bench`: the DCP writer and reader against DCP's FileSystemWriter/Reader in one
run (docs/benchmarks.md). Checked for what it reports (every load is checked bit-equal inside), never for speed."""
import json
import subprocess
import sys

from .test_cli import REPO


def test_saves_and_loads_of_both_writers_are_measured(shm_dir):
    proc = subprocess.run([sys.executable, "-m", "tiered_ckpt.bench.dcp_bench", "--size", "8MiB", "--shm", str(shm_dir),
                           "--json"], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    result = json.loads(proc.stdout)
    assert 0.99 * (8 << 20) <= result["bytes"] <= 8 << 20
    for key in ("tiered_blocked", "tiered_durable", "tiered_durable_disk", "fs_blocked", "fs_durable", "load_memory",
                "load_disk", "fs_load_disk", "fs_load_cached", "ratio_blocked", "ratio_load_memory"):
        assert result[key] > 0, key
    assert result["tiered_blocked"] <= result["tiered_durable"]  # async_save returned before the save was durable
    assert not list(shm_dir.iterdir())  # its memory tier's folder is gone with it
