"""`python -m tiered_ckpt.bench.lightning_saves`: Lightning's saves through TieredCheckpointIO beside Lightning's own
checkpoint_io plugins. Checked for what it reports (every run, every save timed), never for how fast."""
import json
import subprocess
import sys

from .test_cli import REPO


def test_the_lightning_bench_runs_every_plugin(tmp_path, shm_dir):
    proc = subprocess.run([sys.executable, "-m", "tiered_ckpt.bench.lightning_saves", "--params-mib", "1", "--epochs",
                           "2", "--steps", "2", "--repeats", "1", "--dir", str(tmp_path), "--shm", str(shm_dir), "--json"],
                          cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    runs = json.loads(proc.stdout)
    assert [r["kind"] for r in runs] == ["tiered", "tiered+reserve", "torch", "torch-async"]
    for r in runs:  # two epochs: each saves its own path, then last.ckpt
        assert len(r["blocked"]) == 4 and all(b > 0 for b in r["blocked"]), r
        assert r["state_bytes"] >= 2 * (1 << 20) * 0.9
    assert not list(shm_dir.iterdir()) and not list(tmp_path.iterdir())  # every run's files are gone with it
