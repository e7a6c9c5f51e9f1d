"""`tiered-ckpt bench --peers` runs and reports what it measured: fresh processes per library, well-formed
figures and tables, loads checked bit for bit, and a library that lets go of the tensors before it copied
them is caught. Only torch.save and tiered_ckpt run here (CI installs no peer); no timing is asserted."""
import json
import statistics
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tiered_ckpt.bench.peer_libs import Pending, TorchSave
from tiered_ckpt.bench.peer_report import report
from tiered_ckpt.bench.peers import Mismatch, check_same_bits, measure_library

REPO = Path(__file__).resolve().parents[2]


def cells(line: str) -> list[str]:
    return [c.strip() for c in line.strip().strip("|").split("|")]


@pytest.mark.timeout(600)  # six fresh processes that import torch, on a shared 2-core machine
def test_the_harness_runs_each_library_in_fresh_processes_and_reports_verified_figures(tmp_path, shm_dir):
    out = tmp_path / "peers.json"
    proc = subprocess.run(
        [sys.executable, "-m", "tiered_ckpt.bench.peers", "--size", "4MiB", "--repeats", "2", "--first-saves", "3",
         "--libraries", "raw,torch_save,tiered_ckpt,tiered_ckpt_reserved", "--dir", str(tmp_path / "work"), "--shm", str(shm_dir),
         "--json", str(out)], cwd=REPO, capture_output=True, text=True, timeout=590)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    results = json.loads(out.read_text())
    [size] = results["sizes"]
    assert size["problems"] == {} and size["saves"] == 3
    assert sorted(size["runs"]) == ["raw", "tiered_ckpt", "tiered_ckpt_reserved", "torch_save"]
    assert all(len(runs) == 2 for runs in size["runs"].values())  # one fresh process per repetition
    for raw in size["runs"]["raw"]:
        assert min(raw["memcpy"], raw["raw_write"], raw["raw_read"]) > 0
    for name in ("torch_save", "tiered_ckpt", "tiered_ckpt_reserved"):
        for run in size["runs"][name]:
            assert run["verified"] is True and 0.99 * (4 << 20) <= run["bytes"] <= 4 << 20
            assert len(run["saves"]) == 3 and run["cold_load"] > 0
            for save in run["saves"]:
                # (durable may come before the caller is resumed: a small state commits in the meantime)
                assert 0 < save["returned"] <= save["blocked"] and save["durable"] > 0
    assert all(run["memory_load"] > 0 for run in size["runs"]["tiered_ckpt"])  # only tiered_ckpt loads from memory
    assert all(run["prepare"] > 0 for run in size["runs"]["tiered_ckpt_reserved"])  # engine.reserve, timed apart
    assert all("prepare" not in run for run in size["runs"]["tiered_ckpt"])

    lines = [cells(line) for line in proc.stdout.splitlines() if line.startswith("| ")]
    headers = [line for line in lines if line[0] == "library"]
    assert len(headers[0]) == 9 and headers[1] == ["library", "save 1", "save 2", "save 3"]
    rows = {line[0]: line for line in lines}
    assert rows["raw limits: memcpy / write + fsync / cold read"][3] == "1.00"
    for label, runs in (("torch.save", size["runs"]["torch_save"]), ("tiered_ckpt", size["runs"]["tiered_ckpt"])):
        row = next(line for line in lines if line[0] == label and len(line) == 9)
        # library, returns, blocked, × memcpy, durable, × raw write, cold load, × raw read, from memory
        for column, key in ((2, "blocked"), (4, "durable")):
            assert abs(float(row[column]) - statistics.median(r["saves"][1][key] for r in runs)) < 1e-4
        assert abs(float(row[6]) - statistics.median(r["cold_load"] for r in runs)) < 1e-4
        assert float(row[3]) > 0 and float(row[5]) > 0 and float(row[7]) > 0
    assert rows["tiered_ckpt / best peer"][3] == "best peer s"
    assert rows["blocked"][3].endswith("(torch.save)")  # the best peer is a peer, never tiered_ckpt+reserve
    assert "tiered_ckpt+reserve: its set-up before save 1 took" in proc.stdout
    assert {"blocked", "durable on disk", "cold load"} <= set(rows)
    assert rows["cold load"][3].endswith("(torch.save)")  # the only peer measured here
    assert "Not measured" not in proc.stdout


def test_a_single_flipped_bit_is_a_mismatch():
    saved = {"w": torch.randn(1000), "b": torch.randn(999).to(torch.bfloat16)}
    check_same_bits({k: v.clone() for k, v in saved.items()}, saved, "copy")
    for key in saved:
        loaded = {k: v.clone() for k, v in saved.items()}
        loaded[key].view(torch.uint8)[7] ^= 1
        with pytest.raises(Mismatch, match=key):
            check_same_bits(loaded, saved, "flipped")
    with pytest.raises(Mismatch, match="came back as"):
        check_same_bits({"w": saved["w"].double(), "b": saved["b"]}, saved, "cast")


class LetsGoBeforeCopying(TorchSave):
    """A broken library: its save returns at once and writes the live tensors only later, after the caller
    changed them."""

    async def save(self, step, state, started):
        library = self

        class Late(Pending):
            async def durable(self):
                await TorchSave.save(library, step, state, started)
                return 0.0

        return Late(started)


async def test_a_library_that_saves_the_changed_tensors_fails_loudly(tmp_path):
    state = {"w": torch.randn(4096), "b": torch.randn(64)}
    with pytest.raises(Mismatch, match="cold load"):
        await measure_library(LetsGoBeforeCopying(tmp_path, tmp_path, 0), state, saves=2)
    good = {"w": torch.randn(4096), "b": torch.randn(64)}
    result = await measure_library(TorchSave(tmp_path / "good", tmp_path, 0), good, saves=2)
    assert result["verified"] is True


def test_the_report_names_unavailable_and_failed_libraries():
    results = {"torch": "x", "python": "3", "cpus": 2, "first_saves": 0, "sizes": [{
        "bytes": 1 << 20, "repeats": 1, "saves": 2, "runs": {},
        "problems": {
            "dlrover": {"name": "dlrover", "library": "dlrover flash checkpoint",
                        "unavailable": "not installed (ModuleNotFoundError: No module named 'dlrover')"},
            "torchsnapshot_take": {"name": "torchsnapshot_take", "library": "torchsnapshot take", "repetition": 1,
                                   "error": "AssertionError: buffer size"},
            "dcp_async": {"name": "dcp_async", "library": "DCP async_save", "error": "Mismatch: w differs",
                          "mismatch": True, "repetition": 2}}}]}
    text = report(results)
    assert "- dlrover flash checkpoint: not installed (ModuleNotFoundError: No module named 'dlrover')" in text
    assert "- torchsnapshot take: failed: AssertionError: buffer size" in text
    assert "**DCP async_save: LOAD DID NOT REPRODUCE THE SAVED TENSORS**: Mismatch: w differs" in text
