"""[engine] host_memory: the memory tier's keep_last gives way so that staging, its checkpoints and read buffers
fit the machine's budget; what cannot fit is a ConfigError naming engine.host_memory, before any buffer."""
import os

import pytest
import torch

import tiered_ckpt as tc
from tiered_ckpt.config import parse_config
from tiered_ckpt.testing import configs
from tiered_ckpt.save.host_budget import fit_host_memory, ranks_per_machine

from .common import load_values, state_of

MiB = 2**20


def stack(host_memory, *, keep_last=8, keep_best=None, max_inflight=1, memory=True):
    host = {"kind": "memory", "path": "/dev/shm/unused", "keep_last": keep_last, "keep_best": keep_best,
            "best_metric": "loss" if keep_best else None}
    disk = {"kind": "local", "path": "/tmp/unused"}
    return configs.stack("/tmp/unused", *([host] if memory else []), disk, part_size="1MiB", io_threads=2,
                         max_inflight=max_inflight, host_memory=host_memory)


def test_no_budget_changes_nothing():
    assert fit_host_memory(stack(None), 100 * MiB, 1) is None


def test_a_stack_that_fits_keeps_its_keep_last():
    # 1 staging + 8 kept + 1 retiring states of 10 MiB, and 2 read buffers of 1 MiB: 102 MiB
    fit = fit_host_memory(stack("102MiB"), 10 * MiB, 1)
    assert fit.keep_last == {"host": 8} and fit.lowered == () and fit.need == 102 * MiB


def test_keep_last_gives_way_to_the_budget():
    fit = fit_host_memory(stack("101MiB"), 10 * MiB, 1)
    assert fit.keep_last == {"host": 7} and fit.lowered == ("host",) and fit.need <= 101 * MiB
    fit = fit_host_memory(stack("1GiB"), 10 * MiB, 8)  # 8 ranks share the machine's: 128 MiB each
    assert fit.keep_last == {"host": 8}
    fit = fit_host_memory(stack("1GiB"), 10 * MiB, 16)  # 64 MiB each: 1 + k + 1 states and 2 MiB of reads
    assert fit.keep_last == {"host": 4} and fit.need <= 64 * MiB


def test_a_memory_tier_that_keeps_everything_keeps_what_fits():
    fit = fit_host_memory(stack("64MiB", keep_last=None), 10 * MiB, 1)
    assert fit.keep_last == {"host": 4} and fit.lowered == ("host",)


def test_what_cannot_fit_names_the_key_and_the_bytes():
    with pytest.raises(tc.ConfigError, match=r"engine\.host_memory.*needs 32\.00 MiB.*max_inflight") as e:
        fit_host_memory(stack("31MiB"), 10 * MiB, 1)  # 1 staging + 1 kept + 1 retiring + 2 MiB of reads
    assert e.value.key == "engine.host_memory"
    with pytest.raises(tc.ConfigError, match="keep_best"):  # keep_best checkpoints are never given up silently
        fit_host_memory(stack("40MiB", keep_best=2), 10 * MiB, 1)
    with pytest.raises(tc.ConfigError, match="2 staging buffer"):  # no memory tier: staging and reads alone
        fit_host_memory(stack("21MiB", memory=False, max_inflight=2), 10 * MiB, 1)


def test_ranks_per_machine_is_the_most_crowded_machine():
    assert ranks_per_machine(["a", "a", "b"]) == 2 and ranks_per_machine([""]) == 1 and ranks_per_machine([]) == 1


def shm_bytes(root):
    return sum(os.stat(os.path.join(d, f)).st_blocks * 512 for d, _, files in os.walk(root) for f in files)


async def test_the_memory_tier_stays_within_the_budget_while_saves_go_on(make_config, shm_dir):
    """keep_last 8 on the memory tier, but host_memory holds two states beside staging and reads: it keeps
    two, every save is on disk, and the tmpfs never holds more than the budget."""
    size = sum(v.numel() * v.element_size() for v in state_of(0.0).values() if isinstance(v, torch.Tensor)) + 128
    budget = 4 * size + 4 * 64 * 1024  # 1 staging + 2 kept + 1 retiring state, and 4 read buffers of a part
    state = lambda v: state_of(float(v))  # noqa: E731
    async with tc.Engine(make_config(host_memory=budget)) as engine:
        reserved = await engine.reserve(state(0))
        assert reserved.budget == budget and reserved.keep_last == {"host": 2}
        most = 0
        for step in range(1, 9):
            await (await engine.save(step, state(step))).wait()
            most = max(most, shm_bytes(shm_dir / "host"))
        statuses = await engine.statuses()
        assert [s.step for s in statuses if "host" in s.complete] == [7, 8]
        assert all("disk" in s.complete for s in statuses)
        assert most <= budget, (most, budget)
        info, out = await load_values(engine)
        assert info.step == 8 and info.tier == "host" and torch.all(out["w"] == 8.0)


async def test_a_budget_too_small_fails_the_save_clearly_and_loses_nothing(make_config):
    state = state_of(1.0)
    async with tc.Engine(make_config()) as engine:
        await (await engine.save(1, state)).wait()
    async with tc.Engine(make_config(host_memory="512KiB")) as engine:
        with pytest.raises(tc.ConfigError, match=r"engine\.host_memory") as e:
            await engine.save(2, state)
        assert "needs" in str(e.value)
        with pytest.raises(tc.ConfigError, match=r"engine\.host_memory"):
            await engine.reserve(state)
        info, out = await load_values(engine)
        assert info.step == 1 and torch.all(out["w"] == 1.0)
        assert [s.step for s in await engine.statuses()] == [1]


def test_ls_says_the_budget_and_what_the_memory_tier_holds_of_it(tmp_path, shm_dir, capsys):
    import json

    from .test_cli import save, write_config
    from .test_cli_scripts import run_cli

    config = write_config(tmp_path, shm_dir, host_keep=4, host_memory="4MiB")
    save(config, [1, 2, 3])
    status, out, _ = run_cli(capsys, "-c", str(config), "ls")
    assert status == 0 and "host_memory budget on this machine: 4.00 MiB" in out, out
    status, out, _ = run_cli(capsys, "-c", str(config), "ls", "--json")
    listing = json.loads(out)
    assert listing["host_memory_budget"] == 4 * MiB
    held = sum(e["nbytes"] for e in listing["host_memory"])
    assert 0 < held <= 4 * MiB


def test_a_memory_tier_cannot_keep_every_under_a_budget():
    raw = {"engine": {"host_memory": "1GiB"},
           "tiers": [{"name": "host", "kind": "memory", "path": "/dev/shm/unused", "keep_last": 2, "keep_every": 100},
                     {"name": "disk", "kind": "local", "path": "/tmp/unused", "keep_every": 100, "keep_last": 2}]}
    with pytest.raises(tc.ConfigError, match="keep_every") as e:
        parse_config(raw)
    assert e.value.key == "tiers.host.keep_every"
    del raw["tiers"][0]["keep_every"]
    parse_config(raw)  # on the disk tier it is fine
