"""The blocking Checkpointer mirrors the Engine for ordinary training loops."""
import concurrent.futures

import pytest
import torch

import tiered_ckpt as tc
from tiered_ckpt.testing.configs import faults


def test_checkpointer_save_load_list_delete(make_config):
    model = torch.nn.Linear(4, 3)
    with tc.Checkpointer(make_config()) as ckpt:
        saved = model.weight.detach().clone()
        handle = ckpt.save(1, {"model": model, "step": 1})
        with torch.no_grad():
            model.weight.add_(1.0)  # after save() returned: not in the checkpoint
        handle.wait()
        assert handle.done() and handle.tiers == ("host", "disk")
        lazy = ckpt.save(2, {"model": model, "step": 2}, lazy=True)
        lazy.staged()
        assert isinstance(lazy.future, concurrent.futures.Future)
        lazy.future.result(timeout=30)
        assert [(c.step, c.is_complete) for c in ckpt.list()] == [(1, True), (2, True)]
        fresh = torch.nn.Linear(4, 3)
        state = {"model": fresh, "step": 0}
        info = ckpt.load(state, step=1)
        assert info.step == 1 and state["step"] == 1
        assert torch.equal(fresh.weight, saved)
        ckpt.delete(1)
        assert [c.step for c in ckpt.list()] == [2]
        with pytest.raises(tc.CheckpointExists):
            ckpt.save(2, {"model": model})


def test_checkpointer_close_raises_unobserved_errors(make_config):
    ckpt = tc.Checkpointer(make_config(tiers=[{"capacity": "4KiB"}, {"capacity": "4KiB"}], stage_in_memory_tier=False))
    ckpt.save(1, {"w": torch.zeros(10_000)})
    with pytest.raises(tc.SaveError, match="host"):
        ckpt.close()
    ckpt.close()  # idempotent


def test_checkpointer_from_toml_with_bad_file(tmp_path):
    with pytest.raises(tc.ConfigError):
        tc.Checkpointer.from_toml(tmp_path / "missing.toml")


def test_checkpointer_handles_report_skipped_tiers(make_config):
    """A Checkpointer handle says which tiers skipped its save, as the async handle does."""
    config = make_config(tiers=[{}, {"kind": "faulty"}])
    disk = faults(config, "disk")
    disk.inject("stall")  # the disk writes nothing until every save was made: it falls behind (its probe goes on)
    with tc.Checkpointer(config) as ckpt:
        handles = [ckpt.save(step, {"w": torch.full((40_000,), float(step))}) for step in range(1, 6)]
        disk.clear()
        for h in handles:
            h.wait()
        assert any("disk" in h.skipped for h in handles) and handles[-1].skipped == {}
