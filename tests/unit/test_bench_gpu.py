"""`python -m tiered_ckpt.bench.gpu`: the GPU figures of docs/benchmarks.md. No GPU here: with `--device cpu`
the same code runs end to end, so it stays working for the next machine that has one. Checked for what it
reports (the saves, the load bit-exact, the ordering checks, the training loop), never for how fast."""
import json
import subprocess
import sys

from .test_cli import REPO


def test_the_gpu_bench_runs_end_to_end_on_the_cpu(shm_dir):
    proc = subprocess.run([sys.executable, "-m", "tiered_ckpt.bench.gpu", "--device", "cpu", "--size", "4MiB",
                           "--repeats", "1", "--no-dcp", "--steps", "2", "--every", "1", "--loop-repeats", "1",
                           "--dim", "32", "--layers", "1", "--batch", "2", "--ctx", "16", "--shm", str(shm_dir),
                           "--json"], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    r = json.loads(proc.stdout)
    assert r["device"] == "cpu" and 0.99 * (4 << 20) <= r["bytes"] <= 4 << 20
    assert len(r["save_plain"]) == len(r["save_reserved"]) == len(r["durable_reserved"]) == 6
    assert len(r["save_reserved_noearly"]) == 6
    assert r["load_exact"] is True
    assert r["ordering"] == {"eager": True, "lazy": True, "eager, launched during the walk": True,
                             "state_dict kernels": True, "state_dict kernels, launched during the walk": True}
    assert r["early_fallbacks"] == {"same": True, "moved to the host": True, "cut shorter": True, "added": True}
    assert r["loop"]["steps"] == 2 and len(r["loop"]["runs"]["lazy"]) == 1
    assert not list(shm_dir.iterdir())  # its memory tier's folders are gone with it
