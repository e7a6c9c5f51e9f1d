"""Structure → layout. A Plan says which boxes of which tensors this rank writes, where their bytes go
in its packed stream, and how the stream is cut into parts; on rank 0 it also holds every rank's chunks and
stream lengths, so that the manifest is written without another collective.

Plans hold layout only, never data, so a cached plan cannot make a later checkpoint repeat an earlier
one's values (NeMo-RL#3312). They are cached by a key of names, dtypes, shapes, placements and the world
layout; any change misses the cache. A hit runs no collective. A miss runs three, DCP's pattern: rank 0
broadcasts the digests of its structure and boxes (ranks whose structure or boxes are rank 0's do not send
them), every rank's descriptors go to rank 0 alone (describe.py), which plans the world once (world_plan.py)
and sends each rank its share: its boxes and their offsets, its stream length and the world's. No other rank
holds the world's descriptors or chunks. The cache decision is local: like the training step itself, saves are
SPMD, so every rank changes its state structure at the same save (a rank that does not would stall in the
gather until its timeout).
"""
from __future__ import annotations

import asyncio
import logging
import pickle
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Hashable, NamedTuple, Sequence

import torch

from ..manifest import pieces
from ..buffers import tensor_bytes
from ..checksum import checksum
from ..distributed.coordinator import Coordinator
from ..distributed.dtensor import is_dtensor, layout_key, local_box
from ..errors import RankFailed, StateError
from ..layout import part_count, part_range
from ..manifest.table import TensorTable
from .describe import Described, describe, own_suffix
from .local_copies import LocalCopies, LocalCopy
from .world_plan import ALIGN, WorldPlan, plan_world

__all__ = ["ALIGN", "Box", "LocalCopies", "LocalCopy", "Plan", "Planner", "build_plan", "structure_key"]
log = logging.getLogger(__name__)


class Box(NamedTuple):
    """What a rank tells the coordinator of one of its tensors (DCP's WriteItem is the model): its path, dtype,
    element size, global shape, the box of it the rank holds (offsets and sizes), and whether no other rank
    can hold that box (describe.py)."""

    path: str
    dtype: str
    itemsize: int
    global_shape: tuple[int, ...]
    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    alone: bool = False


@dataclass(frozen=True)
class Plan:
    """This rank's part of a save's layout. `tensors` (the world's chunks, the manifest's table) and
    `rank_nbytes` (every rank's stream length) are rank 0's alone: None on the others."""

    key: Hashable
    rank: int
    world_size: int
    part_size: int
    local: LocalCopies
    nbytes: int  # this rank's stream
    total_nbytes: int  # every rank's streams together
    max_nbytes: int  # the largest rank's stream (every rank fits its host memory to it alike)
    tensors: TensorTable | None = None
    rank_nbytes: tuple[int, ...] | None = None

    @property
    def num_parts(self) -> int:
        return part_count(self.nbytes, self.part_size)

    def part_range(self, index: int) -> tuple[int, int]:
        return part_range(self.nbytes, self.part_size, index)


class PlanKey:
    """Names, dtypes, shapes, placements and layout, as tuples of at most PIECE entries each: hashed by a few of
    them, compared a piece at a time. One tuple of 1M paths is hashed and compared in one C call each (~50 ms at
    1M, in a thread but holding the GIL that the loop waits for: manifest/pieces.py)."""

    __slots__ = ("_head", "_pieces", "_hash")

    def __init__(self, head: tuple, columns: Sequence[Sequence[Any]]):
        self._head = (*head, *(len(c) for c in columns))
        self._pieces = tuple(tuple(c[i:i + pieces.PIECE]) for c in columns for i in range(0, len(c), pieces.PIECE))
        self._hash = hash((self._head, *(c[0] for c in columns if len(c)), *(c[-1] for c in columns if len(c))))

    def __hash__(self) -> int:
        return self._hash

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, PlanKey):
            return NotImplemented
        return (self._hash == other._hash and self._head == other._head
                and all(a == b for a, b in zip(self._pieces, other._pieces)))


def structure_key(paths: list[str], tensors: list[torch.Tensor], world_size: int, part_size: int) -> PlanKey:
    """Names, dtypes, shapes, placements and layout as one key for the plan cache."""
    layout = [x for t in tensors for x in layout_key(t)]  # flat: no object kept per tensor
    return PlanKey((world_size, part_size), (paths, [t.dtype for t in tensors], layout))


# A state of up to this many plain tensors is keyed on the event loop (about a microsecond of Python a tensor): a
# trip to a worker thread and back costs more than that, most of it holding the GIL that the training thread
# wants. A DTensor's key reads its mesh (tens of microseconds): any DTensor, and the key is made in a thread. (The
# walk stays in a thread whatever the size: it runs the caller's state_dict(), whose cost is not ours to bound.)
SMALL_STATE = 512


class Planner:
    def __init__(self, part_size: int, coordinator: Coordinator | None = None, *, cache_size: int = 8):
        self.part_size = part_size
        self.coordinator = coordinator or Coordinator()
        self.cache_size = cache_size
        self._cache: OrderedDict[PlanKey, Plan] = OrderedDict()
        self.misses = 0
        self.last: Plan | None = None  # the plan of the last save (the next one most likely gets it again)

    @property
    def rank(self) -> int:
        return self.coordinator.rank

    async def plan(self, paths: list[str], tensors: list[torch.Tensor]) -> Plan:
        args = (paths, tensors, self.coordinator.world_size, self.part_size)
        small = len(tensors) <= SMALL_STATE and all(type(t) is torch.Tensor for t in tensors)
        # the key looked up in a thread too: hashing and comparing a key of 1M paths is a stall on the loop
        key, plan = self._look_up(args) if small else await asyncio.to_thread(self._look_up, args)
        if plan is not None:
            self.last = plan
            return plan
        self.misses += 1
        error: BaseException | None = None
        described: Described | None = None
        try:
            described = await asyncio.to_thread(self._describe, paths, tensors)
        except Exception as e:
            error = e
        failed = _Failed(f"{type(error).__name__}: {error}") if error is not None else None
        plan = await self._exchange(key, described, failed, error)
        await asyncio.to_thread(self._keep, key, plan)
        self.last = plan
        return plan

    def _look_up(self, args: tuple) -> tuple[Hashable, Plan | None]:
        """(the key, its cached plan or None); on a hit the key is dropped here, not on the loop (1M paths)."""
        key = structure_key(*args)
        plan = self._cache.get(key)
        if plan is not None:
            self._cache.move_to_end(key)
            return (), plan
        return key, plan

    def _keep(self, key: Hashable, plan: Plan) -> None:
        self._cache[key] = plan
        if len(self._cache) > self.cache_size:
            self._cache.popitem(last=False)

    async def _exchange(self, key: Hashable, described: Described | None, failed: _Failed | None,
                        error: BaseException | None) -> Plan:
        """The miss's collectives: rank 0's digests to all (rank 0 sends its structure and boxes whole, the others
        only where theirs differ), every rank's descriptors to rank 0, each
        rank's share back. Every rank raises if any rank failed before planning (RankFailed naming it) or
        rank 0 could not plan (its error: StateError on every rank, else RankFailed naming rank 0)."""
        coordinator = self.coordinator
        if coordinator.distributed:
            mine = described.digest if described is not None and self.rank == 0 else None
            first = await coordinator.broadcast_object(mine)
        else:
            first = None
        payload: Any = failed if described is None else described.payload_for(first if self.rank else None)
        # rank 0 keeps its own payload (its structure and boxes, whole): gloo's gather pads every rank's bytes to
        # the largest, so sending it would make every rank send as much
        gathered = await coordinator.gather_object(payload if self.rank else None, dst=0)
        if gathered is not None:
            gathered[0] = payload
        world: WorldPlan | None = None
        world_error: Exception | None = None
        shares = None
        if self.rank == 0:
            shares, world, world_error = await asyncio.to_thread(_plan_world, gathered)
        reply = await coordinator.scatter_object(shares, src=0)
        kind = reply[0]
        if kind == "failed":
            failure = RankFailed(f"rank {reply[1]} failed before the save was planned: {reply[2]}")
            if reply[1] == self.rank:
                failure.__cause__ = error
            raise failure
        if kind == "error":
            if world_error is not None:
                raise world_error  # rank 0's own, with its traceback
            if reply[1] == "StateError":
                raise StateError(reply[2])
            raise RankFailed(f"rank 0 failed while planning the save: {reply[1]}: {reply[2]}")
        assert described is not None
        _, nbytes, total, largest, share = reply
        local = await asyncio.to_thread(described.local, share)
        if world is not None:
            return Plan(key, self.rank, coordinator.world_size, self.part_size, local, nbytes, total, largest,
                        world.tensors, tuple(world.rank_nbytes))
        return Plan(key, self.rank, coordinator.world_size, self.part_size, local, nbytes, total, largest)

    def _describe(self, paths: list[str], tensors: list[torch.Tensor]) -> Described:
        descriptors = []
        for path, t in zip(paths, tensors):
            global_shape, offsets, sizes = local_box(t)
            descriptors.append((path, str(t.dtype), t.element_size(), global_shape, offsets, sizes, _alone(t)))
        fingerprints = _fingerprints(paths, tensors, self.rank) if self.coordinator.distributed else {}
        packed = pickle.dumps(fingerprints, protocol=pickle.HIGHEST_PROTOCOL) if fingerprints else b""
        return describe(descriptors, self.rank, packed)

    async def join_failed(self, error: BaseException) -> None:
        """This rank could not even describe its state (state_dict() raised, a value was refused). On a first
        save every rank plans, so join that plan's collectives with the error: every rank raises RankFailed
        naming this rank. With plans cached, the other ranks most likely hit theirs and run no collective,
        so return and let the caller record the failure where their commit wait sees it."""
        if self._cache or not self.coordinator.distributed:
            return
        await self._exchange((), None, _Failed(f"{type(error).__name__}: {error}"), error)


def _plan_world(gathered: list[Any] | None) -> tuple[list[tuple], WorldPlan | None, Exception | None]:
    """Rank 0: each rank's reply to the gather, the world's plan, and the error that stopped it. Any rank's
    failure goes to every rank instead of a plan."""
    assert gathered is not None
    world_size = len(gathered)
    for r, payload in enumerate(gathered):
        if isinstance(payload, _Failed):
            return [("failed", r, payload.reason)] * world_size, None, None
    try:  # every rank must leave the scatter with an answer, whatever goes wrong here
        _warn_if_replicas_differ([p[4] for p in gathered])
        world = plan_world(gathered)
        total, largest = sum(world.rank_nbytes), max(world.rank_nbytes, default=0)
        return [("plan", n, total, largest, share) for n, share in zip(world.rank_nbytes, world.shares)], world, None
    except Exception as e:
        return [("error", type(e).__name__, str(e))] * world_size, None, e


def _alone(t: torch.Tensor) -> bool:
    """No other rank can hold this rank's box of `t`: a DTensor every mesh dimension of which is sharded or has a
    single rank (an empty box excepted: the coordinator sees those). A plain tensor may be replicated by name."""
    if not is_dtensor(t):
        return False
    shape = t.device_mesh.shape
    return all(p.is_shard() or shape[i] == 1 for i, p in enumerate(t.placements))


FINGERPRINTED = 64 << 10  # plain CPU tensors up to this size are compared across ranks at the plan gather
MAX_FINGERPRINTS = 4096


def _fingerprints(paths: list[str], tensors: list[torch.Tensor], rank: int = 0) -> dict[str, int]:
    """crc32c of small plain CPU tensors (RNG states, counters): cheap, and enough to tell when a tensor that
    is taken to be replicated (same name on several ranks) differs between them. A rank's own (PerRank)
    tensors are its alone, so not compared."""
    out: dict[str, int] = {}
    suffix = own_suffix(rank)
    for path, t in zip(paths, tensors):
        if len(out) >= MAX_FINGERPRINTS:
            break
        if (not is_dtensor(t) and t.device.type == "cpu" and t.numel() * t.element_size() <= FINGERPRINTED
                and not path.endswith(suffix)):
            out[path] = checksum([tensor_bytes(t.detach().contiguous())])
    return out


def _warn_if_replicas_differ(packed: Sequence[bytes]) -> None:
    """On rank 0: each distinct set of fingerprints (every rank's, under DDP, is one) read once."""
    seen: dict[str, int] = {}
    differ: set[str] = set()
    for data in set(packed):
        for p, crc in (pickle.loads(data) if data else {}).items():
            if seen.setdefault(p, crc) != crc:
                differ.add(p)
    if differ:
        log.warning("tensor(s) %s have the same name on several ranks but different values: a plain tensor with "
                    "one name is taken to be replicated and saved once, from one rank. If each rank's own value "
                    "matters (an RNG state, a data-loader position), wrap it in tc.PerRank(...)",
                    sorted(differ)[:10])


@dataclass(frozen=True)
class _Failed:
    """A rank's place in the plan gather when it failed before planning."""

    reason: str


def build_plan(key: Hashable, everyone: Sequence[Sequence[tuple]], rank: int, part_size: int) -> Plan:
    """The plan of `rank` from every rank's descriptors (Box tuples, in each rank's tensors' order) in one process,
    as rank 0 makes the world's and `rank` reads its share of it; with the world's chunks and stream lengths
    (tests, benches)."""
    described = [describe(boxes, r) for r, boxes in enumerate(everyone)]
    first = described[0].digest if described else None
    world = plan_world([d.payload_for(first if r else None) for r, d in enumerate(described)])
    local = described[rank].local(world.shares[rank])
    return Plan(key, rank, len(everyone), part_size, local, world.rank_nbytes[rank], sum(world.rank_nbytes),
                max(world.rank_nbytes, default=0), world.tensors, tuple(world.rank_nbytes))
