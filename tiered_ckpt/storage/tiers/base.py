"""The tier driver contract: six async methods over string keys, and `FileTier` for drivers whose values are
files on this machine.

Drivers hold no retries and no concurrency limits (the pipeline owns both), and import nothing from the
engine but this module and `errors`. Blocking work runs in `self.executor` threads so the event loop never
blocks. Lifecycle (`start_tier` below, used by the engine and by the conformance suite alike): construct the
driver with its options, set `executor`, call `bind()`, `open()`, then any mix of the methods from one event
loop, then `close()`.
"""
from __future__ import annotations

import asyncio
import os
import socket
from abc import ABC, abstractmethod
from concurrent.futures import Executor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, ClassVar, Iterable, Sequence, TypeVar

T = TypeVar("T")


@dataclass(frozen=True)
class NoOptions:
    """A driver's Options: a frozen dataclass whose fields are the TOML keys. Field metadata (a plain dict) may
    say `"size": True` (accepts "64MiB"), and bound a number: `"min"` (inclusive), `"above"` (exclusive),
    `"max"`, with `"why"` for the error; the config refuses a number outside them, and any float that is not
    finite, naming the key."""


class Tier(ABC):
    Options: ClassVar[type] = NoOptions
    # set by a driver whose last list() left out part of its store that it could not reach just now (a peer ring
    # passing a server over): what that part holds is unknown, so nothing may be judged gone from that listing
    listed_partly: bool = False

    def __init__(self, name: str, options: Any):
        self.check_options(name, options)
        self.name = name
        self.options = options
        self.executor: Executor | None = None

    @classmethod
    def check_options(cls, name: str, options: Any) -> None:
        """What the fields' bounds cannot say (a non-empty list, values that depend on each other): a
        ConfigError naming `tiers.<name>.<key>`. Run when the config is parsed or checked (before any
        connection) and when the driver is built."""

    def bind(self, *, rank: int, world_size: int, node: int, num_nodes: int) -> None:
        """Where this process sits (rank, node), for tiers whose placement depends on it. Called before open()."""

    async def open(self) -> None:
        """Connect or create directories. Called once before any other method."""

    async def close(self) -> None:
        """Release connections. Pending operations have finished when the engine calls this."""

    @abstractmethod
    async def write(self, key: str, data: memoryview) -> None:
        """Store `data` under `key`, replacing any old value atomically; durable when it returns."""

    @abstractmethod
    async def read_into(self, key: str, out: Sequence[memoryview]) -> int:
        """Fill the buffers in `out` in order from the stored value; return the stored value's length.

        Raises TierNotFound when the key is absent. A length other than sum(len(b) for b in out) means the
        stored value is truncated or oversized; the buffers' contents are then undefined.
        """

    @abstractmethod
    async def read(self, key: str) -> bytes:
        """Return a whole (small) value, e.g. a manifest. Raises TierNotFound."""

    @abstractmethod
    async def delete(self, prefix: str) -> None:
        """Remove every key starting with `prefix`; absent keys are not an error."""

    @abstractmethod
    async def list(self, prefix: str) -> list[str]:
        """Keys starting with `prefix`, sorted."""

    async def list_from(self, prefix: str, start: str) -> list[str]:
        """Keys starting with `prefix` that sort at or after `start`, sorted: a load looks at the newest step
        folders of a job only (`<job>/step-…` names are fixed-width, so their order is the steps'). The default
        filters `list`; a store that can start a listing part-way (a folder's sorted names) overrides it."""
        return [key for key in await self.list(prefix) if key >= start]

    async def list_names(self, prefix: str, start: str | None = None) -> list[str]:
        """The names directly under folder `prefix` (ending in "/"), sorted: a job's step folders, so that a writer
        can compare them with the steps its index lists without listing every key of every step. With `start`,
        only the names that sort at or after it (a writer looks at the window of its newest steps: on S3 the
        listing starts there). The default cuts them from `list` (`list_from` with `start`); a store that can list
        one level (a folder) overrides it."""
        keys = await self.list(prefix) if start is None else await self.list_from(prefix, prefix + start)
        return sorted({key[len(prefix):].split("/", 1)[0] for key in keys})

    async def probe(self, key: str) -> None:
        """Write a small value under `key` and remove it: whether this process can write the tier at all (a writer's
        start). A store that keeps what it knows of its folders between looks overrides it (a local tier: its own
        probe is no change of a job folder's names)."""
        await self.write(key, memoryview(b"probe"))
        await self.delete(key)

    async def missing(self, keys: Sequence[str]) -> list[str]:
        """Which of `keys` are no longer stored, checked just before a commit, so a checkpoint never becomes
        complete on a tier with parts already gone (a cache that restarted or evicted, a file removed by
        an operator). The default, [], suits stores whose acknowledged writes cannot vanish (S3)."""
        return []

    # -- optional: what `tiered-ckpt gc` uses to measure and clean; the defaults suit any store ------------
    async def usage(self, prefix: str) -> dict[str, int] | None:
        """Every key starting with `prefix` and its stored size in bytes, or None when the store cannot tell
        cheaply (the default: gc then counts what it removes without bytes)."""
        return None

    async def debris(self, prefix: str, older_than: float) -> list[tuple[str, int]]:
        """What writers that died left under `prefix` that `list()` never shows and no key names (a file
        driver's temp files and empty folders), untouched for more than `older_than` seconds, as (name,
        bytes). The default: nothing."""
        return []

    async def remove_debris(self, names: Sequence[str], older_than: float) -> int:
        """Remove what `debris()` returned, each only if still untouched for `older_than` seconds (and a
        folder only if still empty); return the bytes freed."""
        return 0

    async def run_blocking(self, fn: Callable[..., T], *args: Any) -> T:
        return await asyncio.get_running_loop().run_in_executor(self.executor, fn, *args)


class FileTier(Tier):
    """A tier whose values are files under a folder of this machine (`local`, `memory`). The engine uses
    these methods, and no other of a driver's internals, to stage a save straight into the tier's files (the
    memory tier first in the stack: see save/arena.py) and to verify and copy a value a chunk at a time on a load."""

    @property
    @abstractmethod
    def capacity(self) -> int | None:
        """The most bytes the tier may hold (None: no limit but the file system's)."""

    @abstractmethod
    def path_of(self, key: str) -> Path:
        """The file that holds `key` (it may not exist)."""

    @abstractmethod
    def account(self, nbytes: int, what: str) -> None:
        """Count `nbytes` that entered the tier without `write` (negative: that left it without `delete`), e.g.
        a staging file renamed under a key. Raises TierFull past the capacity."""

    def count_only(self, owned: Callable[[str], bool]) -> None:
        """Before open(): count toward `capacity` only the files whose key (their path below the tier's folder)
        `owned` accepts, e.g. one job's, when other jobs share the folder. Default: a tier counts nothing."""

    async def recount(self) -> None:
        """Count the bytes held toward `capacity` again from the files (another process, the trainer's retention
        or the node agent's drain, wrote or removed some since). Default: a tier counts nothing."""

    def make_folder(self, path: Path) -> None:
        """Create folder `path` (inside the tier's) and its missing parents, the tier's own folder with the mode
        the tier wants for it (the memory tier's is private: 0700)."""
        path.mkdir(parents=True, exist_ok=True)

    async def read_chunks(self, key: str, chunk_size: int, length: int,
                          consume: Callable[[memoryview, int], bool]) -> int | None:
        """Hand the stored value to `consume(chunk, offset)` one `chunk_size` piece at a time, in order, through
        one small buffer that stays in cache (consume verifies a piece and copies it on while it is hot);
        `consume` returns False to stop. Returns the value's stored length (when it is not `length`, nothing is
        handed over), or None when the value cannot be read that way now (the caller reads a copy instead)."""
        return None


async def start_tier(tier: Tier, executor: Executor, *, rank: int = 0, world_size: int = 1, node: int = 0,
                     num_nodes: int = 1) -> Tier:
    """The driver lifecycle up to ready: executor, placement, open. The engine and the conformance suite
    both start drivers through here, so a driver tested by the suite is started exactly as in a job."""
    tier.executor = executor
    tier.bind(rank=rank, world_size=world_size, node=node, num_nodes=num_nodes)
    await tier.open()
    return tier


def folder_stamp(path: str | Path) -> tuple[int, int, int] | None:
    """(modification time in ns, inode, link count) of a folder, None if there is none: what says that a folder's
    listing kept in memory is still its content (`listing_trusted`)."""
    try:
        st = os.stat(path)
    except (FileNotFoundError, NotADirectoryError):
        return None
    return st.st_mtime_ns, st.st_ino, st.st_nlink


def racy_ns(mtime_ns: int) -> int:
    """How close to a folder's modification time a listing may be and still miss a change made in the same tick:
    2 s where the time has no sub-second part (a file system that keeps seconds), else 50 ms (a kernel's coarse
    clock ticks every few milliseconds)."""
    return 2_000_000_000 if mtime_ns % 1_000_000_000 == 0 else 50_000_000


def listing_trusted(stamp: tuple[int, int, int], listed_at_ns: int) -> bool:
    """Whether a listing made at `listed_at_ns` of a folder with `stamp` holds every change that keeps the stamp:
    where the link count counts subfolders (ext4, xfs, tmpfs, Lustre, NFS) a folder made or removed changes it;
    elsewhere (btrfs keeps one link) only a listing made a tick after the last change, as git judges its index."""
    return stamp[2] > 1 or listed_at_ns - stamp[0] > racy_ns(stamp[0])


def machine_name() -> str:
    """This machine's name, as placement needs it: `TIERED_CKPT_HOST` when set (several emulated nodes on one
    host), else the host name. A node is a machine, not a rank number: torchrun's node rank follows the order
    in which agents joined, so it can change when a job restarts; the machine's name does not."""
    return os.environ.get("TIERED_CKPT_HOST") or socket.gethostname()


def scatter(pieces: Iterable[bytes | memoryview], out: Sequence[memoryview], start: int = 0) -> None:
    """Copy `pieces`, consecutive bytes of one value beginning at byte `start` of it, into `out`, the buffers
    that the whole value fills in order. One pass, no join: for drivers that receive a value whole, in
    chunks, or by ranges. Bytes beyond the last buffer are dropped."""
    bufs = iter(out)
    buf, buf_start, pos = memoryview(b""), 0, start  # the current buffer and the value offset it begins at
    for piece in pieces:
        src, taken = memoryview(piece).cast("B"), 0
        while taken < len(src):
            while pos >= buf_start + len(buf):
                buf_start += len(buf)
                nxt = next(bufs, None)
                if nxt is None:
                    return
                buf = nxt
            lo = pos - buf_start
            n = min(len(buf) - lo, len(src) - taken)
            buf[lo : lo + n] = src[taken : taken + n]
            pos, taken = pos + n, taken + n
