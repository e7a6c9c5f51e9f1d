"""When to save: `should_save(step)` by `save_every_steps`, `save_every_seconds` and `save_on_sigterm`, on the
Engine and the Checkpointer; a real SIGTERM sent to a real training process (tests/multirank/test_save_policy.py
has several ranks)."""
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import tiered_ckpt as tc
from tiered_ckpt.testing.configs import stack_dict, write_toml

from .common import state_of

HERE = Path(__file__).parent


async def test_every_steps_is_answered_without_a_collective(make_config):
    async with tc.Engine(make_config(save_every_steps=3)) as engine:
        answers = [await engine.should_save(step) for step in range(1, 8)]
        assert answers == [False, False, True, False, False, True, False]
        assert engine.coordinator.collectives == 0
    with tc.Checkpointer(make_config(save_every_steps=2)) as ckpt:
        assert [ckpt.should_save(step) for step in (1, 2, 3, 4)] == [False, True, False, True]


async def test_every_seconds_counts_from_the_first_question(make_config):
    """The first answer is no (the clock starts there); asked again and again, the answer turns yes once the time
    has passed (polled, never slept on), and stays yes until the loop saves."""
    async with tc.Engine(make_config(save_every_seconds=0.2)) as engine:
        assert not await engine.should_save(1)
        step = 1
        while not await engine.should_save(step):
            step += 1
            assert step < 10_000_000, "the time rule never fired"
        assert await engine.should_save(step + 1)  # not saved yet: still due
        await (await engine.save(step, state_of(1.0))).wait()


async def test_should_save_without_a_rule_names_the_keys(make_config):
    async with tc.Engine(make_config()) as engine:
        with pytest.raises(tc.ConfigError, match="save_every_steps, save_every_seconds or save_on_sigterm"):
            await engine.should_save(1)


def write_config(tmp_path: Path, shm_dir: Path) -> Path:
    host = {"kind": "memory", "capacity": "256MiB", "keep_last": 2}
    return write_toml(tmp_path / "tiers.toml", stack_dict(tmp_path, host, "local", shm=shm_dir, job="sigterm",
                                                         save_on_sigterm=True))


@pytest.mark.parametrize("mode, status", [("default", -signal.SIGTERM), ("own-handler", 3)])
async def test_sigterm_saves_once_on_every_tier_then_the_process_ends_as_the_signal_said(tmp_path, shm_dir, mode,
                                                                                        status):
    """SIGTERM to a training process with save_on_sigterm: its next should_save says yes, that save is done on
    every tier before save() would return, and then the process ends as SIGTERM ends it: killed by the signal
    by default, or through the handler the program installed before (exit status 3). The loop never goes on."""
    config = write_config(tmp_path, shm_dir)
    proc = subprocess.Popen([sys.executable, str(HERE / "sigterm_loop.py"), str(config), mode],
                            stdout=subprocess.PIPE, text=True)
    try:
        lines = []
        while not lines or lines[-1] != "step 3":
            lines.append(proc.stdout.readline().strip())
            assert lines[-1], "the loop ended before step 3"
        proc.send_signal(signal.SIGTERM)
        lines += [line.strip() for line in proc.stdout]
        assert proc.wait(timeout=120) == status
    finally:
        proc.kill()
        proc.wait()
    assert not [line for line in lines if line.startswith("returned") or "without" in line], lines
    last = int(lines[-1].removeprefix("step "))  # the step the signal was answered at: the loop's last
    async with tc.Engine.from_toml(config) as engine:
        listing = [c async for c in engine.list()]
        assert [(c.step, c.complete) for c in listing] == [(last, {"host", "disk"})]
        out = {"w": torch.zeros(100_000), "progress": {}}
        for tier in ("host", "disk"):
            assert (await engine.load(out, tiers=[tier])).step == last
            assert torch.all(out["w"] == float(last)) and out["progress"] == {"step": last}
