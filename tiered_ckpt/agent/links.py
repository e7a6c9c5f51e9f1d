"""What the agent opens for one trainer rank's saves: its tiers (a TierIO of its own, built from the config tables
the trainer sent) and the index, fenced as the writer is.

Fencing by proxy: the agent commits only what the writer itself could. On a Redis index every write checks the
writer's epoch (sent with each save): a newer writer fences the agent's commits as it fences the zombie's. The file
index has no epochs: its fence is the writer's lease, an exclusive flock; the trainer passes its open lease file
along (SCM_RIGHTS), so the lock stays held, by the agent, until the agent's drains of that session are done: no
new writer starts meanwhile (one that tries waits, as for a cleaner, once the trainer is gone). Other index kinds
are refused."""
from __future__ import annotations

import fcntl
import logging
import os
import socket
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..config import TierConfig, parse_config
from ..errors import ConfigError, Fenced, TieredCkptError
from ..lifecycle.busy import BusySteps
from ..lifecycle.host_memory import owned_by
from ..lifecycle.removal import Removal
from ..lifecycle.retention import Retention
from ..lifecycle.rules import Rules
from ..save.commit import Committer
from ..save.drain import DrainOrder
from ..storage.index import Index, index_path, open_index
from ..storage.index.file import CLEANER
from ..storage.tier_io import TierIO

log = logging.getLogger(__name__)


def link_key(order: DrainOrder) -> tuple[Any, ...]:
    link = order.link
    return (link["index"], order.job, order.rank, order.session, repr(link["tiers"]))


def supported_index(url: str) -> str | None:
    """Why the agent cannot commit under this index's fencing, or None when it can."""
    if url.startswith("file://") or url.startswith("redis"):
        return None
    return f"index {url.split('://')[0]}:// has no fencing the agent can act under"


@dataclass
class Link:
    """One trainer rank's session, as the agent drains it; once that trainer is gone, also the retention of the
    tiers it drains (the pass that rank's trainer ran: rank 0's keeps the index's books, every rank's its files)."""

    order: DrainOrder  # the first save handed over: the job's side is the same for each
    io: TierIO
    index: Index
    commit: Committer
    retention: Retention
    lease_fds: list[int] = field(default_factory=list)
    pending: int = 0  # drains running
    # the trainer's open connections that handed this link a save: more than one after a reconnect (a handoff
    # that timed out drops its connection, the next save makes another), and the old one's close can come last
    channels: set[Any] = field(default_factory=set)
    # the file index's lease record as the trainer wrote it, kept when trainer_gone wrote the agent's over it: a
    # trainer that comes back (its connections had all closed; it reconnects for its next save) gets it back
    trainer_record: bytes | None = None
    trainer: str = ""  # the lock file the trainer's client holds while its engine is open (journal.trainer_alive)
    farewell: bool = False  # the trainer said bye: its engine closes

    @property
    def attached(self) -> bool:
        return bool(self.channels)

    def attach(self, channel: Any) -> None:
        if not self.channels:  # back after trainer_gone: its record again
            self.restore_record()
        self.channels.add(channel)

    def restore_record(self) -> None:
        """The trainer's lease record back where trainer_gone wrote the agent's (it holds the lease again)."""
        if self.trainer_record is not None:
            self._write_record(self.trainer_record)
            self.trainer_record = None

    def detach(self, channel: Any) -> None:
        """`channel` closed or said bye: the trainer is gone once no connection of it is left."""
        if channel in self.channels:
            self.channels.discard(channel)
            if not self.channels:
                self.trainer_gone()

    @classmethod
    async def open(cls, order: DrainOrder, fds: list[int]) -> "Link":
        link = order.link
        why = supported_index(link["index"])
        if why:
            raise ConfigError(why, key="engine.agent")
        configs = _tiers(link["tiers"])
        io = TierIO(configs, link.get("io_threads", 4), background_nice=link.get("background_nice", 0))
        for name in io:  # a file tier's capacity bounds the job's bytes, as in the trainer
            tier = io.file_tier(name)
            if tier is not None:
                tier.count_only(owned_by(order.job))
        index = open_index(link["index"], timeout=link["index_timeout"])
        try:
            await io.open(rank=order.rank, world_size=order.world_size, node=link["node"], num_nodes=link["num_nodes"])
            await index.open()
        except BaseException:
            io.shutdown()
            raise
        index.epoch = order.epoch  # the writer's: a newer writer's fence refuses these commits too
        commit = Committer(index, order.job, rank=order.rank, world_size=order.world_size, session=order.session,
                           timeout=link["commit_timeout"], index_timeout=link["index_timeout"])
        if commit.incarnation != order.incarnation:
            await index.close()
            await io.close()
            raise ConfigError(f"the agent's index {index.identity} is not the trainer's (its folder would be "
                              f"{commit.incarnation}, not {order.incarnation})", key="engine.index")
        busy = BusySteps()  # the agent's own: the trainer's saves and loads ended with it
        removal = Removal(order.job, index, io, busy, set(), rank=order.rank, world_size=order.world_size)
        retention = Retention(order.job, index, removal, busy, {t.name: Rules.of(t) for t in configs})
        return cls(order, io, index, commit, retention, list(fds))

    async def retain(self, tier: str, step: int) -> None:
        """The tier's retention, as save `step` ends there (a failure is said: the next pass tries again)."""
        try:
            await self.retention.apply(tier, finishing=step)
        except (TieredCkptError, OSError) as e:
            log.warning("agent: job %s tier %s: retention after step %d: %s: %s", self.order.job, tier, step,
                        type(e).__name__, e)

    async def make_room(self, tier: str, step: int) -> bool:
        """Retire a checkpoint on a full `tier`, once the trainer is gone (an attached trainer is handed the save
        back: its retention knows what its loads hold)."""
        return not self.attached and await self.retention.make_room(tier, finishing=step)

    def trainer_gone(self) -> None:
        """The trainer's last connection closed: a writer that starts now waits for the lease the agent holds (as for
        a cleaner's) instead of being refused."""
        self.channels.clear()
        if self.lease_fds and self.trainer_record is None:
            try:
                current = os.pread(self.lease_fds[0], 4096, 0)
            except OSError:
                current = b""
            if current and not current.startswith(CLEANER.encode()):
                self.trainer_record = current
        self._write_record(agent_record(self.order.session).encode())

    def _write_record(self, record: bytes) -> None:
        for fd in self.lease_fds:
            try:
                os.ftruncate(fd, 0)
                os.pwrite(fd, record, 0)
            except OSError:
                pass

    async def close(self) -> None:
        try:
            await self.commit.close()
            await self.index.close()
            await self.io.close()
        finally:
            for fd in self.lease_fds:
                os.close(fd)  # the writer's lease goes with the last descriptor
            self.lease_fds = []


def agent_record(session: str) -> str:
    """The file index's lease record while the agent finishes a session's saves with no trainer attached: a
    cleaner's (a writer that starts meanwhile waits for it), naming the session (an adopting agent checks it)."""
    return (f"{CLEANER} (tiered-ckpt agent pid {os.getpid()} on {socket.gethostname()} finishing saves of "
            f"session {session} since {time.strftime('%Y-%m-%d %H:%M:%S %z')})")


def lease_path(order: DrainOrder) -> Path | None:
    """The file index's writer lease of the order's job; None for another index."""
    url = order.link["index"]
    return index_path(url) / order.job / "writer.lock" if url.startswith("file://") else None


def lease_record(order: DrainOrder, fds: list[int]) -> str | None:
    """What the file index's writer lease says now (its holder: the writer's record), journaled with an order;
    read through the passed lease (rank 0's) or from its file (the other ranks pass none). None: no file index."""
    path = lease_path(order)
    if path is None:
        return None
    try:
        raw = os.pread(fds[0], 4096, 0) if fds else path.read_bytes()[:4096]
    except OSError:
        return None
    return raw.decode(errors="replace").strip()


def retake_lease(order: DrainOrder, journaled: str | None, held: int | None = None) -> list[int]:
    """An adopting agent's fence on the file index, whose lease died with the agent that held it: take the job's
    writer lease again, as a cleaner of the order's session. Refused (Fenced) when a process holds it (a newer
    writer) or when it says anything but what it said when the order came or the agent's own record for that
    session: a writer took it in between, so this order is a zombie's and must not commit. [] for a Redis index
    (its fence is the epoch the order carries)."""
    path = lease_path(order)
    if path is None:
        return []
    if held is not None:  # this agent holds the lease already, for another rank of the same session
        return [os.dup(held)]
    try:
        fd = os.open(path, os.O_RDWR)
    except FileNotFoundError:
        raise Fenced(f"job {order.job!r}: no writer lease at {path}: step {order.step} is not finished") from None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 4096, 0).decode(errors="replace").strip()
            raise Fenced(f"job {order.job!r}: the writer lease {path} is held ({holder}): step {order.step} of "
                         f"session {order.session} is not finished") from None
        record = os.pread(fd, 4096, 0).decode(errors="replace").strip()  # read under the lock: no race
        if record != journaled and f"finishing saves of session {order.session} " not in record:
            raise Fenced(f"job {order.job!r}: the writer lease {path} says {record!r}, not what it said for session "
                         f"{order.session} (a newer writer took it since): step {order.step} is not finished")
        os.ftruncate(fd, 0)
        os.pwrite(fd, agent_record(order.session).encode(), 0)
    except BaseException:
        os.close(fd)
        raise
    return [fd]


def _tiers(tables: list[dict[str, Any]]) -> tuple[TierConfig, ...]:
    """The trainer's tiers, rebuilt and checked as a config file's are (a minimal engine table beside them)."""
    return parse_config({"engine": {}, "tiers": [dict(t) for t in tables]}, source="<the trainer's handoff>").tiers


def tier_tables(configs: list[TierConfig], cwd: str) -> list[dict[str, Any]]:
    """The tiers as config tables, relative paths made absolute from the trainer's folder (the agent's differs)."""
    out = []
    for t in configs:
        table = {k: v for k, v in vars(t).items() if k != "options" and v is not None}
        options = vars(t.options) if t.options is not None else {}
        for k, v in options.items():
            if v is None:
                continue
            if k == "path" and isinstance(v, str) and not os.path.isabs(v):
                v = str(Path(cwd) / v)
            table[k] = v
        out.append(table)
    return out
