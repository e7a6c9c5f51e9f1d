"""torchtitan 0.3's checkpoint manager through tiered_ckpt (TieredCheckpointManager, built from its Config as the
trainer builds it): a 2-rank FSDP2 run killed (SIGKILL) after step 5 resumes from step 4 off the tiers and ends
bit-exact with a run that was never stopped: weights, Adam state, learning-rate schedule and data position."""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("torchtitan.components.checkpointer", reason="torchtitan 0.3 is not installed: scripts/test.sh "
                    "installs it (pip install --no-deps torchtitan==0.3.0 spmd_types==0.2.3 tyro)")

from tiered_ckpt.testing.configs import write_toml  # noqa: E402

from . import titan_ranks  # noqa: E402
from .spawn import run_ranks  # noqa: E402

pytestmark = pytest.mark.timeout(600)


def test_a_killed_run_resumes_bit_exact(tmp_path):
    from tiered_ckpt.testing.configs import stack_dict

    host = {"kind": "memory", "path": str(tmp_path / "shm"), "capacity": "1GiB", "keep_last": 2}
    toml = str(write_toml(tmp_path / "tiered.toml", stack_dict(tmp_path, host, "local", job="titan")))
    straight = run_ranks(titan_ranks.train, 2, toml, "straight", 6, None, str(tmp_path / "a"))
    exits: dict = {}
    run_ranks(titan_ranks.train, 2, toml, "killed", 6, 5, str(tmp_path / "b"), may_die=frozenset({0, 1}),
              exitcodes=exits)
    assert set(exits.values()) == {-9}  # both ranks were killed after step 5
    resumed = run_ranks(titan_ranks.train, 2, toml, "killed", 6, None, str(tmp_path / "b"))
    for want, got in zip(straight, resumed):
        assert got["resumed"] and got["start"] == 4  # step 4, saved at interval 2, was the newest on the tiers
        assert not want["resumed"] and want["start"] == 0
        for part in ("model", "optim"):
            assert want[part].keys() == got[part].keys()
            for k in want[part]:
                assert torch.equal(want[part][k], got[part][k]), (part, k)
        assert got["position"] == want["position"] == 6 and got["lr"] == want["lr"]
    assert not (tmp_path / "b" / "ckpt").exists()  # nothing went to torchtitan's own folder
