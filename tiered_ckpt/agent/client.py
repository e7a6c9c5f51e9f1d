"""The trainer's side of the agent: connect (starting the agent, detached, when none answers), hand a save off
once the memory tier committed it, and learn each tier's outcome back, so that SaveHandle.wait() works as before.

A handoff that no agent accepts within `handoff_timeout` (none starts, or one hangs) raises AgentUnavailable
naming the folder, and the trainer drains that save in-process; so does an agent that goes away, or says nothing
for `outcome_timeout`, before every tier reported (the tiers it did not report are written again in-process)."""
from __future__ import annotations

import asyncio
import fcntl
import itertools
import logging
import os
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, AsyncIterator, Callable, Sequence

from ..errors import AgentUnavailable
from ..save.drain import DrainOrder, TierOutcome
from .folder import FOLDER_ENV, log_path, make_folder, socket_path
from .wire import Channel, ChannelClosed

log = logging.getLogger(__name__)
HANDOFF_TIMEOUT = 10.0  # seconds for an agent to answer (one started now included) and accept a save


def start_agent(folder: Path, idle: float | None = None) -> None:
    """Start an agent for `folder`, detached (its own session; a launcher in between exits at once, so the agent
    is nobody's child here and outlives this process). A second one started meanwhile sees the lock and exits."""
    make_folder(folder)
    command = [sys.executable, "-m", "tiered_ckpt.cli", "agent", "--detach"]
    if idle is not None:
        command += ["--idle", str(idle)]
    env = {**os.environ, FOLDER_ENV: str(folder)}
    subprocess.run(command, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                   stderr=subprocess.DEVNULL, check=False, timeout=30)


def spawn_detached(folder: Path, idle: float | None) -> None:
    """The launcher's work (`tiered-ckpt agent --detach`): the agent in a new session, its output to its log."""
    command = [sys.executable, "-m", "tiered_ckpt.cli", "agent"]
    if idle is not None:
        command += ["--idle", str(idle)]
    with open(log_path(folder), "ab") as out:
        os.chmod(log_path(folder), 0o600)
        subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=out, stderr=out, start_new_session=True,
                         close_fds=True, env={**os.environ, FOLDER_ENV: str(folder)})


async def connect(folder: Path, *, start: bool, timeout: float, idle: float | None = None) -> Channel:
    """A channel to the folder's agent, after `hello`; with `start`, one is started when none answers."""
    deadline = time.monotonic() + timeout
    started = False
    loop = asyncio.get_running_loop()
    while True:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.setblocking(False)
        try:
            await asyncio.wait_for(loop.sock_connect(sock, str(socket_path(folder))),
                                   max(0.01, deadline - time.monotonic()))
            channel = Channel(sock)
            await channel.send({"op": "hello", "pid": os.getpid()})
            reply, _ = await asyncio.wait_for(channel.recv(), max(0.01, deadline - time.monotonic()))
            if reply.get("op") != "hello":
                channel.close()
                raise AgentUnavailable(f"the agent at {socket_path(folder)} answered {reply!r} to hello")
            return channel
        except BaseException as e:
            # closed whatever ended the attempt: a handoff cancelled by its own time limit must not leave the
            # socket open (the agent, once it answers, would count a client that never goes and never idle out)
            sock.close()
            if not isinstance(e, (FileNotFoundError, ConnectionRefusedError, ChannelClosed, asyncio.TimeoutError)):
                raise
            if not start and not isinstance(e, asyncio.TimeoutError):
                raise AgentUnavailable(f"no agent runs at {socket_path(folder)}") from None
            if time.monotonic() >= deadline:
                raise AgentUnavailable(f"no agent answered at {socket_path(folder)} within {timeout:g}s "
                                       f"({type(e).__name__}); see {log_path(folder)}") from None
            if start and not started:
                started = True
                await asyncio.to_thread(start_agent, folder, idle)
            await asyncio.sleep(0.05)


class AgentDrain:
    """One handed-off save: each tier's outcome as the agent reports it."""

    def __init__(self, client: "AgentClient", ident: int, tiers: Sequence[str], timeout: float):
        self.client, self.ident, self.timeout = client, ident, timeout
        self.pending = set(tiers)
        self.queue: asyncio.Queue[dict[str, Any] | BaseException] = asyncio.Queue()

    async def outcomes(self) -> AsyncIterator[TierOutcome]:
        try:
            while self.pending:
                try:
                    message = await asyncio.wait_for(self.queue.get(), self.timeout)
                except asyncio.TimeoutError:
                    raise AgentUnavailable(f"the agent said nothing of tiers {sorted(self.pending)} for "
                                           f"{self.timeout:g}s") from None
                if isinstance(message, BaseException):
                    raise message
                if message["op"] == "outcome":
                    outcome = TierOutcome.from_wire(message["outcome"])
                    self.pending.discard(outcome.tier)
                    yield outcome
        finally:
            self.client.drains.pop(self.ident, None)


class AgentClient:
    """One engine's connection to its machine's agent (save.drain.Drainer). `link`: the job's side of every
    order; `lease_fds()`: the writer lease's descriptors to pass along (the file index's), if any."""

    def __init__(self, folder: Path, link: dict[str, Any], lease_fds: Callable[[], list[int]], *,
                 handoff_timeout: float = HANDOFF_TIMEOUT, outcome_timeout: float = 3600.0,
                 idle: float | None = None):
        self.folder = folder
        self.link = link
        self.lease_fds = lease_fds
        self.handoff_timeout = handoff_timeout
        self.outcome_timeout = outcome_timeout
        self.idle = idle
        self.drains: dict[int, AgentDrain] = {}
        self._accepting: dict[int, asyncio.Future[dict[str, Any]]] = {}
        self._ids = itertools.count(1)
        self._channel: Channel | None = None
        self._reader: asyncio.Task[None] | None = None
        self._connecting = asyncio.Lock()
        self._lock: tuple[str, int] | None = None  # the trainer's lock file, held while this client lives

    def _alive(self) -> str:
        """The path of a lock file this process holds while its engine is open: an agent that adopts a dead
        agent's orders leaves this trainer's alone while it is held (the trainer writes them itself)."""
        if self._lock is None:
            folder = make_folder(self.folder) / "trainers"
            folder.mkdir(mode=0o700, exist_ok=True)
            path = folder / f"{os.getpid()}-{os.urandom(4).hex()}.lock"
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
            fcntl.flock(fd, fcntl.LOCK_EX)  # a fresh name: nobody else holds it
            self._lock = (str(path), fd)
        return self._lock[0]

    async def hand_off(self, order: DrainOrder) -> AgentDrain:
        order = DrainOrder(**{**vars(order), "link": self.link})
        try:
            return await asyncio.wait_for(self._hand_off(order), self.handoff_timeout)
        except asyncio.TimeoutError:
            await self._drop(AgentUnavailable("the handoff timed out"))
            raise AgentUnavailable(f"the agent at {socket_path(self.folder)} did not accept step {order.step} "
                                   f"within {self.handoff_timeout:g}s (hung?); the trainer writes it") from None
        except (ChannelClosed, OSError) as e:
            await self._drop(AgentUnavailable(str(e)))
            raise AgentUnavailable(f"the agent at {socket_path(self.folder)} went away ({e}); the trainer writes "
                                   f"step {order.step}") from None

    async def _hand_off(self, order: DrainOrder) -> AgentDrain:
        channel = await self._connected()
        ident = next(self._ids)
        drain = self.drains[ident] = AgentDrain(self, ident, order.tiers, self.outcome_timeout)
        accepted = self._accepting[ident] = asyncio.get_running_loop().create_future()
        try:
            size = sum(len(b) for _, b in order.records) + 64 * len(order.keys)
            await channel.send({"op": "drain", "id": ident, "order": order.to_wire(), "trainer": self._alive()},
                               self.lease_fds(), size=size)
            reply = await accepted
        except BaseException:
            self.drains.pop(ident, None)
            raise
        finally:
            self._accepting.pop(ident, None)
        if reply["op"] != "accepted":
            self.drains.pop(ident, None)
            raise AgentUnavailable(f"the agent refused step {order.step}: {reply.get('error')}")
        return drain

    async def _connected(self) -> Channel:
        async with self._connecting:
            if self._channel is None:
                self._channel = await connect(self.folder, start=True, timeout=self.handoff_timeout, idle=self.idle)
                self._reader = asyncio.create_task(self._read(self._channel))
            return self._channel

    async def _read(self, channel: Channel) -> None:
        try:
            while True:
                message, fds = await channel.recv()
                for fd in fds:
                    os.close(fd)
                ident = message.get("id")
                if message.get("op") in ("accepted", "refused"):
                    future = self._accepting.get(ident)
                    if future is not None and not future.done():
                        future.set_result(message)
                elif ident in self.drains:
                    self.drains[ident].queue.put_nowait(message)
        except (ChannelClosed, OSError) as e:
            self._fail_all(AgentUnavailable(f"the agent at {socket_path(self.folder)} went away mid-drain ({e})"))
        finally:
            if self._channel is channel:
                self._channel = None
            channel.close()

    def _fail_all(self, error: BaseException) -> None:
        for future in self._accepting.values():
            if not future.done():
                future.set_exception(error)
        for drain in self.drains.values():
            drain.queue.put_nowait(error)

    async def _drop(self, error: BaseException) -> None:
        """Give up the connection (a hung agent): every drain waiting on it learns so."""
        channel, self._channel = self._channel, None
        if channel is not None:
            channel.close()
        if self._reader is not None:
            self._reader.cancel()
            await asyncio.gather(self._reader, return_exceptions=True)
            self._reader = None
        self._fail_all(error)

    async def settle(self, job: str) -> int:
        """Before this engine's first save: the drains of `job` an earlier trainer left are finished (`settle`)."""
        return await settle(self.folder, job, self.link["index"], self.outcome_timeout)

    async def close(self) -> None:
        await self._drop(AgentUnavailable("the engine closed"))
        if self._lock is not None:
            path, fd = self._lock
            self._lock = None
            Path(path).unlink(missing_ok=True)
            os.close(fd)


def journal_pending(folder: Path) -> bool:
    """Whether an earlier agent left orders in its journal (an agent that starts adopts them)."""
    try:
        return any(name.endswith(".order") for name in os.listdir(folder / "journal"))
    except (FileNotFoundError, NotADirectoryError):
        return False


async def settle(folder: Path, job: str, index: str, timeout: float) -> int:
    """At an engine's open, before its first save fences earlier incarnations out: wait (at most `timeout`) for
    the agent to finish the drains of `job` an earlier trainer left, adopted from the journal of a dead agent
    included (an agent is started for that when the journal holds orders and none runs). Returns how many it
    waited for; 0 when no agent runs and the journal is empty."""
    try:
        channel = await connect(folder, start=journal_pending(folder), timeout=min(timeout, HANDOFF_TIMEOUT))
    except AgentUnavailable:
        if journal_pending(folder):
            log.warning("the journal at %s holds saves to finish but no agent answered; see %s", folder,
                        log_path(folder))
        return 0
    try:
        await channel.send({"op": "settle", "job": job, "index": index})
        reply, _ = await asyncio.wait_for(channel.recv(), timeout)
        return int(reply.get("drains", 0))
    except asyncio.TimeoutError:
        log.warning("the agent at %s still drains saves of job %s an earlier trainer left after %gs; this engine "
                    "goes on (its first save fences them out)", folder, job, timeout)
        return 0
    except ChannelClosed:
        return 0
    finally:
        channel.close()


async def agent_status(folder: Path, timeout: float = 5.0) -> dict[str, Any] | None:
    """What the folder's agent drains (its `status` answer); None when no agent runs there."""
    try:
        channel = await connect(folder, start=False, timeout=timeout)
    except AgentUnavailable:
        return None
    try:
        await channel.send({"op": "status"})
        reply, _ = await asyncio.wait_for(channel.recv(), timeout)
        return reply
    finally:
        channel.close()
