"""Structure → layout. A Plan says which boxes of which tensors this rank writes, where their bytes go
in its packed stream, and how the stream is cut into parts; it also records every rank's chunks, so the
manifest can be written without another collective.

Plans hold layout only, never data, so a cached plan cannot make a later checkpoint repeat an earlier
one's values (NeMo-RL#3312). They are cached by a key of names, dtypes, shapes, placements and the world
layout; any change misses the cache. A miss runs one all_gather of chunk descriptors; a hit runs none.
The cache decision is local: like the training step itself, saves are SPMD, so every rank changes its
state structure at the same save (a rank that does not would stall in the gather until its timeout).

Replicated data (plain tensors present on several ranks, DTensor Replicate placements) is written once:
a chunk up to 1/16 of a rank's fair share goes whole, largest first, to the least-loaded rank that holds it;
the larger ones held by the same ranks are laid end to end and cut along dim 0 so that those ranks end level,
so max/mean bytes per rank stays near 1 with at most one piece a holder more than there are chunks (cutting
every chunk into a piece per holder made tensors x ranks pieces, and the plan grew as ranks squared).
"""
from __future__ import annotations

import asyncio
import heapq
import logging
import math
import pickle
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch

from ..distributed.coordinator import Coordinator
from ..checksum import checksum
from ..distributed.dtensor import is_dtensor, layout_key, local_box
from ..errors import RankFailed, StateError
from ..layout import part_count, part_range
from ..manifest.table import ColumnRows, TensorTable
from ..buffers import tensor_bytes

log = logging.getLogger(__name__)
ALIGN = 64  # every chunk starts 64-byte aligned, so byte views can be re-viewed as any dtype


class Box(NamedTuple):
    """What a rank tells the others of one of its tensors in the plan's gather (DCP's WriteItem is the model):
    its path, dtype, element size, global shape, and the box of it the rank holds (offsets and sizes)."""

    path: str
    dtype: str
    itemsize: int
    global_shape: tuple[int, ...]
    offsets: tuple[int, ...]
    sizes: tuple[int, ...]


class Piece(NamedTuple):
    """A box that the plan gives one rank to write: of tensor `path`, at `offsets` with `sizes`, from the
    rank's local tensor `index`, rows `dim0` (start, length) of it when a replicated box is split (else None),
    `nbytes` long. build_plan makes them as plain tuples in this order (under FSDP it makes R x tensors of them,
    and a NamedTuple's constructor costs more than the tuple)."""

    path: str
    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    index: int
    dim0: tuple[int, int] | None
    nbytes: int


@dataclass(frozen=True)
class LocalCopy:
    """One box this rank stages: rows `dim0` (start, length) of its local tensor `index` (all rows if None)."""

    index: int
    dim0: tuple[int, int] | None
    offset: int
    nbytes: int
    shape: tuple[int, ...]
    dtype: torch.dtype


class LocalCopies(ColumnRows[LocalCopy]):
    """This rank's boxes as columns (lists of ints, tuples and dtypes): a plan is cached for as long as the state
    keeps its structure, so a LocalCopy object per tensor would be 100k more objects for every full collection
    of Python's garbage collector to walk (manifest/table.py says why that matters). A LocalCopy is made when one
    is asked for; staging reads the columns."""

    def __init__(self) -> None:
        self.index: list[int] = []
        self.dim0: list[tuple[int, int] | None] = []
        self.offset: list[int] = []
        self.nbytes: list[int] = []
        self.shape: list[tuple[int, ...]] = []
        self.dtype: list[torch.dtype] = []
        self._in_order: bool | None = None

    def append(self, index: int, dim0: tuple[int, int] | None, offset: int, nbytes: int, shape: tuple[int, ...],
               dtype: torch.dtype) -> None:
        self.index.append(index)
        self.dim0.append(dim0)
        self.offset.append(offset)
        self.nbytes.append(nbytes)
        self.shape.append(shape)
        self.dtype.append(dtype)
        self._in_order = None

    @property
    def in_order(self) -> bool:
        """The boxes lie in the buffer in their order (so a copy in this order can report its progress)."""
        if self._in_order is None:
            self._in_order = all(a <= b for a, b in zip(self.offset, self.offset[1:]))
        return self._in_order

    def __len__(self) -> int:
        return len(self.index)

    def _row(self, i: int) -> LocalCopy:
        return LocalCopy(self.index[i], self.dim0[i], self.offset[i], self.nbytes[i], self.shape[i], self.dtype[i])

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, LocalCopies):
            return NotImplemented
        return all(getattr(self, f) == getattr(other, f) for f in ("index", "dim0", "offset", "nbytes", "shape",
                                                                  "dtype"))

    __hash__ = None  # type: ignore[assignment]


@dataclass(frozen=True)
class Plan:
    key: tuple
    rank: int
    world_size: int
    part_size: int
    tensors: TensorTable
    local: LocalCopies
    rank_nbytes: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return self.rank_nbytes[self.rank]

    @property
    def num_parts(self) -> int:
        return part_count(self.nbytes, self.part_size)

    def part_range(self, index: int) -> tuple[int, int]:
        return part_range(self.nbytes, self.part_size, index)


def structure_key(paths: list[str], tensors: list[torch.Tensor], world_size: int, part_size: int) -> tuple:
    """Names, dtypes, shapes, placements and layout as one hashable tuple (cheap to build and hash)."""
    layout = tuple([x for t in tensors for x in layout_key(t)])  # flat: no object kept per tensor
    return (world_size, part_size, tuple(paths), tuple([t.dtype for t in tensors]), layout)


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
        self._cache: OrderedDict[tuple, Plan] = OrderedDict()
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
        try:
            descriptors, fingerprints = await asyncio.to_thread(self._describe, paths, tensors)
        except Exception as e:
            error, descriptors, fingerprints = e, _Failed(f"{type(e).__name__}: {e}"), {}
        gathered = await self.coordinator.all_gather_object((descriptors, fingerprints))
        everyone = [d for d, _ in gathered]
        _raise_first_failure(everyone, self.rank, error)
        if self.rank == 0:
            _warn_if_replicas_differ([f for _, f in gathered])
        plan = await asyncio.to_thread(build_plan, key, everyone, self.rank, self.part_size)
        await asyncio.to_thread(self._keep, key, plan)
        self.last = plan
        return plan

    def _look_up(self, args: tuple) -> tuple[tuple, Plan | None]:
        """(the key, its cached plan or None); on a hit the key is dropped here, not on the loop (1M paths)."""
        key = structure_key(*args)
        plan = self._cache.get(key)
        if plan is not None:
            self._cache.move_to_end(key)
            return (), plan
        return key, plan

    def _keep(self, key: tuple, plan: Plan) -> None:
        self._cache[key] = plan
        if len(self._cache) > self.cache_size:
            self._cache.popitem(last=False)


    def _describe(self, paths: list[str], tensors: list[torch.Tensor]) -> tuple[Any, dict[str, Any]]:
        descriptors = []
        for path, t in zip(paths, tensors):
            global_shape, offsets, sizes = local_box(t)
            descriptors.append((path, str(t.dtype), t.element_size(), global_shape, offsets, sizes))
        # gathered packed: ranks with equal states (DDP) send equal bytes, which build_plan compares and unpacks
        # once, where every rank would otherwise unpickle and compare R lists of boxes
        fingerprints = _fingerprints(paths, tensors) if self.coordinator.distributed else {}
        return pickle.dumps(descriptors, protocol=pickle.HIGHEST_PROTOCOL), fingerprints

    async def join_failed(self, error: BaseException) -> None:
        """This rank could not even describe its state (state_dict() raised, a value was refused). On a first
        save every rank gathers a plan, so join that gather with the error: every rank raises RankFailed
        naming this rank. With plans cached, the other ranks most likely hit theirs and run no collective,
        so return and let the caller record the failure where their commit wait sees it."""
        if self._cache or not self.coordinator.distributed:
            return
        gathered = await self.coordinator.all_gather_object((_Failed(f"{type(error).__name__}: {error}"), {}))
        _raise_first_failure([d for d, _ in gathered], self.rank, error)


FINGERPRINTED = 64 << 10  # plain CPU tensors up to this size are compared across ranks at the plan gather
MAX_FINGERPRINTS = 4096


def _fingerprints(paths: list[str], tensors: list[torch.Tensor]) -> dict[str, int]:
    """crc32c of small plain CPU tensors (RNG states, counters): cheap, and enough to tell when a tensor that
    is taken to be replicated (same name on several ranks) differs between them."""
    out: dict[str, int] = {}
    for path, t in zip(paths, tensors):
        if len(out) >= MAX_FINGERPRINTS:
            break
        if not is_dtensor(t) and t.device.type == "cpu" and t.numel() * t.element_size() <= FINGERPRINTED:
            out[path] = checksum([tensor_bytes(t.detach().contiguous())])
    return out


def _warn_if_replicas_differ(fingerprints: list[dict[str, int]]) -> None:
    differ = sorted({p for f in fingerprints for p, crc in f.items()
                     if any(other.get(p, crc) != crc for other in fingerprints)})
    if differ:
        log.warning("tensor(s) %s have the same name on several ranks but different values: a plain tensor with "
                    "one name is taken to be replicated and saved once, from one rank. If each rank's own value "
                    "matters (an RNG state, a data-loader position), wrap it in tc.PerRank(...)",
                    differ[:10])


@dataclass(frozen=True)
class _Failed:
    """A rank's place in the plan gather when it failed before planning."""

    reason: str


def _raise_first_failure(everyone: list[Any], rank: int, error: BaseException | None) -> None:
    for r, descriptors in enumerate(everyone):
        if isinstance(descriptors, _Failed):
            failed = RankFailed(f"rank {r} failed before the save was planned: {descriptors.reason}")
            if r == rank:
                failed.__cause__ = error
            raise failed


def build_plan(key: tuple, everyone: list[list[Box] | bytes], rank: int, part_size: int) -> Plan:
    """Deterministic: every rank computes the same plan from the same gathered boxes (each rank's, in its
    tensors' order; a list, or pickled as Planner gathers them). Linear in the boxes of distinct ranks (ranks
    whose boxes are equal are read as one), O(pieces log R) beyond: no step scans every holder of every piece."""
    world = len(everyone)
    groups, group_of = _equal_ranks(everyone)
    meta: dict[str, tuple[str, int, tuple[int, ...]]] = {}
    first: dict[tuple[str, tuple[int, ...], tuple[int, ...]], tuple[int, int]] = {}  # box -> (group, index)
    shared: dict[tuple[str, tuple[int, ...], tuple[int, ...]], dict[int, int]] = {}  # held by several groups
    for g, (boxes, ranks) in enumerate(groups):
        for index, (path, dtype, itemsize, global_shape, offsets, sizes) in enumerate(boxes):
            # (the loop runs once per box of every distinct rank: R x tensors under FSDP, so it is kept lean)
            known = meta.setdefault(path, (dtype, itemsize, global_shape))
            if known[2] != global_shape or known[0] != dtype or known[1] != itemsize:
                raise StateError(f"tensor {path!r} is {known[0]} {list(known[2])} on one rank but "
                                 f"{dtype} {list(global_shape)} on rank {ranks[0]}")
            box = (path, offsets, sizes)
            owner = first.setdefault(box, (g, index))
            if owner[0] != g:
                shared.setdefault(box, {owner[0]: owner[1]})[g] = index

    def nbytes(path: str, sizes: tuple[int, ...]) -> int:
        return meta[path][1] * math.prod(sizes)

    total = sum([nbytes(p, s) for p, _, s in first])
    # Replicated chunks above 1/16 of a rank's fair share are cut along dim 0 so that their holders end level
    # (_fill); smaller ones go whole, largest first, to their least-loaded holder.
    threshold = total / world / 16
    load = [0] * world
    pieces: list[list[Piece]] = [[] for _ in range(world)]
    small: list[tuple[int, tuple, dict[int, int]]] = []
    large: dict[tuple[int, ...], list[tuple[tuple, dict[int, int]]]] = {}
    for box, (g, index) in first.items():
        who = shared.get(box)
        path, offsets, sizes = box
        size = nbytes(path, sizes)
        if who is None and len(groups[g][1]) == 1:
            r = groups[g][1][0]
            pieces[r].append((path, offsets, sizes, index, None, size))
            load[r] += size
            continue
        who = who or {g: index}
        if size > threshold and sizes and sizes[0] > 1:
            large.setdefault(tuple(sorted(who)), []).append((box, who))
        else:
            small.append((size, box, who))

    holder_ranks: dict[tuple[int, ...], list[int]] = {}

    def ranks_of(gs: tuple[int, ...]) -> list[int]:
        ranks = holder_ranks.get(gs)
        if ranks is None:
            ranks = holder_ranks[gs] = sorted(r for g in gs for r in groups[g][1])
        return ranks

    heaps: dict[tuple[int, ...], list[tuple[int, int]]] = {}
    for size, (path, offsets, sizes), who in sorted(small, key=lambda s: (-s[0], s[1])):
        gs = tuple(sorted(who))
        heap = heaps.get(gs)
        if heap is None:
            heap = heaps[gs] = [(load[r], r) for r in ranks_of(gs)]
            heapq.heapify(heap)
        while heap[0][0] != load[heap[0][1]]:  # loads only grow: a stale entry is refreshed when it comes up
            heapq.heapreplace(heap, (load[heap[0][1]], heap[0][1]))
        r = heap[0][1]
        pieces[r].append((path, offsets, sizes, who[group_of[r]], None, size))
        load[r] += size
        heapq.heapreplace(heap, (load[r], r))

    for gs in sorted(large, key=lambda gs: (len(ranks_of(gs)), gs)):
        _fill(sorted(large[gs]), ranks_of(gs), group_of, load, pieces, nbytes)

    chunks: dict[str, list[tuple]] = {path: [] for path in meta}
    local = LocalCopies()
    rank_nbytes = []
    for r in range(world):
        offset = 0
        mine = pieces[r]
        if len(mine) > 1:
            mine.sort()
        for path, offsets, sizes, index, dim0, size in mine:
            offset = -(-offset // ALIGN) * ALIGN
            chunks[path].append((offsets, sizes, r, offset, size))
            if r == rank:
                local.append(index, dim0, offset, size, sizes, _dtype(meta[path][0]))
            offset += size
        rank_nbytes.append(offset)
    tensors = TensorTable.from_rows((path, dtype, shape, chunks[path]) for path, (dtype, _, shape) in meta.items())
    return Plan(key, rank, world, part_size, tensors, local, tuple(rank_nbytes))


def _equal_ranks(everyone: list[list[Box] | bytes]) -> tuple[list[tuple[list[Box], list[int]]], list[int]]:
    """Ranks whose gathered boxes are equal, as groups of (boxes, ranks), and each rank's group. Under DDP every
    rank is in one group, so the plan unpacks and reads one rank's boxes, not R copies of them. A rank is
    compared (in C, stopping at the first difference) with the latest group that has its length and its first,
    middle and last box (or 64 bytes). The groups depend on the gathered content alone, so every rank makes the
    same ones; equal ranks left in two groups (another rank with the same sample came between) still plan
    correctly, only with more work."""
    groups: list[tuple[Any, list[int]]] = []
    group_of = []
    latest: dict[tuple, int] = {}
    for r, boxes in enumerate(everyone):
        n = len(boxes)
        if isinstance(boxes, bytes):
            sample: tuple = (n, boxes[:64], boxes[n // 2:n // 2 + 64], boxes[-64:])
        else:
            sample = (n, tuple(boxes[0]), tuple(boxes[n // 2]), tuple(boxes[-1])) if n else (0,)
        g = latest.get(sample)
        if g is None or not (groups[g][0] is boxes or groups[g][0] == boxes):
            g = latest[sample] = len(groups)
            groups.append((boxes, []))
        groups[g][1].append(r)
        group_of.append(g)
    return [(pickle.loads(b) if isinstance(b, bytes) else b, ranks) for b, ranks in groups], group_of


def _fill(items: list[tuple[tuple, dict[int, int]]], ranks: list[int], group_of: list[int], load: list[int],
          pieces: list[list[Piece]], nbytes: Any) -> None:
    """Cuts replicated boxes held by the same `ranks` along dim 0 so that those ranks end as level as rows allow:
    the boxes, end to end, are one stream, and each holder below the water level takes the next stretch of it up
    to the level. At most len(items) + len(ranks) - 1 pieces, each holder's one stretch, so the pieces of one box
    go to distinct holders."""
    sizes_ = [nbytes(path, sizes) for (path, _, sizes), _ in items]
    stream = sum(sizes_)
    below = sorted(load[r] for r in ranks)
    level, filled = float(below[-1]), 0
    for i, low in enumerate(below):
        filled += low
        if i + 1 == len(below) or (stream + filled) / (i + 1) <= below[i + 1]:
            level = (stream + filled) / (i + 1)
            break
    bounds, end = [], 0.0
    for r in ranks:
        if level > load[r]:
            end += level - load[r]
            bounds.append((r, end))
    bounds[-1] = (bounds[-1][0], float(stream))
    b, start = 0, 0
    for ((path, offsets, sizes), who), size in zip(items, sizes_):
        rows, row = sizes[0], 0
        row_bytes = size // rows
        while row < rows:
            r, end = bounds[b]
            cut = rows if end >= start + size else max(row, min(rows, round((end - start) / row_bytes)))
            if cut > row:
                if row == 0 and cut == rows:
                    piece = (path, offsets, sizes, who[group_of[r]], None, size)
                else:
                    piece = (path, (offsets[0] + row,) + offsets[1:], (cut - row,) + sizes[1:], who[group_of[r]],
                             (row, cut - row), (cut - row) * row_bytes)
                pieces[r].append(piece)
                load[r] += (cut - row) * row_bytes
                row = cut
            if cut < rows:
                b += 1
        start += size


def _dtype(name: str) -> torch.dtype:
    return getattr(torch, name.removeprefix("torch."))
