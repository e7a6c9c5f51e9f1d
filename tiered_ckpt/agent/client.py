"""The trainer's side of the agent: connect (starting the agent, detached, when none answers), hand a save off
once the memory tier committed it, and learn each tier's outcome back, so that SaveHandle.wait() works as before.

Only a handoff needs an agent of this release's protocol version (wire.VERSION): one of another version (after an
upgrade, an old agent that still runs until its idle exit) is not handed anything, and the trainer does not
connect to that agent again while its socket is the same (each connection would be one more chance to keep it
alive); `settle` and `status` talk to an agent of any version.

A handoff that no agent accepts within `handoff_timeout` (none starts, or one hangs; the agent started at the
engine's open has START_TIMEOUT to come up first) raises AgentUnavailable naming the folder, and the trainer drains
that save in-process; so does an agent that goes away, or says nothing for `outcome_timeout`, before every tier
reported (the tiers it did not report are written again in-process)."""
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
from .folder import FOLDER_ENV, log_path, make_folder, mount_namespace, socket_path
from .environment import environment_digest, environment_tiers
from .wire import VERSION, Channel, ChannelClosed

log = logging.getLogger(__name__)
HANDOFF_TIMEOUT = 10.0  # seconds for an agent to answer (one started now included) and accept a save
# seconds for the agent an engine starts at its open to come up and answer: on a node whose cores the trainers keep
# busy a start took 11 s (2 cores, load 12); the first handoff waits for it (a memory-tier commit later, not a
# blocked step) instead of giving up at HANDOFF_TIMEOUT and leaving that save and the started agent unused
START_TIMEOUT = 30.0
BYE_TIMEOUT = 5.0  # seconds an engine's close waits for the agent to let its links (and a file index's lease) go


# The launcher start_agent runs: a bare interpreter (no site, no tiered_ckpt: 0.1 s CPU where `tiered-ckpt agent
# --detach` took 0.6 s) that starts the agent in a session of its own, its output to its log, and exits
LAUNCHER = """import os, subprocess, sys
with open(sys.argv[1], "ab") as out:
    os.chmod(sys.argv[1], 0o600)
    subprocess.Popen(sys.argv[2:], stdin=subprocess.DEVNULL, stdout=out, stderr=out, start_new_session=True,
                     close_fds=True)
"""


def agent_command(idle: float | None) -> list[str]:
    command = [sys.executable, "-m", "tiered_ckpt.cli", "agent"]
    return command + ["--idle", str(idle)] if idle is not None else command


def start_agent(folder: Path, idle: float | None = None) -> None:
    """Start an agent for `folder`, detached (its own session; a launcher in between exits at once, so the agent
    is nobody's child here and outlives this process). A second one started meanwhile sees the lock and exits."""
    make_folder(folder)
    env = {**os.environ, FOLDER_ENV: str(folder)}
    subprocess.run([sys.executable, "-S", "-E", "-c", LAUNCHER, str(log_path(folder)), *agent_command(idle)],
                   env=env, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                   check=False, timeout=30)


async def connect(folder: Path, *, start: bool, timeout: float, idle: float | None = None,
                  start_timeout: float | None = None) -> Channel:
    """A channel to the folder's agent, after `hello` (its answer in `channel.hello`: the agent's pid and protocol
    version, which may differ from this one: see `check_version`); with `start`, one is started when none answers,
    and then `start_timeout` (if longer) bounds the wait for it instead of `timeout`."""
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
            await channel.send({"op": "hello", "pid": os.getpid(), "version": VERSION})
            reply, _ = await asyncio.wait_for(channel.recv(), max(0.01, deadline - time.monotonic()))
            if reply.get("op") != "hello":
                channel.close()
                raise AgentUnavailable(f"the agent at {socket_path(folder)} answered {reply!r} to hello")
            channel.hello = reply
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
                if start_timeout is not None:
                    deadline = max(deadline, time.monotonic() + start_timeout)
                await asyncio.to_thread(start_agent, folder, idle)
            await asyncio.sleep(0.05)


def check_version(folder: Path, channel: Channel) -> None:
    """AgentUnavailable unless the agent speaks this release's protocol version: a handoff's terms differ between
    versions (an agent of an earlier release drains on other terms)."""
    version, pid = channel.hello.get("version"), channel.hello.get("pid")
    if version != VERSION:
        raise AgentUnavailable(f"the agent at {socket_path(folder)} (pid {pid}) speaks protocol version {version}, "
                               f"this engine {VERSION}: it exits once idle; until then this trainer writes its "
                               f"tiers itself")


def check_environment(folder: Path, channel: Channel, tiers: list[str]) -> None:
    """AgentUnavailable when the agent would write one of `tiers` (those that read the environment: S3's
    credentials, profile, region, proxies) with another environment than this trainer's (environment.py)."""
    if tiers and channel.hello.get("environment") != environment_digest():
        raise AgentUnavailable(f"the agent at {socket_path(folder)} (pid {channel.hello.get('pid')}) runs with "
                               f"other AWS settings (AWS_* variables, HOME, proxies) than this trainer, and would "
                               f"write tier(s) {', '.join(tiers)} with them: this trainer writes its saves itself "
                               f"until that agent exits (once idle; a job with other credentials can use an agent "
                               f"folder of its own, ${FOLDER_ENV})")


def socket_identity(folder: Path) -> tuple[int, int, int] | None:
    """Which agent's socket is there now (each agent binds a new one); None when there is none."""
    try:
        st = os.stat(socket_path(folder))
    except OSError:
        return None
    return st.st_dev, st.st_ino, st.st_ctime_ns


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
        self._bye: asyncio.Future[None] | None = None  # the agent's answer to close()'s goodbye
        # the socket of an agent this trainer cannot use (another protocol version, another environment: see
        # check_environment), and why: not connected to again while it is the same socket (each connection would
        # restart that agent's idle clock), so that it can exit and the next save starts one this trainer can use
        self._unusable: tuple[tuple[int, int, int], str] | None = None
        self._environment_tiers = environment_tiers(link.get("tiers", []))
        self._warming: asyncio.Task[None] | None = None

    def warm(self) -> None:
        """At the engine's open: connect (starting the agent if none answers) in the background, so that the
        first save's handoff, which the memory tier's commit waits for, does not wait for an agent to start (0.7 s
        on a 2-core machine for one trainer, 3 s for three: a trainer killed a few steps after its first save lost
        it). A failure here is only logged: the first handoff connects again."""
        async def connect_now() -> None:
            try:
                await self._connected(start_timeout=START_TIMEOUT)
            except Exception as e:
                log.debug("the node agent at %s is not connected at open (%s: %s); the first save tries again",
                          socket_path(self.folder), type(e).__name__, e)
        self._warming = asyncio.create_task(connect_now())

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
        limit = self.handoff_timeout
        if self._warming is not None and not self._warming.done():
            began = time.monotonic()
            await asyncio.shield(self._warming)  # the agent started at the open (START_TIMEOUT; never raises)
            if self._channel is None:  # none answered: an agent that hangs is not waited for twice
                limit = max(0.0, limit - (time.monotonic() - began))
        try:
            return await asyncio.wait_for(self._hand_off(order), limit)
        except asyncio.TimeoutError:
            await self._drop(AgentUnavailable("the handoff timed out"))
            raise AgentUnavailable(f"the agent at {socket_path(self.folder)} did not accept step {order.step} "
                                   f"within {self.handoff_timeout:g}s (hung?); the trainer writes it") from None
        except AgentUnavailable:  # none answered, or one this trainer cannot use (it says why)
            raise
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
            await channel.send({"op": "drain", "id": ident, "order": order.to_wire(), "trainer": self._alive(),
                                "mounts": mount_namespace()},
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

    async def _connected(self, start_timeout: float | None = None) -> Channel:
        async with self._connecting:
            if self._channel is None:
                if self._unusable is not None:
                    seen, why = self._unusable
                    if socket_identity(self.folder) == seen:
                        raise AgentUnavailable(why)
                    self._unusable = None  # that agent went: the next one is started by this trainer
                channel = await connect(self.folder, start=True, timeout=self.handoff_timeout, idle=self.idle,
                                        start_timeout=start_timeout)
                try:
                    check_version(self.folder, channel)
                    check_environment(self.folder, channel, self._environment_tiers)
                except AgentUnavailable as e:
                    seen = socket_identity(self.folder)  # the socket just connected to
                    channel.close()
                    if seen is not None:
                        self._unusable = (seen, str(e))
                    raise
                self._channel = channel
                self._reader = asyncio.create_task(self._read(self._channel))
            return self._channel

    async def _read(self, channel: Channel) -> None:
        try:
            while True:
                message, fds = await channel.recv()
                for fd in fds:
                    os.close(fd)
                ident = message.get("id")
                if message.get("op") == "bye":
                    if self._bye is not None and not self._bye.done():
                        self._bye.set_result(None)
                elif message.get("op") in ("accepted", "refused"):
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
        """Say goodbye and wait (briefly) for the agent to let this trainer's links go: on the file index it holds
        the writer's lease for them, which the next writer or a gc must be able to take once the engine closed."""
        if self._warming is not None:
            await self._warming  # (bounded by handoff_timeout; never raises)
            self._warming = None
        channel = self._channel
        if channel is not None and not self.drains:
            self._bye = asyncio.get_running_loop().create_future()
            try:
                await channel.send({"op": "bye"})
                await asyncio.wait_for(self._bye, BYE_TIMEOUT)
            except (asyncio.TimeoutError, ChannelClosed, OSError, AgentUnavailable) as e:
                log.info("the agent at %s did not say goodbye (%s); it lets this trainer's links go when it sees "
                         "the connection closed", socket_path(self.folder), type(e).__name__)
            finally:
                self._bye = None
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
        if reply.get("op") != "settled":  # an agent of another version that knows no `settle`: said, not waited
            log.warning("the agent at %s (pid %s, protocol version %s) answered %r to settle: drains of job %s an "
                        "earlier trainer left were not waited for (this engine's first save fences them out)",
                        folder, channel.hello.get("pid"), channel.hello.get("version"), reply, job)
            return 0
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
    """What the folder's agent drains (its `status` answer, of whatever protocol version: "version" says which);
    None when no agent runs there."""
    try:
        channel = await connect(folder, start=False, timeout=timeout)
    except AgentUnavailable:
        return None
    try:
        await channel.send({"op": "status"})
        reply, _ = await asyncio.wait_for(channel.recv(), timeout)
        if reply.get("op") != "status":
            raise AgentUnavailable(f"the agent at {socket_path(folder)} (pid {channel.hello.get('pid')}, protocol "
                                   f"version {channel.hello.get('version')}) answered {reply!r} to status")
        return {**reply, "version": reply.get("version", channel.hello.get("version"))}
    finally:
        channel.close()
