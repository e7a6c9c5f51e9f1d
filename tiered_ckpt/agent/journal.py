"""The agent's journal: each accepted drain order on file, in the agent's folder, from before the trainer hears
"accepted" until every tier of it settled, so that an agent killed mid-drain loses nothing: the next agent (started
by the next save, at an engine's open, or as `tiered-ckpt agent`) replays what is left (server.py, `adopt`).

One file per order (`journal/<accepted ns>-<pid>-<n>.order`, 0600, written by rename: a reader never sees half
of one): msgpack {"order", "trainer", "lease_record"}. `trainer` is the path of the lock file the trainer's client
holds while its engine is open (a live trainer redoes in-process whatever a dead agent did not report, so its
orders are not adopted); `lease_record` is what the file index's writer lease said when the order came (a lease
that says something else later was taken by a newer writer since: the order is fenced out)."""
from __future__ import annotations

import asyncio
import itertools
import logging
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgpack

from ..save.drain import DrainOrder

log = logging.getLogger(__name__)
SUFFIX = ".order"


@dataclass(frozen=True)
class Entry:
    """One journaled order: where it lies and what it says."""

    path: Path
    order: DrainOrder
    trainer: str  # the trainer's lock file ("" when the trainer sent none)
    lease_record: str | None  # the file index's lease record at acceptance (None: not a file index)


class Journal:
    def __init__(self, folder: Path):
        self.folder = folder / "journal"
        self._numbers = itertools.count(1)

    async def record(self, order: DrainOrder, trainer: str, lease_record: str | None) -> Path:
        """The order on file (fsynced, then renamed into place) before the trainer is told it was accepted."""
        name = f"{time.time_ns():020d}-{os.getpid()}-{next(self._numbers)}{SUFFIX}"
        body = msgpack.packb({"order": order.to_wire(), "trainer": trainer, "lease_record": lease_record},
                             use_bin_type=True)
        return await asyncio.to_thread(self._write, self.folder / name, body)

    def _write(self, path: Path, body: bytes) -> Path:
        self.folder.mkdir(mode=0o700, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            os.write(fd, body)
            os.fsync(fd)
        finally:
            os.close(fd)
        os.rename(tmp, path)
        return path

    @staticmethod
    def done(path: Path) -> None:
        """The order settled on every tier (or was dropped): it is not replayed."""
        path.unlink(missing_ok=True)

    def pending(self) -> list[Entry]:
        """The orders an earlier agent accepted and did not finish, oldest first (half-written files, from an
        agent killed while writing one, were never acknowledged: removed; an unreadable one is said and set
        aside as <name>.bad)."""
        try:
            names = sorted(os.listdir(self.folder))
        except FileNotFoundError:
            return []
        entries = []
        for name in names:
            path = self.folder / name
            if name.endswith(".tmp"):
                path.unlink(missing_ok=True)
                continue
            if not name.endswith(SUFFIX):
                continue
            try:
                raw: dict[str, Any] = msgpack.unpackb(path.read_bytes(), raw=False)
                entries.append(Entry(path, DrainOrder.from_wire(raw["order"]), str(raw.get("trainer") or ""),
                                     raw.get("lease_record")))
            except Exception as e:
                log.error("agent: journal entry %s cannot be read (%s: %s); set aside as %s.bad", path,
                          type(e).__name__, e, name)
                path.rename(path.with_name(name + ".bad"))
        return entries


def trainer_alive(lock: str) -> bool:
    """Whether the trainer whose client holds `lock` still runs (its engine open): the lock is held. A lock
    nobody holds (the trainer died, or closed and left it) or none at all means it does not."""
    import fcntl

    if not lock:
        return False
    try:
        fd = os.open(lock, os.O_RDWR)
    except FileNotFoundError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)
    return False
