"""Which checkpoint folders a live process may still hold: what `gc --other-indexes` and `tiered-ckpt free`
must never remove, whatever they are told.

A folder `<job>/step-…/ix-<index>/<session>/` belongs to one opening of an engine (layout.py). Two signs tell
that its process is alive, neither of them a clock nor a PID:
- its session has a staging folder whose lock a process holds (host_memory.live_sessions): a trainer on this
  machine that stages in the memory tier (the default) holds these folders mapped;
- its index is a file index whose writer lease a process holds (storage/index/file.lease_holder): the trainer
  of that index is running, on this machine or any that shares the index's folder. A folder does not name its
  index, only a hash of it, so the index is read from a manifest of that index's folders.
A Redis index's writer on another machine shows neither sign here; its folders on this machine's memory tier
are then only that machine's staging files if it shares this /dev/shm, which it cannot.
"""
from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Iterable

from ..errors import IntegrityError, TierError
from ..layout import manifest_key
from ..manifest import Manifest
from ..storage.index.file import lease_holder
from .host_memory import StagingFolder, live_sessions_in, memory_tiers

if TYPE_CHECKING:
    from ..storage.tier_io import TierIO


class LiveHolders:
    """Who holds a folder: `holder(folder)` names a live process, or None when no sign of one is found."""

    def __init__(self, sessions: dict[str, StagingFolder], leases: dict[str, str]):
        self.sessions = sessions  # session → a live process's staging folder
        self.leases = leases  # "ix-…" → who holds that file index's writer lease

    def holder(self, folder: str) -> str | None:
        """`folder` is an incarnation, `ix-<index>/<session>` ("" for the folder-less keys: no one's)."""
        ix, _, session = folder.partition("/")
        if session in self.sessions:
            return f"a live process holds it ({self.sessions[session].who()}: its staging folder is locked)"
        if ix in self.leases:
            return f"its index's writer is running (the writer lease is held: {self.leases[ix]})"
        return None


async def live_holders(io: TierIO, job: str, folders: Iterable[tuple[str, int, str]], own: str) -> LiveHolders:
    """The live holders among `folders` ((tier, step, incarnation) of `job`, as listed): every live staging
    session of the stack's memory tiers, and each other file index (one manifest read per index) whose lease is
    held. `own` is this index's folder name (`ix-…`): its lease is the caller's business (gc and free attach to
    it, and judge a running writer's saves by the index's records), not a sign here."""
    sessions = live_sessions_in([root for _, root in memory_tiers(io)])
    leases: dict[str, str] = {}
    tried: set[str] = {own}
    for tier, step, folder in folders:
        ix = folder.partition("/")[0]
        if not folder or ix in tried:
            continue
        identity = await _index_of(io, tier, manifest_key(job, step, folder))
        if identity is None:
            continue  # no manifest here (a save in flight): another folder of the same index may tell
        tried.add(ix)
        if identity.startswith("file://"):
            holder = lease_holder(Path(identity.removeprefix("file://")), job)
            if holder is not None:
                leases[ix] = holder
    return LiveHolders(sessions, leases)


async def _index_of(io: TierIO, tier: str, key: str) -> str | None:
    try:
        data = await io.read(tier, key)
        return (await io.run_blocking(lambda: Manifest.from_bytes(data, source=f"{key} on tier {tier}"))).index
    except (TierError, IntegrityError, OSError):
        return None
