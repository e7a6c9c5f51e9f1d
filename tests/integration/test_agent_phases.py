"""Kill the trainer, or its node agent, in each phase of a save (`TIERED_CKPT_FAULT`,
tiered_ckpt/lifecycle/fault_points.py: the process SIGKILLs itself at that point) with [engine] agent = "on", a
memory tier and two slower tiers (disk, far). Killed before the memory tier's commit (the agent may hold the order
already): step 2 looks whole nowhere, and the restart resumes step 1. Killed after it: every tier the save targets
completes (by the agent with no restart, by the trainer itself when only its agent died, or by the next agent,
which adopts a dead agent's journal at the restart's open), the restart resumes step 2, and after a reboot wipes
the memory tier step 2 still loads from disk and from far. At every moment what the index lists complete loads
bit-exact from that tier alone: no half copy is ever visible."""
import asyncio
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import tiered_ckpt as tc
from tiered_ckpt.testing.agents import agent_pid, alive
from tiered_ckpt.testing.configs import stack_dict, write_toml

from .phase_saver import N, state

HERE = Path(__file__).parent
pytestmark = pytest.mark.slow
ALL = {"host", "disk", "far"}

# id: (TIERED_CKPT_FAULT, the trainer dies, the agent dies, tiers step 2 must be complete on once the kill is
# over and before any restart, the step a restart resumes). A save's phases, in order: staged, its parts and
# records on the memory tier, handed off to the agent (accepted and journaled there), the memory tier's commit (no
# moment lies between that commit and the handoff: the agent drains once the index says the tier committed), then
# per slower tier in the agent: a part, the records, the commit; then every tier drained.
CASES = {
    "trainer-staged": ("trainer:staged@2", True, False, set(), 1),
    "trainer-records-on-host": ("trainer:records-written:host@2", True, False, set(), 1),
    # the agent holds the order, the memory tier never commits: it abandons the order, writes nothing
    "trainer-handed-off": ("trainer:handed-off@2", True, False, set(), 1),
    "trainer-host-committed": ("trainer:committed:host@2", True, False, ALL, 2),
    # the trainer lives: it writes what its agent did not report
    "agent-accepted": ("agent:accepted@2", False, True, ALL, 2),
    "agent-part-on-disk": ("agent:part-written:disk@2", False, True, ALL, 2),
    "agent-committed-disk": ("agent:committed:disk@2", False, True, ALL, 2),
    # both die: the next agent adopts the journal at the restart's open
    "both-accepted": ("trainer:committed:host@2,agent:accepted@2", True, True, {"host"}, 2),
    "both-part-on-disk": ("trainer:committed:host@2,agent:part-written:disk@2", True, True, {"host"}, 2),
    "both-records-on-far": ("trainer:committed:host@2,agent:records-written:far@2", True, True, {"host"}, 2),
    "both-committed-disk": ("trainer:committed:host@2,agent:committed:disk@2", True, True, {"host", "disk"}, 2),
    "both-drained": ("trainer:committed:host@2,agent:drained@2", True, True, ALL, 2),
}


async def listing(config: Path) -> dict[int, set[str]]:
    """Each step's complete tiers, as a reader sees them (agent off: this starts no agent)."""
    async with tc.Engine.from_toml(config, role="reader", agent="off") as engine:
        return {c.step: set(c.complete) async for c in engine.list()}


async def whole_where_listed(config: Path) -> dict[int, set[str]]:
    """Every tier the index lists step 2 complete on holds it whole: it loads bit-exact from that tier alone."""
    found = await listing(config)
    async with tc.Engine.from_toml(config, role="reader", agent="off") as engine:
        for tier in sorted(found.get(2, set())):
            out = {"w": torch.zeros(N)}
            info = await engine.load(out, step=2, tiers=[tier])
            assert info.fallbacks == [] and torch.equal(out["w"], state(2)["w"]), (tier, info)
    return found


@pytest.mark.parametrize("case", CASES)
async def test_a_kill_in_each_phase_of_a_save_leaves_nothing_half_and_loses_nothing_committed(
        tmp_path, shm_dir, monkeypatch, case):
    fault, trainer_dies, agent_dies, after_kill, resumed = CASES[case]
    folder = tmp_path / "agent"
    monkeypatch.setenv("TIERED_CKPT_AGENT_DIR", str(folder))
    monkeypatch.setenv("TIERED_CKPT_AGENT_IDLE", "1")
    config = write_toml(tmp_path / "phases.toml", stack_dict(
        tmp_path, {"kind": "memory", "capacity": "64MiB", "keep_last": 2}, "local", "far:local", shm=shm_dir,
        job="phases", part_size="64KiB", agent="on", commit_timeout=20))
    proc = subprocess.run([sys.executable, str(HERE / "phase_saver.py"), str(config)], capture_output=True,
                          text=True, timeout=60, env={**os.environ, "TIERED_CKPT_FAULT": fault})
    lines = proc.stdout.split("\n")
    assert "committed 1" in lines, proc.stderr
    if trainer_dies:
        assert proc.returncode == -signal.SIGKILL, proc.stderr
        assert "tiered_ckpt fault point trainer:" in proc.stderr, proc.stderr
    else:  # its agent died: the trainer wrote the tiers it did not report, and every one committed
        assert proc.returncode == 0, proc.stderr
        assert "done 2 host disk far" in lines, proc.stdout + proc.stderr
    first = agent_pid(folder)
    if agent_dies:
        deadline = time.monotonic() + 20
        while alive(first):
            assert time.monotonic() < deadline, "the agent did not die at its fault point"
            await asyncio.sleep(0.05)
        log = (folder / "agent.log").read_text()
        assert "tiered_ckpt fault point agent:" in log, f"agent {first}:\n{log}\ntrainer:\n{proc.stderr}"
    # with no restart: the agent (alive) finishes what it was handed, bounded by the tiers' timeouts
    deadline = time.monotonic() + 20
    while True:
        found = await whole_where_listed(config)  # meanwhile nothing looks whole that is not
        assert found[1] == ALL
        if after_kill <= found.get(2, set()) or time.monotonic() > deadline:
            break
        await asyncio.sleep(0.2)
    assert after_kill <= found.get(2, set()), found
    if resumed == 1:
        assert found.get(2, set()) == set(), found
    if "trainer:handed-off" in fault:  # it held the order: abandoned once the trainer went unmarked
        deadline = time.monotonic() + 20
        while "went before it marked step 2 durable on tier host; nothing drained" not in (
                log := (folder / "agent.log").read_text()):
            assert time.monotonic() < deadline, log
            await asyncio.sleep(0.1)

    # the job restarts: its engine's open lets the next agent adopt a dead agent's journal, then it resumes
    async with tc.Engine.from_toml(config) as engine:
        out = {"w": torch.zeros(N)}
        info = await engine.load(out)
        assert info.step == resumed and torch.equal(out["w"], state(resumed)["w"])
    found = await whole_where_listed(config)
    assert found.get(2, set()) == (ALL if resumed == 2 else set()), found
    assert not list((folder / "journal").glob("*.order"))

    shutil.rmtree(shm_dir)  # a reboot: the memory tier is gone
    async with tc.Engine.from_toml(config, agent="off") as engine:
        for tier in ("disk", "far"):
            out = {"w": torch.zeros(N)}
            info = await engine.load(out, tiers=[tier])
            assert (info.step, info.tier) == (resumed, tier) and torch.equal(out["w"], state(resumed)["w"])

    deadline = time.monotonic() + 15  # nothing to drain, nobody attached: every agent goes
    while alive(last := agent_pid(folder)):
        assert time.monotonic() < deadline, f"agent {last} did not exit when idle"
        await asyncio.sleep(0.1)
