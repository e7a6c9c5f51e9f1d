"""The coordinator's side of a plan miss: the world's plan, made once, on rank 0, from every rank's descriptors
(describe.py), and each rank's share of it.

Boxes that a rank holds alone (FSDP's R x tensors shards) are placed with array work: they stay with their rank,
laid out in its tensors' order. The others (replicated: a plain tensor held under one name by several ranks, a
DTensor with a Replicate placement) are compared in Python, each distinct set of ranks' boxes once (every rank's,
under DDP, are one set), and written once: a chunk up to 1/16 of a rank's fair share goes whole, largest first,
to the least-loaded rank that holds it; the larger ones held by the same ranks are laid end to end and cut along
dim 0 so that those ranks end level (`_fill`), so max/mean bytes per rank stays near 1 with at most one piece a
holder more than there are chunks. An empty box (a shard past the end of its tensor) is not a chunk, unless its
tensor has no elements at all (then the tensor's one chunk, so that every tensor is listed with one).
"""
from __future__ import annotations

import heapq
import math
import pickle
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np

from ..manifest.pieces import distinct, int_array, loads as unpickle_in_pieces, rows, string_order, to_list
from ..errors import StateError
from ..release import release_all
from ..manifest.table import TensorTable, stored_width
from .describe import unpack_ints

ALIGN = 64  # every chunk starts 64-byte aligned, so byte views can be re-viewed as any dtype


@dataclass
class WorldPlan:
    """The world's chunks (the manifest's table), every rank's stream length, and each rank's share: rows of
    (descriptor, cut start or -1, cut length, byte offset), as bytes (describe.Described.local reads them)."""

    tensors: TensorTable
    rank_nbytes: list[int]
    shares: list[bytes]


class _World:
    """The world's tensors by path: dtype, element size, global shape, each checked against every rank's."""

    def __init__(self) -> None:
        self.tid: dict[str, int] = {}
        self.paths: list[str] = []
        self.dtypes: list[str] = []
        self.itemsizes: list[int] = []
        self.shapes: list[tuple[int, ...]] = []

    def add(self, path: str, dtype: str, itemsize: int, shape: tuple[int, ...], rank: int) -> int:
        t = self.tid.setdefault(path, len(self.paths))
        if t == len(self.paths):
            self.paths.append(path)
            self.dtypes.append(dtype)
            self.itemsizes.append(itemsize)
            self.shapes.append(shape)
        elif self.shapes[t] != shape or self.dtypes[t] != dtype or self.itemsizes[t] != itemsize:
            raise StateError(f"tensor {path!r} is {self.dtypes[t]} {list(self.shapes[t])} on one rank but "
                             f"{dtype} {list(shape)} on rank {rank}")
        return t


def plan_world(payloads: Sequence[tuple[Any, ...]]) -> WorldPlan:
    """Deterministic in the payloads. Linear in the boxes of distinct ranks (ranks that sent equal boxes are
    read as one), with array work for boxes held alone and Python only for the others."""
    world_size = len(payloads)
    world = _World()
    structures = {p[0]: p[1] for p in payloads if p[1] is not None}
    group_at: dict[tuple[bytes, bytes], int] = {}
    groups: list[list[int]] = []
    keys: list[tuple[bytes, bytes]] = []
    group_of: list[int] = []
    for r, p in enumerate(payloads):
        key = (p[0], p[2] if p[2] is not None else payloads[0][2])  # (none sent: rank 0's)
        g = group_at.setdefault(key, len(groups))
        if g == len(groups):
            groups.append([])
            keys.append(key)
        groups[g].append(r)
        group_of.append(g)

    tids: dict[bytes, np.ndarray] = {}  # structure digest -> its descriptors' tensor ids
    parts: list[tuple[np.ndarray, ...]] = []  # per group: tensor ids, offsets, sizes, alone
    for g, (digest, boxes) in enumerate(keys):
        rank = groups[g][0]
        if digest not in tids:
            if digest not in structures:
                raise StateError(f"rank {rank} sent a structure digest that no rank described")
            # each column pickled in pieces (describe.py)
            columns = [unpickle_in_pieces(c) for c in pickle.loads(structures[digest])]
            paths, dtypes, itemsizes, ndims, flat = columns
            at, ids = 0, []
            for path, dtype, itemsize, n in zip(paths, dtypes, itemsizes, ndims):
                ids.append(world.add(path, dtype, itemsize, tuple(flat[at:at + n]), rank))
                at += n
            tids[digest] = int_array(ids)
            del paths, dtypes, itemsizes, ndims, flat
            release_all([*columns, ids])  # (see the end)
        ids = tids[digest]
        values = unpack_ints(boxes)
        count = len(ids)
        ndim = int(values[0]) if len(values) else 1
        if len(values) != 1 + count * (2 * ndim + 1):
            raise StateError(f"rank {rank} sent {len(values)} box values for {count} tensors")
        cut = 1 + count * ndim
        parts.append((ids, values[1:cut].reshape(count, ndim), values[cut:cut + count * ndim].reshape(count, ndim),
                      values[cut + count * ndim:]))

    own: list[tuple[int, int, int, tuple[int, ...], tuple[int, ...]]] = []  # rank, descriptor, tid, box
    for r, p in enumerate(payloads):
        if p[3]:
            first = len(tids[p[0]])
            for j, (path, dtype, itemsize, shape, offsets, sizes) in enumerate(pickle.loads(p[3])):
                own.append((r, first + j, world.add(path, dtype, itemsize, tuple(shape), r), tuple(offsets),
                            tuple(sizes)))

    count = len(world.paths)
    width = max([a[1].shape[1] for a in parts] + [len(o[3]) for o in own] + [1])
    # (every list made an array a piece at a time: one C call over every tensor holds the GIL, manifest/pieces.py)
    itemsize = int_array(world.itemsizes)
    ndims = int_array([len(s) for s in world.shapes])
    numel = int_array([math.prod(s) for s in world.shapes])

    def padded(a: np.ndarray, fill: int) -> np.ndarray:
        return a if a.shape[1] == width else np.pad(a, ((0, 0), (0, width - a.shape[1])), constant_values=fill)

    sizes_of = [len(a[0]) for a in parts]
    tid = np.concatenate([a[0] for a in parts] + [np.zeros(0, np.int64)])
    desc = np.concatenate([np.arange(n, dtype=np.int64) for n in sizes_of] + [np.zeros(0, np.int64)])
    grp = np.repeat(np.arange(len(parts), dtype=np.int64), sizes_of)
    offsets = np.concatenate([padded(a[1], 0) for a in parts] + [np.zeros((0, width), np.int64)])
    sizes = np.concatenate([padded(a[2], 1) for a in parts] + [np.zeros((0, width), np.int64)])
    alone = np.concatenate([a[3] for a in parts] + [np.zeros(0, np.int64)]).astype(bool)
    elems = sizes[:, 0].copy()  # (a product along a short axis costs ~5x one over its columns)
    for column in range(1, width):
        elems *= sizes[:, column]
    nbytes = itemsize[tid] * elems
    single = np.asarray([len(rs) == 1 for rs in groups], dtype=bool)[grp]
    keep = (nbytes > 0) | (numel[tid] == 0)
    sole = alone & single & (nbytes > 0)

    multi = ~single
    while True:  # (twice at most: a tensor whose "alone" boxes overlap is compared as the others are)
        candidate = keep & ~sole
        held = candidate & multi & _unique_rows(candidate, tid, offsets, sizes)  # only its group's ranks hold it
        placer = _Replicated(world, groups, group_of)
        _add(placer, candidate & ~held, grp, desc, tid, offsets, sizes, ndims)
        covered = placer.elements(count)
        for mask in (sole, held):
            covered += np.bincount(tid[mask], weights=elems[mask], minlength=count)
        over = np.flatnonzero(covered > numel)
        claimed = sole & np.isin(tid, over)
        if not claimed.any():  # no "alone" claim to take back: boxes that overlap without being equal (rank 0
            break  # holds rows 0-2, rank 1 rows 1-3) are each written, as they were before the coordinator planned
        sole &= ~claimed

    rank_of_group = np.asarray([rs[0] for rs in groups], dtype=np.int64)
    own_rows = [o for o in own if math.prod(o[4]) > 0 or numel[o[2]] == 0]
    own_tid = int_array([o[2] for o in own_rows])
    own_bytes = itemsize[own_tid] * int_array([math.prod(o[4]) for o in own_rows])
    fixed_rank = _joined([(grp, sole), int_array([o[0] for o in own_rows])])
    fixed_rank[:-len(own_rows) or None] = rank_of_group[fixed_rank[:-len(own_rows) or None]]
    fixed_bytes = _joined([(nbytes, sole), own_bytes])
    load = np.bincount(fixed_rank, weights=fixed_bytes, minlength=world_size).round().astype(np.int64)
    total = int(fixed_bytes.sum()) + int(nbytes[held].sum()) + sum([placer.nbytes(b) for b in placer.first])
    threshold = total / world_size / 16
    large = held & (nbytes > threshold) & (sizes[:, 0] > 1) & (ndims[tid] > 0)
    _add(placer, large, grp, desc, tid, offsets, sizes, ndims)  # cut as the others are
    held &= ~large
    held_rank = _spread(held, grp, nbytes, tid, groups, load, world.paths)
    pieces = placer.place(load.tolist(), int(fixed_bytes.sum()) + int(nbytes[held].sum()), world_size)

    # every piece: rank, descriptor, tensor, offsets, sizes, cut start (-1: whole), cut length, bytes (in any
    # order: the streams are sorted below)
    py_off = int_array([x for p in pieces for x in p[3] + (0,) * (width - len(p[3]))]).reshape(-1, width)
    py_size = int_array([x for p in pieces for x in p[4] + (1,) * (width - len(p[4]))]).reshape(-1, width)
    own_off = int_array([x for o in own_rows for x in o[3] + (0,) * (width - len(o[3]))]).reshape(-1, width)
    own_size = int_array([x for o in own_rows for x in o[4] + (1,) * (width - len(o[4]))]).reshape(-1, width)
    whole = int(sole.sum()) + len(own_rows) + int(held.sum())
    rank = np.concatenate([fixed_rank, held_rank, int_array([p[0] for p in pieces])])
    descriptor = _joined([(desc, sole), int_array([o[1] for o in own_rows]), (desc, held),
                          int_array([p[1] for p in pieces])])
    chunk_tid = _joined([(tid, sole), own_tid, (tid, held), int_array([p[2] for p in pieces])])
    chunk_off = _joined([(offsets, sole), own_off, (offsets, held), py_off])
    chunk_size = _joined([(sizes, sole), own_size, (sizes, held), py_size])
    start = np.concatenate([np.full(whole, -1, np.int64), int_array([p[5] for p in pieces])])
    length = np.concatenate([np.zeros(whole, np.int64), int_array([p[6] for p in pieces])])
    chunk_bytes = _joined([fixed_bytes, (nbytes, held), int_array([p[7] for p in pieces])])
    release_all([pieces])  # (a tuple per piece: 1M freed at once hold the GIL, as below)

    # each rank's stream: its pieces in its tensors' order
    key = rank * (int(descriptor.max(initial=0)) + 1) + descriptor
    if len(key) and not bool(np.all(key[1:] >= key[:-1])):  # (already so under FSDP: each rank's own boxes)
        order = np.argsort(key, kind="stable")
        rank, descriptor, chunk_tid, chunk_off, chunk_size = (rank[order], descriptor[order], chunk_tid[order],
                                                             chunk_off[order], chunk_size[order])
        start, length, chunk_bytes = start[order], length[order], chunk_bytes[order]
    # (in place where a step would make one more array of every chunk: fresh memory is most of the plan's CPU
    # at millions of chunks, docs/benchmarks.md)
    aligned = -(-chunk_bytes // ALIGN)
    aligned *= ALIGN
    before = np.cumsum(aligned)
    before -= aligned
    del aligned
    first = np.searchsorted(rank, np.arange(world_size + 1))
    writes = first[1:] > first[:-1]
    base = np.zeros(world_size, np.int64)
    base[writes] = before[first[:-1][writes]]
    byte_offset = before
    byte_offset -= base[rank]
    rank_nbytes = np.zeros(world_size, np.int64)
    last = first[1:][writes] - 1
    rank_nbytes[writes] = byte_offset[last] + chunk_bytes[last]
    shares = _shares((descriptor, start, length, byte_offset), first)

    by_tensor = np.argsort(chunk_tid.astype(np.uint16) if count <= 1 << 16 else chunk_tid, kind="stable")
    chunk_tid = chunk_tid[by_tensor]
    names = sorted(distinct(world.dtypes))
    dtype_index = {n: i for i, n in enumerate(names)}
    table = TensorTable(list(world.paths), names, int_array([dtype_index[d] for d in world.dtypes]),
                        ndims, int_array([x for s in world.shapes for x in s]),
                        np.bincount(chunk_tid, minlength=count).astype(np.int64), _taken(rank, by_tensor),
                        _taken(byte_offset, by_tensor), _taken(chunk_bytes, by_tensor),
                        *_boxes_in_order(by_tensor, chunk_tid, ndims, chunk_off, chunk_size))
    # what was made per tensor or box freed a batch at a time: dropped whole at the return (the world's five
    # lists and its dict of paths, the compared boxes), 1M entries each are freed in one step that holds the GIL
    # (175 ms at 1M tensors, in the planning thread, the loop waiting: release.py)
    release_all([world.tid, world.paths, world.dtypes, world.itemsizes, world.shapes, own, own_rows,
                 placer.first, placer.shared])
    return WorldPlan(table, to_list(rank_nbytes), shares)


def _shares(columns: Sequence[np.ndarray], first: np.ndarray) -> list[bytes]:
    """Each rank's rows of `columns` (its chunks run from first[r] to first[r+1]) as little-endian int64 rows, made
    a rank at a time: a table of every chunk's rows first was 224 MB of fresh memory at 7M chunks, only to be
    copied again into the ranks' bytes."""
    shares = []
    block = np.empty((0, len(columns)), "<i8")
    for a, b in zip(first[:-1].tolist(), first[1:].tolist()):
        if block.shape[0] < b - a:
            block = np.empty((b - a, len(columns)), "<i8")
        rows = block[:b - a]
        for c, values in enumerate(columns):
            rows[:, c] = values[a:b]
        shares.append(rows.tobytes())
    return shares


def _joined(parts: Sequence[np.ndarray | tuple[np.ndarray, np.ndarray]]) -> np.ndarray:
    """np.concatenate of int64 `parts`, a (values, mask) part taken where its mask is set, written into one array
    without a masked copy of each in between (fresh memory is most of the plan's CPU at millions of chunks)."""
    lengths = [int(np.count_nonzero(p[1])) if isinstance(p, tuple) else len(p) for p in parts]
    first = parts[0][0] if isinstance(parts[0], tuple) else parts[0]
    out = np.empty((sum(lengths), *first.shape[1:]), np.int64)
    at = 0
    for part, n in zip(parts, lengths):
        if isinstance(part, tuple):
            np.compress(part[1], part[0], axis=0, out=out[at:at + n])
        elif n:
            out[at:at + n] = part
        at += n
    return out


def _boxes_in_order(order: np.ndarray, tid: np.ndarray, ndims: np.ndarray, offsets: np.ndarray,
                    sizes: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The chunks' boxes (rows padded to the widest tensor) in `order`, flat, each with its tensor's dims only (`tid`:
    the chunks' tensors, in that order already); with no padding, the rows as they are."""
    width = offsets.shape[1]
    if bool((ndims == width).all()):
        return _taken(offsets, order).ravel(), _taken(sizes, order).ravel()
    valid = np.arange(width) < ndims[tid][:, None]
    return _taken(offsets, order)[valid], _taken(sizes, order)[valid]


def _taken(values: np.ndarray, order: np.ndarray) -> np.ndarray:
    """values[order] (rows, for a 2-d array) in the narrowest unsigned width that holds them, as the manifest
    stores its chunk columns (manifest/table.py): a quarter of the fresh memory of int64 columns of 7M chunks at
    10,240 FSDP2 ranks, and the manifest's encoding then casts nothing. Non-negative values only."""
    width = stored_width(values)
    out = np.empty((len(order), *values.shape[1:]), dtype=np.int64 if width == 8 else f"<u{width}")
    np.take(values, order, axis=0, out=out)
    return out


def _add(placer: _Replicated, mask: np.ndarray, grp: np.ndarray, desc: np.ndarray, tid: np.ndarray,
         offsets: np.ndarray, sizes: np.ndarray, ndims: np.ndarray) -> None:
    ndim_of = to_list(ndims)
    for g, d, t, o, z in zip(rows(grp[mask]), rows(desc[mask]), rows(tid[mask]), rows(offsets[mask]),
                             rows(sizes[mask])):
        n = ndim_of[t]
        placer.add(g, d, t, tuple(o[:n]), tuple(z[:n]))


def _unique_rows(mask: np.ndarray, tid: np.ndarray, offsets: np.ndarray, sizes: np.ndarray) -> np.ndarray:
    """Which boxes under `mask` no other box equals (as a mask of all boxes), by a 64-bit hash of each: equal
    boxes hash alike, so a box taken as unique is; a collision only sends a box the slower way."""
    out = np.zeros(len(mask), dtype=bool)
    at = np.flatnonzero(mask)
    if not len(at):
        return out
    h = np.full(len(at), 0x9E3779B97F4A7C15, dtype=np.uint64)
    with np.errstate(over="ignore"):
        for column in (tid[at], *offsets[at].T, *sizes[at].T):
            h ^= column.astype(np.uint64)
            h *= np.uint64(0xBF58476D1CE4E5B9)
            h ^= h >> np.uint64(31)
    _, inverse, counts = np.unique(h, return_inverse=True, return_counts=True)
    out[at[counts[inverse] == 1]] = True
    return out


def _spread(mask: np.ndarray, grp: np.ndarray, nbytes: np.ndarray, tid: np.ndarray, groups: list[list[int]],
            load: np.ndarray, paths: list[str]) -> np.ndarray:
    """The rank of each box under `mask` (boxes held by the ranks of one group, that group alone: an HSDP
    shard's replicas), `load` grown by them: within each group, largest first (ties by path), to its least-loaded
    rank (the lowest of equals), as a heap would, but one box of every group at a time in array steps."""
    at = np.flatnonzero(mask)
    if not len(at):
        return np.zeros(0, np.int64)
    path_order = np.empty(len(paths), np.int64)
    path_order[string_order(paths)] = np.arange(len(paths))  # (no C call over every path: pieces.py)
    g, size = grp[at], nbytes[at]
    order = np.lexsort((path_order[tid[at]], -size, g))
    g, size = g[order], size[order]
    used, first, per = np.unique(g, return_index=True, return_counts=True)
    width = max(len(groups[x]) for x in used.tolist())
    ranks = np.full((len(used), width), -1, np.int64)
    for i, x in enumerate(used.tolist()):
        ranks[i, :len(groups[x])] = sorted(groups[x])
    levels = np.where(ranks >= 0, load[np.maximum(ranks, 0)].astype(np.float64), np.inf)
    chosen = np.empty(len(g), np.int64)
    if len(used) > 1 and int(per.min()) == int(per.max()):  # every group as many boxes: alike ones placed once
        _spread_alike(levels, size.reshape(len(used), int(per[0])), ranks, chosen)
    else:
        for j in range(int(per.max())):
            rows = np.flatnonzero(per > j)  # the groups with a j-th box
            take = first[rows] + j
            pick = np.argmin(levels[rows], axis=1)
            levels[rows, pick] += size[take]
            chosen[take] = ranks[rows, pick]
    valid = ranks >= 0
    load[ranks[valid]] = levels[valid].round().astype(np.int64)
    out = np.empty(len(at), np.int64)
    out[order] = chosen
    return out


def _spread_alike(levels: np.ndarray, sizes: np.ndarray, ranks: np.ndarray, chosen: np.ndarray) -> None:
    """_spread's placement when every group has as many boxes (`sizes`: a row of them per group, in placing order;
    `levels`, `ranks`: a row per group): groups whose sizes and starting loads are alike (HSDP: every shard's
    replicas hold the same boxes) make the same picks, so each distinct row is placed once and its picks copied
    (5,120 groups of 1,000 boxes: 1,000 array steps over one row, not over 5,120)."""
    _, keep, alike = np.unique(np.concatenate([sizes.astype(np.float64), levels], axis=1), axis=0,
                               return_index=True, return_inverse=True)
    alike = alike.reshape(-1)
    mine = levels[keep]  # (a copy: the distinct rows' loads, grown below)
    picks = np.empty((len(keep), sizes.shape[1]), np.int64)
    for j in range(sizes.shape[1]):
        pick = np.argmin(mine, axis=1)
        mine[np.arange(len(keep)), pick] += sizes[keep, j]
        picks[:, j] = pick
    levels[:] = mine[alike]
    chosen[:] = np.take_along_axis(ranks, picks[alike], axis=1).reshape(-1)


Box = tuple[int, tuple[int, ...], tuple[int, ...]]  # tensor, offsets, sizes


class _Replicated:
    """The boxes not held alone, compared by value: each distinct box once, with the groups (of ranks that sent
    equal boxes) that hold it and its descriptor in each; then placed."""

    def __init__(self, world: _World, groups: list[list[int]], group_of: list[int]):
        self.world, self.groups, self.group_of = world, groups, group_of
        self.first: dict[Box, tuple[int, int]] = {}  # box -> (group, descriptor)
        self.shared: dict[Box, dict[int, int]] = {}  # held by several groups

    def add(self, g: int, descriptor: int, tid: int, offsets: tuple[int, ...], sizes: tuple[int, ...]) -> None:
        box = (tid, offsets, sizes)
        owner = self.first.setdefault(box, (g, descriptor))
        if owner[0] != g:
            self.shared.setdefault(box, {owner[0]: owner[1]})[g] = descriptor

    def elements(self, count: int) -> np.ndarray:
        out = np.zeros(count)
        for tid, _, sizes in self.first:
            out[tid] += math.prod(sizes)
        return out

    def nbytes(self, box: Box) -> int:
        return self.world.itemsizes[box[0]] * math.prod(box[2])

    def place(self, load: list[int], fixed: int, world_size: int) -> list[tuple]:
        """Pieces (rank, descriptor, tensor, offsets, sizes, cut start or -1, cut length, bytes), `load` (each
        rank's bytes so far, `fixed` of them in all) grown by them."""
        groups, group_of, paths = self.groups, self.group_of, self.world.paths
        pieces: list[tuple] = []
        total = fixed + sum([self.nbytes(b) for b in self.first])
        threshold = total / world_size / 16
        small: list[tuple[int, tuple, Box, dict[int, int]]] = []
        large: dict[tuple[int, ...], list[tuple[tuple, Box, dict[int, int]]]] = {}
        for box, (g, descriptor) in self.first.items():
            who = self.shared.get(box)
            tid, offsets, sizes = box
            size = self.nbytes(box)
            if who is None and len(groups[g]) == 1:
                r = groups[g][0]
                pieces.append((r, descriptor, tid, offsets, sizes, -1, 0, size))
                load[r] += size
                continue
            who = who or {g: descriptor}
            order = (paths[tid], offsets, sizes)  # ties broken by path, as every rank's plan did
            if size > threshold and sizes and sizes[0] > 1:
                large.setdefault(tuple(sorted(who)), []).append((order, box, who))
            else:
                small.append((size, order, box, who))

        holder_ranks: dict[tuple[int, ...], list[int]] = {}

        def ranks_of(gs: tuple[int, ...]) -> list[int]:
            ranks = holder_ranks.get(gs)
            if ranks is None:
                ranks = holder_ranks[gs] = sorted(r for g in gs for r in groups[g])
            return ranks

        heaps: dict[tuple[int, ...], list[tuple[int, int]]] = {}
        for size, _, (tid, offsets, sizes), who in (small[i] for i in _largest_first(small, paths)):
            gs = tuple(sorted(who))
            heap = heaps.get(gs)
            if heap is None:
                heap = heaps[gs] = [(load[r], r) for r in ranks_of(gs)]
                heapq.heapify(heap)
            while heap[0][0] != load[heap[0][1]]:  # loads only grow: a stale entry is refreshed when it comes up
                heapq.heapreplace(heap, (load[heap[0][1]], heap[0][1]))
            r = heap[0][1]
            pieces.append((r, who[group_of[r]], tid, offsets, sizes, -1, 0, size))
            load[r] += size
            heapq.heapreplace(heap, (load[r], r))

        for gs in sorted(large, key=lambda gs: (len(ranks_of(gs)), gs)):
            items = [(box, who) for _, box, who in sorted(large[gs], key=lambda x: x[0])]
            _fill(items, ranks_of(gs), group_of, load, pieces, self.nbytes)
        release_all([small])  # (dropped at the return, its 1M tuples of tuples held the GIL 106 ms at 1M)
        return pieces


def _largest_first(small: list[tuple[int, tuple, Box, dict[int, int]]], paths: list[str]) -> list[int]:
    """The order of sorted(small, key=lambda s: (-s[0], s[1])): largest first, ties by path, then offsets and
    sizes (one tensor's boxes have its dims), as indexes. With array sorts that give the GIL back: sorted() of
    1M boxes compares their tuples in one C call (~0.2 s at 200k, in the planning thread, the loop waiting)."""
    if len(small) < 2:
        return list(range(len(small)))
    width = max(len(s[2][1]) for s in small)
    place = np.empty(len(paths), np.int64)
    place[string_order(paths)] = np.arange(len(paths))  # each path's place among them (pieces.py)
    tid = int_array([s[2][0] for s in small])
    offsets = int_array([x for s in small for x in s[2][1] + (0,) * (width - len(s[2][1]))]).reshape(len(small), width)
    sizes = int_array([x for s in small for x in s[2][2] + (0,) * (width - len(s[2][2]))]).reshape(len(small), width)
    keys = [*sizes.T[::-1], *offsets.T[::-1], place[tid], -int_array([s[0] for s in small])]  # (last: first)
    return to_list(np.lexsort(keys))


def _fill(items: list[tuple[Box, dict[int, int]]], ranks: list[int], group_of: list[int], load: list[int],
          pieces: list[tuple], nbytes: Any) -> None:
    """Cuts replicated boxes held by the same `ranks` along dim 0 so that those ranks end as level as rows allow:
    the boxes, end to end, are one stream, and each holder below the water level takes the next stretch of it up
    to the level. At most len(items) + len(ranks) - 1 pieces, each holder's one stretch, so the pieces of one box
    go to distinct holders."""
    sizes_ = [nbytes(box) for box, _ in items]
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
    for ((tid, offsets, sizes), who), size in zip(items, sizes_):
        rows, row = sizes[0], 0
        row_bytes = size // rows
        while row < rows:
            r, end = bounds[b]
            cut = rows if end >= start + size else max(row, min(rows, round((end - start) / row_bytes)))
            if cut > row:
                if row == 0 and cut == rows:
                    piece = (r, who[group_of[r]], tid, offsets, sizes, -1, 0, size)
                else:
                    piece = (r, who[group_of[r]], tid, (offsets[0] + row,) + offsets[1:], (cut - row,) + sizes[1:],
                             row, cut - row, (cut - row) * row_bytes)
                pieces.append(piece)
                load[r] += (cut - row) * row_bytes
                row = cut
            if cut < rows:
                b += 1
        start += size
