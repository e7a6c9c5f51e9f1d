"""tiered_ckpt's DCP StorageWriter/StorageReader under real processes (gloo): a checkpoint saved through them
reshards as DCP's own FileSystemWriter/Reader does, bit-exact: FSDP2 2 -> 1, 3, 4 ranks, FSDP2 x TP 2x2 ->
FSDP2 4, Adam state included; dcp.async_save (thread mode) too."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from . import dcp_ranks
from .common import config
from .spawn import run_ranks

pytestmark = pytest.mark.timeout(600)  # real processes (gloo): slower than unit tests


def same(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for k in a:
        if isinstance(a[k], torch.Tensor):
            assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), k
        else:
            assert a[k] == b[k], k


@pytest.mark.parametrize("asynchronous", [False, True], ids=["save", "async_save"])
def test_fsdp2_at_2_reshards_to_1_3_4_like_filesystem_writer(tmp_path, asynchronous):
    cfg, fs = config(str(tmp_path)), str(tmp_path / "fs")
    expected = run_ranks(dcp_ranks.save, 2, cfg, fs, "fsdp", asynchronous)[0]
    assert any(k.startswith("optim.state.") for k in expected)  # Adam's moments are in the checkpoint
    for world in (1, 3, 4) if not asynchronous else (3,):
        for got in run_ranks(dcp_ranks.load, world, cfg, fs):
            same(got["fs"], expected)  # DCP's own round trip
            same(got["tiered"], expected)  # ours: bit-exact, the same values as DCP's


def test_fsdp2_x_tp_2x2_reshards_to_fsdp2_at_4(tmp_path):
    cfg, fs = config(str(tmp_path)), str(tmp_path / "fs")
    expected = run_ranks(dcp_ranks.save, 4, cfg, fs, "fsdp_tp", False)[0]
    for got in run_ranks(dcp_ranks.load, 4, cfg, fs):
        same(got["fs"], expected)
        same(got["tiered"], expected)



def test_async_save_process_mode_is_refused_naming_the_thread_mode(tmp_path):
    """DCP's checkpoint process would need the training process's engine: the writer says so when pickled. A
    process of its own (the spawned ranks are daemons, which DCP's checkpoint process cannot be started from)."""
    script = Path(__file__).with_name("dcp_process_mode.py")
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    proc = subprocess.run([sys.executable, str(script), str(tmp_path)], capture_output=True, text=True, timeout=240,
                          env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "cannot be sent to another process" in proc.stdout and "thread mode" in proc.stdout, proc.stdout
