"""A memory-tier marker that lands after the agent gave its save up: the trainer (agent_saver.py) sends its durable
marker of step 2 to the Redis index through a proxy that holds it, and is SIGKILLed; the agent sees it gone, waits
its grace, and gives the order up; then the proxy lets the marker through, as a slow index would. The step must
not then look whole on the memory tier with a disk copy nobody writes: the agent recorded the end of that
session's commit first, and the late marker is refused. Real processes: the trainer, its agent, redis-server."""
import asyncio
import hashlib
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tiered_ckpt.agent.client import agent_status
from tiered_ckpt.storage.index import status_of
from tiered_ckpt.storage.index.redis import _SCRIPTS, RedisIndex
from tiered_ckpt.testing.configs import stack_dict, write_toml

HERE = Path(__file__).parent
pytestmark = pytest.mark.slow
COMMIT_SHA = hashlib.sha1(_SCRIPTS["commit"].encode()).hexdigest().encode()  # mark_durable's EVALSHA


class HoldingProxy:
    """A TCP proxy to redis-server that, once `arm`ed, holds the first request carrying a durable marker (and what
    follows it on that connection) until `release`, even after the client that sent it died."""

    def __init__(self, port: int):
        self.port = port
        self.armed = False
        self.held = asyncio.Event()
        self.released = asyncio.Event()
        self.delivered = asyncio.Event()

    async def start(self) -> str:
        self.server = await asyncio.start_server(self._client, "127.0.0.1", 0)
        return f"redis://127.0.0.1:{self.server.sockets[0].getsockname()[1]}/0"

    async def _client(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.port)
        back = asyncio.create_task(self._pipe(up_reader, writer))
        holding = False
        try:
            while chunk := await reader.read(1 << 16):
                if self.armed and COMMIT_SHA in chunk:
                    self.armed, holding = False, True
                    self.held.set()
                    await self.released.wait()  # the trainer may be dead by now: its bytes still go on
                up_writer.write(chunk)
                await up_writer.drain()
                if holding:
                    holding = False
                    self.delivered.set()
        except ConnectionError:
            pass
        finally:
            if self.held.is_set() and not self.delivered.is_set():
                await self.released.wait()
            await asyncio.sleep(0.5)  # the server answers the held request before the connection goes
            back.cancel()
            up_writer.close()
            writer.close()

    @staticmethod
    async def _pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while chunk := await reader.read(1 << 16):
                writer.write(chunk)
                await writer.drain()
        except (ConnectionError, RuntimeError):
            pass

    async def close(self) -> None:
        self.released.set()
        self.server.close()


async def test_a_memory_marker_landing_after_the_agent_gave_the_save_up_commits_nothing(tmp_path, shm_dir,
                                                                                    monkeypatch, redis_server):
    folder = tmp_path / "agent"
    monkeypatch.setenv("TIERED_CKPT_AGENT_DIR", str(folder))
    monkeypatch.setenv("TIERED_CKPT_AGENT_IDLE", "1")
    redis = redis_server()
    proxy = HoldingProxy(redis.port)
    url = await proxy.start()
    raw = stack_dict(tmp_path, {"kind": "memory", "capacity": "1GiB", "keep_last": 2}, "local", shm=shm_dir,
                     job="late", part_size="1MiB", agent="on", index=url)
    config = write_toml(tmp_path / "late.toml", raw)
    proc = subprocess.Popen([sys.executable, str(HERE / "agent_saver.py"), str(config), "wait"],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    index = RedisIndex(redis.url)
    await index.open()
    try:
        assert (await asyncio.to_thread(proc.stdout.readline)).strip() == "committed 1"
        proxy.armed = True
        proc.stdin.write("go\n")
        proc.stdin.flush()
        await asyncio.wait_for(proxy.held.wait(), 60)  # step 2's marker on the memory tier, sent and held
        proc.send_signal(signal.SIGKILL)
        assert await asyncio.to_thread(proc.wait, 20) == -signal.SIGKILL
        deadline = time.monotonic() + 30  # the agent sees the trainer gone and, after its grace, gives step 2 up
        while (status := await agent_status(folder)) is not None and status["drains"]:
            assert time.monotonic() < deadline, status
            await asyncio.sleep(0.1)
        proxy.released.set()  # the marker lands now, well after the trainer died
        await asyncio.wait_for(proxy.delivered.wait(), 10)
        await asyncio.sleep(1.0)  # the server has run it
        step2 = await status_of(index, "late", 2)
        assert step2 is not None
        # before: complete on host, the disk copy abandoned (pending forever, in nobody's hands)
        assert "host" not in step2.complete, step2
        assert "abandoned by the node agent" in step2.failed.get("host", ""), step2
        step1 = await status_of(index, "late", 1)
        assert step1 is not None and step1.complete == {"host", "disk"}
    finally:
        proc.kill()
        proc.wait()
        await index.close()
        await proxy.close()
