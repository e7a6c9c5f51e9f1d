"""The save planner as it was before the coordinator planned alone (commit 6cdf1ad, save/plan.py's build_plan):
every rank planned the whole world. Kept as the oracle that the new planner's chunks, bytes and balance are
compared with (test_world_plan.py). Returns (chunks per path, rank stream lengths, LocalCopies rows per rank)."""
from __future__ import annotations

import heapq
import math
import pickle
from typing import Any

from tiered_ckpt.errors import StateError

ALIGN = 64


def old_plan(everyone: list[list[tuple]]) -> tuple[dict[str, list[tuple]], list[int], list[list[tuple]]]:
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
    pieces: list[list[tuple]] = [[] for _ in range(world)]
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
    local: list[list[tuple]] = [[] for _ in range(world)]
    rank_nbytes = []
    for r in range(world):
        offset = 0
        mine = pieces[r]
        if len(mine) > 1:
            mine.sort()
        for path, offsets, sizes, index, dim0, size in mine:
            offset = -(-offset // ALIGN) * ALIGN
            chunks[path].append((offsets, sizes, r, offset, size))
            local[r].append((index, dim0, size))
            offset += size
        rank_nbytes.append(offset)
    return chunks, rank_nbytes, local


def _equal_ranks(everyone: list[Any]) -> tuple[list[tuple[Any, list[int]]], list[int]]:
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
          pieces: list[list[tuple]], nbytes: Any) -> None:
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
