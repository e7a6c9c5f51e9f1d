"""The agent: accepts trainers on the Unix socket, drains the saves they hand off to the slower tiers (one
copy-then-commit per tier, save/drain.py), reports each tier's outcome back while the trainer is connected, and
finishes the drain whether or not it still is. It exits once nothing is left to drain and no trainer has been
connected for `idle` seconds.

Messages (wire.py), each a map with "op": `hello` {"pid", "version"} → {"op": "hello", "pid", "version",
"environment" (environment.py)}; `drain` {"id", "order"} (+ the file index's lease) → `accepted` {"id"} or `refused`
{"id", "error"}, then one `outcome` {"id", "outcome"} per tier and `drained` {"id"}; `status` → {"op": "status",
"pid", "version", "drains": [...], "clients"}; `settle` {"job", "index"} → `settled` {"job", "drains"} once no drain
of that job without its trainer is left (an engine asks at open, before its first save fences such drains out);
`bye` → `bye` once the connection's links that drain nothing are closed (an engine's close: the file index's writer
lease the agent held for them is free).

Only `drain` needs the client's hello to name this agent's protocol version (it is refused otherwise); `status`
and `settle` are answered whatever the version. A connection of another version (or with no hello) is not
counted among the clients: it neither holds the agent nor restarts its idle clock, so trainers of another
release, which connect and go at each save, cannot keep it from exiting.

An order comes before the memory tier's commit (save/job.py hands it over right before this rank's durable marker
there): it is drained once the index says that tier committed the step, and abandoned (each tier's outcome
"abandoned", nothing written) when the tier fails or its trainer goes without having marked it (save/drain.py,
`wait_for_source`), once the index recorded that the session's commit there is over (a marker landing later is
refused); an order whose abandonment the index did not take stays in the journal for the next agent.

Each accepted order is journaled first (journal.py) and forgotten once every tier of it settled; an agent that
starts adopts what an earlier one left (`_adopt`): orders of trainers still alive are dropped (the trainer saw its
agent go and writes those tiers itself), the others are drained again under the writer's fencing (the Redis
epoch they carry; the file index's lease, taken again only if no newer writer took it since), each tier only if
the index does not already say it settled.
"""
from __future__ import annotations

import asyncio
import fcntl
import logging
import os
import resource
import signal
import socket
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from ..errors import ConfigError, Fenced
from ..lifecycle import fault_points
from ..save.drain import AbandonNotRecorded, DrainOrder, TierOutcome, drain_tier, end_source_commit, wait_for_source
from ..storage.index import CommitState
from ..storage.index.base import status_of
from .folder import lock_path, make_folder, mount_namespace, socket_path
from .environment import environment_digest
from .journal import Entry, Journal, trainer_alive
from .links import Link, lease_record, link_key, retake_lease
from .wire import VERSION, Channel, ChannelClosed

log = logging.getLogger(__name__)
IDLE_SECONDS = 10.0  # nothing to drain and no trainer attached this long: the agent exits
GREETING = 10.0  # seconds a new connection may take to send its first message (its hello)


@dataclass
class Drained:
    """One handed-off save as `agent status` shows it: per tier, "pending", "done", "failed", "skipped" or
    "abandoned" (the memory tier never committed it)."""

    job: str
    step: int
    rank: int
    nbytes: int
    tiers: dict[str, str] = field(default_factory=dict)
    since: float = field(default_factory=time.time)


class AgentServer:
    def __init__(self, folder: Path, *, idle: float = IDLE_SECONDS):
        self.folder = folder
        self.idle = idle
        self.mounts = mount_namespace()  # a trainer of another mount namespace is refused (its files may differ)
        self.links: dict[tuple[Any, ...], Link] = {}
        self.drains: dict[int, Drained] = {}
        self.clients = 0
        self.greeting = 0  # connections accepted whose first message has not come yet: they hold the agent too
        self._next = 0
        self._tasks: set[asyncio.Task[None]] = set()  # the clients' connections
        self._running: set[asyncio.Task[None]] = set()  # the drains
        self._last_busy = time.monotonic()
        self._stop = asyncio.Event()
        self._lock_fd: int | None = None
        self.journal = Journal(folder)
        self._adopted: asyncio.Event | None = None  # set once the journal's orders were adopted (serve())
        self._draining: dict[int, tuple[Link, asyncio.Task[None]]] = {}  # what `settle` waits for
        self._superseded: set[int] = set()  # drains a newer engine's settle gave up on (their commit never came)
        self.environment = environment_digest()  # what its S3 clients read: a trainer of another one writes itself

    def claim(self) -> bool:
        """The folder's agent lock (one agent per folder); False when another agent holds it."""
        make_folder(self.folder)
        fd = os.open(lock_path(self.folder), os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            return False
        os.ftruncate(fd, 0)
        os.pwrite(fd, str(os.getpid()).encode(), 0)
        self._lock_fd = fd
        return True

    async def serve(self) -> None:
        """Listen until idle (or SIGTERM / SIGINT); the socket goes with the agent."""
        path = socket_path(self.folder)
        path.unlink(missing_ok=True)  # a dead agent's: the lock says none runs
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        old = os.umask(0o177)
        try:
            listener.bind(str(path))  # created 0600
        finally:
            os.umask(old)
        os.chmod(path, 0o600)
        listener.listen(64)
        listener.setblocking(False)
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self._stop.set)
        self._adopted = asyncio.Event()
        accepting = asyncio.create_task(self._accept(loop, listener))
        adopting = asyncio.create_task(self._adopt())
        watching = asyncio.create_task(self._watch_idle())
        log.info("agent %d listening on %s", os.getpid(), path)
        try:
            await self._stop.wait()
        finally:
            accepting.cancel()
            watching.cancel()
            await asyncio.gather(adopting, return_exceptions=True)
            path.unlink(missing_ok=True)
            listener.close()
            for task in list(self._tasks):
                task.cancel()
            if self._running:  # drains still running (a signal): they finish, bounded by the tiers' timeouts
                await asyncio.gather(*self._running, return_exceptions=True)
            for link in list(self.links.values()):
                await link.close()
            self.links.clear()
        usage = resource.getrusage(resource.RUSAGE_SELF)
        log.info("agent %d exits (%.2f s CPU)", os.getpid(), usage.ru_utime + usage.ru_stime)

    async def _accept(self, loop: asyncio.AbstractEventLoop, listener: socket.socket) -> None:
        while True:
            conn, _ = await loop.sock_accept(listener)
            self._spawn(self._tasks, self._client(Channel(conn)))

    @staticmethod
    def _spawn(tasks: set[asyncio.Task[None]], coro: Any) -> None:
        task = asyncio.create_task(coro)
        tasks.add(task)
        task.add_done_callback(tasks.discard)

    async def _watch_idle(self) -> None:
        while True:
            await asyncio.sleep(min(1.0, self.idle / 4))
            adopting = self._adopted is not None and not self._adopted.is_set()
            if self.clients or self.greeting or adopting or any(link.pending for link in self.links.values()):
                self._last_busy = time.monotonic()
            elif time.monotonic() - self._last_busy >= self.idle:
                self._stop.set()
                return

    async def _client(self, channel: Channel) -> None:
        counted = False  # a client of this version: it holds the agent while connected (IDLE: see the docstring)
        # until its first message (its hello) a connection holds the agent as well: a trainer connecting just as
        # the idle time ran out (a loaded machine: its engine's open took longer than the idle) found the agent
        # gone mid-handshake; one that says nothing for GREETING seconds is closed
        self.greeting += 1
        greeted = False
        mine: set[tuple[Any, ...]] = set()
        try:
            while True:
                if greeted:
                    message, fds = await channel.recv()
                else:
                    try:
                        message, fds = await asyncio.wait_for(channel.recv(), GREETING)
                    finally:
                        greeted = True
                        self.greeting -= 1
                op = message.get("op")
                if op == "hello":
                    await channel.send({"op": "hello", "pid": os.getpid(), "version": VERSION,
                                        "environment": self.environment})
                    if message.get("version") == VERSION and not counted:
                        counted = True
                        self.clients += 1
                elif op == "status":
                    await channel.send(self.status())
                elif op == "settle":
                    await channel.send(await self._settle(str(message.get("job")), str(message.get("index"))))
                elif op == "drain" and not counted:
                    for fd in fds:
                        os.close(fd)
                    await channel.send({"op": "refused", "id": message.get("id"),
                                        "error": f"the agent speaks protocol version {VERSION}; the handoff's hello "
                                                 f"named none or another"})
                elif op == "drain":
                    await self._drain(channel, message, fds, mine)
                elif op == "bye":  # its engine closes: links that drain nothing let the writer's lease go now
                    for key in mine:
                        link = self.links.get(key)
                        if link is not None:
                            link.farewell = True
                            link.detach(channel)
                            await self._close_if_done(key)
                    await channel.send({"op": "bye"})
                else:
                    for fd in fds:
                        os.close(fd)
                    await channel.send({"op": "error", "error": f"unknown op {op!r}"})
        except (ChannelClosed, asyncio.TimeoutError):
            pass
        except Exception as e:  # a bad frame: this client goes, the agent stays
            log.warning("agent: a client's connection failed: %s: %s", type(e).__name__, e)
        finally:
            if counted:
                self.clients -= 1
                self._last_busy = time.monotonic()
            channel.close()
            for key in mine:
                link = self.links.get(key)
                if link is not None:
                    link.detach(channel)
                    await self._close_if_done(key)

    async def _drain(self, channel: Channel, message: dict[str, Any], fds: list[int], mine: set[tuple[Any, ...]]
                     ) -> None:
        """Take a handoff: its link (opened on the first), attached to `channel`, whose links `mine` names."""
        ident = message.get("id")
        try:
            if message.get("mounts", self.mounts) != self.mounts:  # (a folder named by $TIERED_CKPT_AGENT_DIR)
                raise ConfigError(f"the trainer runs in another mount namespace ({message['mounts']}, the agent "
                                  f"{self.mounts}): its memory tier's files may not be the ones this agent sees")
            order = DrainOrder.from_wire(message["order"])
            key = link_key(order)
            link = self.links.get(key)
            if link is None:
                link = self.links[key] = await Link.open(order, fds)
            else:
                for fd in fds:
                    os.close(fd)  # the link holds the lease already
        except Exception as e:
            for fd in fds:
                try:
                    os.close(fd)
                except OSError:
                    pass
            await channel.send({"op": "refused", "id": ident, "error": f"{type(e).__name__}: {e}"})
            return
        link.trainer = str(message.get("trainer") or "")
        link.attach(channel)
        mine.add(key)  # (at once: a connection that closes during what follows is still detached when it ends)
        link.pending += 1
        trainer = link.trainer
        try:  # on file before the trainer hears "accepted": an agent killed from here on loses nothing
            entry = await self.journal.record(order, trainer, lease_record(order, link.lease_fds))
        except OSError as e:
            link.pending -= 1
            await self._tell(channel, {"op": "refused", "id": ident, "error": f"the agent's journal: {e}"})
            return
        # a trainer that went meanwhile (its handoff timed out: it writes the save itself) does not hear it, and the
        # journaled drain goes on all the same, as when "accepted" arrives after the trainer's time limit
        await self._tell(channel, {"op": "accepted", "id": ident})
        fault_points.reached("accepted", order.step)
        self._start(channel, link, key, order, ident, entry, trainer)

    def _start(self, channel: Channel | None, link: Link, key: tuple[Any, ...], order: DrainOrder, ident: Any,
               entry: Path, trainer: str) -> None:
        """Drain `order` (its link's `pending` counted already), reporting on `channel` while it is open.
        `trainer`: the trainer's lock file (journal.py), held while it lives."""
        self._next += 1
        number = self._next
        self.drains[number] = Drained(order.job, order.step, order.rank, sum(order.lengths),
                                      {t: "pending" for t in order.tiers})
        task = asyncio.create_task(self._run(channel, link, key, order, ident, number, entry, trainer))
        self._running.add(task)
        self._draining[number] = (link, task)
        task.add_done_callback(lambda t: (self._running.discard(t), self._draining.pop(number, None)))

    async def _run(self, channel: Channel | None, link: Link, key: tuple[Any, ...], order: DrainOrder, ident: Any,
                   number: int, entry: Path, trainer: str) -> None:
        async def one(tier: str) -> None:
            try:
                file_tier = link.io.file_tier(tier)
                if file_tier is not None:  # the trainer wrote or removed some since: counted from the files
                    await file_tier.recount()
                outcome = await drain_tier(link.io, link.commit, order, tier,
                                           hand_back=lambda: channel in link.channels,
                                           make_room=lambda: link.make_room(tier, order.step))
            except Exception as e:  # a bug: said, and reported as the tier's failure
                log.error("agent: step %d on tier %s: %s: %s", order.step, tier, type(e).__name__, e)
                outcome = TierOutcome(tier, "failed", error=f"{type(e).__name__}: {e}")
            self.drains[number].tiers[tier] = outcome.state
            log.info("agent: job %s step %d rank %d on tier %s: %s %s", order.job, order.step, order.rank, tier,
                     outcome.state, outcome.error)
            if outcome.state == "done" and (channel is None or not link.attached):
                await link.retain(tier, order.step)  # its trainer is gone: nobody else keeps the tier to its rules
            await self._tell(channel, {"op": "outcome", "id": ident, "outcome": outcome.to_wire()})

        async def abandon(why: str) -> None:
            log.warning("agent: job %s step %d rank %d: %s; nothing drained", order.job, order.step, order.rank, why)
            for tier in order.tiers:
                self.drains[number].tiers[tier] = "abandoned"
                outcome = TierOutcome(tier, "abandoned", error=why)
                await self._tell(channel, {"op": "outcome", "id": ident, "outcome": outcome.to_wire()})

        def trainer_gone() -> bool:  # its connection closed, and its process no longer holds its lock
            return (channel is None or not link.attached) and not trainer_alive(trainer)

        try:
            link_conf = link.order.link
            kept = False  # the order stays in the journal: the index did not record its abandonment
            try:
                why = await wait_for_source(link.commit, order, trainer_gone,
                                            link_conf["commit_timeout"] + link_conf["index_timeout"],
                                            superseded=lambda: number in self._superseded)
            except AbandonNotRecorded as e:
                why, kept = str(e), True
            except Exception as e:  # an index error other than unavailability: nothing drained, and said so
                try:
                    why = await end_source_commit(link.commit, order, f"the index did not say whether the memory "
                                                                      f"tier committed: {type(e).__name__}: {e}")
                except AbandonNotRecorded as e2:
                    why, kept = str(e2), True
            if why is not None:
                await abandon(why)
            else:
                await asyncio.gather(*(one(t) for t in order.tiers))
            fault_points.reached("drained", order.step)
            if kept:  # a later agent adopts it again: it drains if the tier committed meanwhile, else records
                log.error("agent: job %s step %d rank %d stays in the journal: %s", order.job, order.step,
                          order.rank, why)
            else:
                Journal.done(entry)  # every tier settled (the index says how): nothing to adopt any more
            await self._tell(channel, {"op": "drained", "id": ident})
        finally:
            link.pending -= 1
            self._last_busy = time.monotonic()
            self.drains.pop(number, None)
            self._superseded.discard(number)
            await self._close_if_done(key)

    async def _tell(self, channel: Channel | None, message: dict[str, Any]) -> None:
        """Report to the trainer if it is still there (a dead trainer's drain goes on all the same)."""
        if channel is None:  # an adopted order: its trainer is gone
            return
        try:
            await channel.send(message)
        except (ChannelClosed, OSError):
            pass

    async def _close_if_done(self, key: tuple[Any, ...]) -> None:
        link = self.links.get(key)
        if link is not None and not link.pending and not link.attached:
            del self.links[key]
            if not link.farewell and trainer_alive(link.trainer):  # only between connections: the lease, which it
                link.restore_record()  # holds on, says so again (a writer that starts now is refused, not kept waiting)
            await link.close()

    async def _adopt(self) -> None:
        """Replay the journal an earlier agent left (killed mid-drain): every order whose trainer is gone is
        drained again, under its writer's fencing, on the tiers the index does not already say settled."""
        assert self._adopted is not None
        try:
            entries = await asyncio.to_thread(self.journal.pending)
            for entry in entries:
                await self._adopt_one(entry)
            for trainer in {e.trainer for e in entries if e.trainer}:
                if not trainer_alive(trainer):
                    Path(trainer).unlink(missing_ok=True)  # a dead trainer's lock, once its orders are adopted
        except Exception as e:  # a bug: said; what is left stays in the journal for the next agent
            log.error("agent: adopting the journal failed: %s: %s", type(e).__name__, e)
        finally:
            self._adopted.set()

    async def _adopt_one(self, entry: Entry) -> None:
        order = entry.order
        what = f"job {order.job} step {order.step} rank {order.rank} (session {order.session})"
        if trainer_alive(entry.trainer):
            log.info("agent: %s: its trainer is alive and writes tiers %s itself; not adopted", what,
                     ", ".join(order.tiers))
            Journal.done(entry.path)
            return
        key = link_key(order)
        link = self.links.get(key)
        if link is None:
            fds: list[int] = []
            try:
                held = next((other.lease_fds[0] for other in self.links.values() if other.lease_fds
                             and other.order.session == order.session and other.order.job == order.job
                             and other.order.link["index"] == order.link["index"]), None)
                fds = await asyncio.to_thread(retake_lease, order, entry.lease_record, held)
                link = await Link.open(order, fds)
            except (Fenced, ConfigError) as e:
                for fd in fds:
                    os.close(fd)
                log.warning("agent: %s is not adopted: %s", what, e)
                Journal.done(entry.path)
                return
            except Exception as e:
                for fd in fds:
                    os.close(fd)
                log.error("agent: %s cannot be adopted now (%s: %s); the next agent tries again", what,
                          type(e).__name__, e)
                return
            self.links[key] = link  # (attached to no connection: its trainer is gone)
        link.pending += 1  # held while the index is asked: another drain of the link may finish meanwhile
        try:
            status = await status_of(link.index, order.job, order.step)
        except Exception as e:
            link.pending -= 1
            await self._close_if_done(key)
            log.error("agent: %s cannot be adopted now: the index says %s: %s; the next agent tries again", what,
                      type(e).__name__, e)
            return
        tiers = tuple(t for t in order.tiers if status is not None and t not in status.settled)
        if not tiers:
            link.pending -= 1
            await self._close_if_done(key)
            log.info("agent: %s: %s; nothing to adopt", what,
                     "gone from the index" if status is None else f"settled on {', '.join(order.tiers)}")
            Journal.done(entry.path)
            return
        log.info("agent: adopting %s: tiers %s", what, ", ".join(tiers))
        self._start(None, link, key, replace(order, tiers=tiers), None, entry.path, entry.trainer)

    async def _settle(self, job: str, index: str) -> dict[str, Any]:
        """Wait until no drain of `job` on `index` is left without its trainer (adopted ones included). A drain
        still waiting for its memory tier's commit is not waited for: with its trainer gone, only other ranks of
        that earlier session could still complete the commit, and a new engine's open means that session is over
        (such a drain abandons the order at once: waiting for it would hold the open, and its file-index lease the
        new writer's first save, up to commit_timeout)."""
        assert self._adopted is not None
        await self._adopted.wait()
        candidates = {number: (link, task, self.drains.get(number)) for number, (link, task) in self._draining.items()
                      if link.order.job == job and link.order.link["index"] == index and not link.attached}
        waiting = []
        for number, (link, task, drained) in candidates.items():
            if drained is not None and await self._source_committed(link, drained.step):
                waiting.append(task)
            else:  # its wait ends now (not at commit_timeout), and its link lets the file index's lease go
                self._superseded.add(number)
        if waiting:
            log.info("agent: job %s: a new engine waits for %d drain(s) of an earlier trainer", job, len(waiting))
            await asyncio.gather(*waiting, return_exceptions=True)
        return {"op": "settled", "job": job, "drains": len(waiting)}

    @staticmethod
    async def _source_committed(link: Link, step: int) -> bool:
        """Whether the index says the memory tier committed `step` of `link`'s session (asked again: a drain's own
        wait may not have polled yet). An index that does not answer: True (the drain decides, and is waited for)."""
        order = link.order
        try:
            state = await link.index.tier_state(order.job, step, order.source, order.session)
        except Exception:
            return True
        return state.state == CommitState.COMPLETE

    def status(self) -> dict[str, Any]:
        return {"op": "status", "pid": os.getpid(), "version": VERSION, "clients": self.clients,
                "idle_exit": self.idle,
                "journal": len(list(self.journal.folder.glob("*.order"))) if self.journal.folder.is_dir() else 0,
                "drains": [{"job": d.job, "step": d.step, "rank": d.rank, "nbytes": d.nbytes, "tiers": d.tiers,
                            "seconds": round(time.time() - d.since, 1)} for d in self.drains.values()]}


def run_agent(folder: Path, idle: float = IDLE_SECONDS) -> int:
    """`tiered-ckpt agent`: serve in the foreground until idle; 0 also when another agent runs (it serves)."""
    fault_points.role = "agent"
    server = AgentServer(folder, idle=idle)
    if not server.claim():
        log.info("an agent already serves %s", folder)
        return 0
    asyncio.run(server.serve())
    return 0
