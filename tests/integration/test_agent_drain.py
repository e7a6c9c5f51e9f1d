"""The node agent ([engine] agent = "on") finishes a save whose trainer died right after its memory-tier commit:
the disk copy completes and commits with no restart, and after the memory is wiped a fresh engine loads the step
from disk, bit-exact. Real processes: the trainer, and the agent it starts."""
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
from tiered_ckpt.testing.agents import agent_pid, agent_running, alive, stop_agent
from tiered_ckpt.testing.configs import faults, stack, stack_dict, write_toml

HERE = Path(__file__).parent
pytestmark = pytest.mark.slow


async def test_auto_and_the_default_use_the_agent_where_a_memory_tier_stages_and_off_does_not(tmp_path, shm_dir,
                                                                                              monkeypatch):
    folder = tmp_path / "agent"
    monkeypatch.setenv("TIERED_CKPT_AGENT_DIR", str(folder))
    monkeypatch.setenv("TIERED_CKPT_AGENT_IDLE", "1")
    memory = {"kind": "memory", "capacity": "1GiB", "keep_last": 2}
    for agent, tiers, starts in (("off", (memory, "local"), False), ("auto", ("local",), False),
                                 (None, (memory, "local"), True), ("auto", (memory, "local"), True)):
        config = stack(tmp_path / str(agent) / str(len(tiers)), *tiers, shm=shm_dir, job="default", agent=agent)
        async with tc.Engine(config) as engine:
            await (await engine.save(1, {"w": torch.ones(1000)})).wait()
            assert (await engine.status(1)).complete == {t.name for t in config.tiers}
            assert agent_running(folder) == starts, (agent, tiers)
    stop_agent(folder)


@pytest.mark.parametrize("index", ["file", "redis"])
async def test_a_trainer_killed_after_its_memory_commit_still_gets_its_disk_copy(tmp_path, shm_dir, monkeypatch,
                                                                                redis_server, index):
    """On a Redis index the agent commits under the writer's epoch (carried by the order), on the file index
    under its lease (the descriptor passed along). The disk keeps one checkpoint: the agent runs its retention,
    so step 1 leaves the disk once step 2 committed there, with no trainer left to do it."""
    folder = tmp_path / "agent"
    monkeypatch.setenv("TIERED_CKPT_AGENT_DIR", str(folder))
    monkeypatch.setenv("TIERED_CKPT_AGENT_IDLE", "1")
    on_redis = {"index": redis_server().url} if index == "redis" else {}  # else the file index under tmp_path
    raw = stack_dict(tmp_path, {"kind": "memory", "capacity": "1GiB", "keep_last": 2},
                     {"kind": "faulty", "keep_last": 1}, shm=shm_dir, job="agent", part_size="1MiB", agent="auto",
                     **on_redis)
    config = write_toml(tmp_path / "agent.toml", raw)
    control = faults(tc.load_config(config))
    kill_the_trainer_once_step_2_is_on_memory(config, control)
    pid = agent_pid(folder)
    assert pid is not None and alive(pid)
    async with tc.Engine.from_toml(config, role="reader") as engine:
        listing = {c.step: c for c in [c async for c in engine.list()]}
        assert listing[2].complete == {"host"}  # the trainer is gone, its disk copy not done
        assert control.stalled() >= 1  # the agent is writing it
        step_1_on_disk = tmp_path / "disk" / "agent" / "step-000000000001"
        assert "disk" in listing[1].complete and step_1_on_disk.is_dir()
        control.clear()
        deadline = time.monotonic() + 15
        while "disk" not in listing[2].complete or "disk" in listing[1].tiers or step_1_on_disk.exists():
            assert time.monotonic() < deadline, (listing[1], listing[2], step_1_on_disk.exists())
            await asyncio.sleep(0.1)
            listing = {c.step: c for c in [c async for c in engine.list()]}
        assert listing[1].complete == {"host"}  # the memory tier keeps two
    shutil.rmtree(shm_dir)  # a reboot: the memory tier is gone
    out = {"w": torch.zeros(3 * 2**20)}
    async with tc.Engine.from_toml(config) as engine:
        info = await engine.load(out)
    assert info.step == 2 and info.tier == "disk"
    assert torch.equal(out["w"], torch.arange(3 * 2**20, dtype=torch.float32))
    deadline = time.monotonic() + 10  # nothing to drain, nobody attached: the agent goes
    while alive(pid):
        assert time.monotonic() < deadline, "the agent did not exit when idle"
        await asyncio.sleep(0.1)
    assert not (folder / "agent.sock").exists()


def kill_the_trainer_once_step_2_is_on_memory(config: Path, control) -> None:
    """The trainer (agent_saver.py) commits step 1, then step 2 on the memory tier and is SIGKILLed, while the disk
    copy of step 2 is held (`control`'s stall) until it is dead: the agent has that copy to finish."""
    proc = subprocess.Popen([sys.executable, str(HERE / "agent_saver.py"), str(config), "kill"],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "committed 1"
        control.inject("stall", ops=["write"])
        proc.stdin.write("go\n")
        proc.stdin.flush()
        assert proc.stdout.readline().strip() == "host 2"
        assert proc.wait(timeout=20) == -signal.SIGKILL
    finally:
        proc.kill()
        proc.wait()


def journal(folder: Path) -> list[Path]:
    return sorted((folder / "journal").glob("*.order")) if (folder / "journal").is_dir() else []


def wait_for(predicate, seconds: float, what: str) -> None:
    deadline = time.monotonic() + seconds
    while not predicate():
        assert time.monotonic() < deadline, what
        time.sleep(0.05)


@pytest.mark.parametrize("next_agent", ["engine_open", "cli_after_a_newer_writer"])
async def test_an_agent_killed_mid_drain_is_adopted_by_the_next(tmp_path, shm_dir, monkeypatch, next_agent):
    """The trainer dies after its memory commit, then its agent dies (SIGKILL) mid-copy to disk: the order stays
    in the agent's journal, nothing half-copied looks whole. The next agent, started by an engine's open, finishes
    the disk copy before that engine goes on (bit-exact from disk after the memory is wiped); one started as
    `tiered-ckpt agent` after a newer writer took the job's lease drops the order (fenced), commits nothing."""
    folder = tmp_path / "agent"
    monkeypatch.setenv("TIERED_CKPT_AGENT_DIR", str(folder))
    monkeypatch.setenv("TIERED_CKPT_AGENT_IDLE", "1")
    raw = stack_dict(tmp_path, {"kind": "memory", "capacity": "1GiB", "keep_last": 2}, "faulty", shm=shm_dir,
                     job="agent", part_size="1MiB", agent="on")
    config = write_toml(tmp_path / "agent.toml", raw)
    control = faults(tc.load_config(config))
    kill_the_trainer_once_step_2_is_on_memory(config, control)
    first = agent_pid(folder)
    assert first is not None and alive(first)
    wait_for(lambda: control.stalled() >= 1, 10, "the agent never wrote step 2 to disk")
    assert len(journal(folder)) == 1  # accepted, not finished
    os.kill(first, signal.SIGKILL)  # the agent this test's trainer started
    wait_for(lambda: not alive(first), 10, "the agent did not die")
    control.clear()
    assert len(journal(folder)) == 1
    async with tc.Engine.from_toml(config, role="reader", agent="off") as engine:  # agent off: starts none
        listing = {c.step: c for c in [c async for c in engine.list()]}
    assert listing[2].complete == {"host"} and "disk" not in listing[2].settled  # no half copy looks whole
    if next_agent == "engine_open":
        async with tc.Engine.from_toml(config) as engine:  # its open starts an agent, which adopts step 2
            listing = {c.step: c for c in [c async for c in engine.list()]}
        assert listing[2].complete == {"host", "disk"}
        shutil.rmtree(shm_dir)  # a reboot: the memory tier is gone
        out = {"w": torch.zeros(3 * 2**20)}
        async with tc.Engine.from_toml(config, agent="off") as engine:
            info = await engine.load(out)
        assert info.step == 2 and info.tier == "disk"
        assert torch.equal(out["w"], torch.arange(3 * 2**20, dtype=torch.float32))
    else:
        from tiered_ckpt.storage.index.file import FileIndex

        newer = FileIndex(tmp_path / "index")  # a newer writer of the job came and went
        await newer.fence("agent")
        await newer.close()
        cli = subprocess.run([sys.executable, "-m", "tiered_ckpt.cli", "agent", "--idle", "0.5"], timeout=30,
                             capture_output=True, text=True)
        assert cli.returncode == 0, cli.stderr
        assert "is not adopted" in cli.stderr and "a newer writer took it" in cli.stderr, cli.stderr
        async with tc.Engine.from_toml(config, role="reader", agent="off") as engine:
            listing = {c.step: c for c in [c async for c in engine.list()]}
        assert listing[2].complete == {"host"}
    assert journal(folder) == []
    second = agent_pid(folder)
    wait_for(lambda: second is None or not alive(second), 10, "the agent did not exit when idle")


async def test_a_hung_agent_fails_the_handoff_in_time_and_the_trainer_writes_the_save(tmp_path, shm_dir,
                                                                                       monkeypatch, caplog):
    """An agent stopped with SIGSTOP (its socket accepts, nothing answers): the save's handoff gives up after
    HANDOFF_TIMEOUT with a warning naming the socket, the trainer writes the disk tier in-process, and the job goes
    on: once the agent runs again, the next save is drained by an agent (that one, or, once it went idle, one
    the engine starts)."""
    from tiered_ckpt.agent.client import HANDOFF_TIMEOUT

    folder = tmp_path / "agent"
    monkeypatch.setenv("TIERED_CKPT_AGENT_DIR", str(folder))
    monkeypatch.setenv("TIERED_CKPT_AGENT_IDLE", "1")
    config = stack_dict(tmp_path, {"kind": "memory", "capacity": "1GiB", "keep_last": 2}, "local", shm=shm_dir,
                        job="hung", part_size="1MiB", agent="on")
    cli_log = open(tmp_path / "cli-agent.log", "wb")
    agent = subprocess.Popen([sys.executable, "-m", "tiered_ckpt.cli", "agent", "--idle", "1"],
                             stdout=cli_log, stderr=cli_log)
    try:
        wait_for(lambda: (folder / "agent.sock").exists(), 20, "the agent did not start")
        os.kill(agent.pid, signal.SIGSTOP)
        caplog.set_level("WARNING")
        async with tc.Engine(tc.config.parse_config(config)) as engine:
            began = time.monotonic()
            handle = await engine.save(1, {"w": torch.full((2**20,), 1.0)})
            await handle.wait("host")
            blocked = time.monotonic() - began
            await handle.wait()  # every tier, the disk written by the trainer
            assert HANDOFF_TIMEOUT <= blocked < HANDOFF_TIMEOUT + 5, blocked
            warned = [r.getMessage() for r in caplog.records if "did not accept step 1" in r.getMessage()]
            assert warned and str(folder / "agent.sock") in warned[0] and "the trainer writes tier(s) disk" in \
                warned[0], warned
            os.kill(agent.pid, signal.SIGCONT)
            caplog.clear()
            handle = await engine.save(2, {"w": torch.full((2**20,), 2.0)})
            await handle.wait()
            assert not [r for r in caplog.records if "the trainer writes" in r.getMessage()]
            listing = {c.step: c for c in [c async for c in engine.list()]}
            assert listing[1].complete == listing[2].complete == {"host", "disk"}
    finally:
        if agent.poll() is None:
            os.kill(agent.pid, signal.SIGCONT)
        try:
            assert agent.wait(timeout=15) == 0  # idle once the engine closed: it exits by itself
        finally:
            if agent.poll() is None:
                agent.kill()
                agent.wait()
        cli_log.close()
    last = agent_pid(folder)  # an agent the engine started for step 2, if that one had gone idle
    wait_for(lambda: last is None or not alive(last), 10, "the agent did not exit when idle")
    logs = (tmp_path / "cli-agent.log").read_text() + ((folder / "agent.log").read_text()
                                                       if (folder / "agent.log").exists() else "")
    assert "job hung step 2 rank 0 on tier disk: done" in logs and "step 1 rank 0" not in logs, logs
