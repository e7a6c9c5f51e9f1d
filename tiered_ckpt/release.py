"""Per-tensor structures (lists and dicts of 100k-1M entries) emptied in a worker thread, a bounded batch at a time,
and dicts of that size grown a block at a time (`BlockedDict`).

Freeing is work the interpreter does while it holds the GIL, and a thread gives the GIL back only between
bytecodes, never inside one C call. So the last reference to a dict of 1M entries dropped on the event loop stalls
it for the whole teardown, and dropped in a worker thread as one `clear()` it stalls the loop just as long (a
thread that holds the GIL holds up the loop too). Here each batch is one short C call: a thread that empties a
structure of 1M entries lets the loop run between batches (docs/benchmarks.md, *Event-loop stalls against the
tensor count*).
"""
from __future__ import annotations

import asyncio
from typing import Any, Callable, Generic, Hashable, Iterator, MutableMapping, Protocol, TypeVar

BATCH = 2048  # entries freed per C call: ~0.1-0.5 ms each, however large the structure


class Releasable(Protocol):
    def release(self) -> None:
        """Empty what it holds per tensor (in a thread: `empty` on each of its large containers)."""


def empty(container: Any) -> None:
    """Empty a list, dict or set BATCH entries at a time (anything else is left as it is)."""
    if isinstance(container, list):
        while container:
            del container[-BATCH:]
    elif isinstance(container, dict):
        while container:
            for _ in range(min(BATCH, len(container))):
                container.popitem()
    elif isinstance(container, set):
        while container:
            for _ in range(min(BATCH, len(container))):
                container.pop()


def release_all(things: list[Any]) -> None:
    """`release()` each of `things` that has one, `empty` the others, then empty the list itself."""
    for thing in things:
        if hasattr(thing, "release"):
            thing.release()
        else:
            empty(thing)
    things.clear()


async def release_off_loop(things: list[Any]) -> None:
    """Empty `things` (and what each holds per tensor) in a worker thread. The caller hands over its last
    references in the list and keeps none, or the objects outlive this and are freed wherever the last one goes."""
    await asyncio.to_thread(release_all, things)


# -- growing: a dict of millions of entries cut into blocks ------------------------------------------------------
# A dict that grows past ~1M entries moves them all into a fresh, larger table in one C call: 40-70 ms with the GIL
# held on this project's 2-core machine, so a worker thread that builds one stalls the event loop as long. Cut
# into blocks of at most ~64k entries (the caller's `block` function of the key, chosen so that neighbouring keys
# share a block), each resize moves one block: a few milliseconds. Iteration goes block by block, each in
# insertion order.

K = TypeVar("K", bound=Hashable)
V = TypeVar("V")


class BlockedDict(MutableMapping[K, V], Generic[K, V]):
    """A dict in blocks (see above); `release()` empties it a batch at a time."""

    __slots__ = ("_blocks", "_block")

    def __init__(self, block: Callable[[K], Hashable]):
        self._blocks: dict[Hashable, dict[K, V]] = {}
        self._block = block

    @classmethod
    def of_blocks(cls, block: Callable[[K], Hashable], blocks: dict[Hashable, dict[K, V]]) -> "BlockedDict[K, V]":
        """One made of its blocks (each keyed as `block` names it), built elsewhere a block at a time."""
        out: BlockedDict[K, V] = cls(block)
        out._blocks = blocks
        return out

    def __getitem__(self, key: K) -> V:
        block = self._blocks.get(self._block(key))
        if block is None:
            raise KeyError(key)
        return block[key]

    def get(self, key: K, default: V | None = None) -> V | None:  # type: ignore[override]
        block = self._blocks.get(self._block(key))
        return default if block is None else block.get(key, default)

    def __setitem__(self, key: K, value: V) -> None:
        name = self._block(key)
        block = self._blocks.get(name)
        if block is None:
            block = self._blocks[name] = {}
        block[key] = value

    def __delitem__(self, key: K) -> None:
        name = self._block(key)
        block = self._blocks.get(name)
        if block is None:
            raise KeyError(key)
        del block[key]
        if not block:
            del self._blocks[name]

    def __contains__(self, key: object) -> bool:
        block = self._blocks.get(self._block(key))  # type: ignore[arg-type]
        return block is not None and key in block

    def __iter__(self) -> Iterator[K]:
        for block in list(self._blocks.values()):
            yield from block

    def __len__(self) -> int:  # (a sum over the blocks: not for a loop over entries)
        return sum(map(len, self._blocks.values()))

    @property
    def largest_block(self) -> int:
        """The entries of its largest block: the most that one resize moves."""
        return max(map(len, self._blocks.values()), default=0)

    def release(self) -> None:
        """Empty it a batch at a time (in a thread, the loop runs between batches)."""
        while self._blocks:
            _, block = self._blocks.popitem()
            empty(block)


INDEX_SHIFT = 16  # by_index: 65,536 consecutive keys a block
OFFSET_SHIFT = 22  # by_rank_offset: 4 MiB of a rank's stream a block


def by_index(index: int) -> int:
    """The block of an integer key: 2**INDEX_SHIFT consecutive keys share one."""
    return index >> INDEX_SHIFT


BLOCKS = 64  # by_hash's


def by_hash(key: Hashable) -> int:
    """The block of any key: one of BLOCKS by its hash (for 1M keys: ~16k a block)."""
    return hash(key) & (BLOCKS - 1)


def hash_block_mask() -> int:
    """What by_hash masks a hash with, read when asked (a table that computes blocks of many hashes at once uses
    it, so that its blocks stay by_hash's)."""
    return BLOCKS - 1


def by_rank_offset(key: tuple[int, int]) -> tuple[int, int]:
    """The block of a (saved rank, byte offset) key: a rank's 2**OFFSET_SHIFT bytes of stream share one (64k chunks
    at most, each starting 64-byte aligned)."""
    return key[0], key[1] >> OFFSET_SHIFT
