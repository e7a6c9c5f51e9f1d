"""Reading a checkpoint back into the caller's tensors, resharding where the layouts differ.

`plan_reads` decides where each needed saved chunk goes: a chunk whose box is exactly a contiguous target's
box (or one contiguous stretch of it) is read with one scatter call straight into the target's memory (a GPU
target's through `DeviceBytes`: a host → device copy per verified chunk); any other needed chunk (resharding
across boxes, non-contiguous targets, a dtype cast) is read into a scratch buffer and its overlap copied over.
`read_parts` then reads every needed part through `TierIO.read_verified` (checksum over exactly the bytes
read; a missing, short or corrupt part is read again from the next tier), with several ranks through the
broadcast reader, so each part is read once per replica group.
"""
from __future__ import annotations

import asyncio
import bisect
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Iterable, Iterator, Mapping, NamedTuple, Sequence

import numpy as np
import torch

from .broadcast import read_with_broadcast
from .parts import part_read
from ..distributed.coordinator import Coordinator
from ..distributed.dtensor import local_box, local_tensor
from ..errors import TierError
from ..layout import checkpoint_prefix, parse_key
from ..manifest import Manifest, dtype_from_str
from ..manifest.pieces import PIECE, to_list
from ..buffers import DeviceBytes, Sink, Sinks, as_byte_tensor, tensor_bytes
from ..release import BlockedDict, by_rank_offset, empty, release_off_loop
from ..storage.tier_io import TierIO
from ..storage.verified_read import Fallback, PartRead, ReadLog

if TYPE_CHECKING:
    from ..manifest.table import TensorTable
    from .heal import HealReport


@dataclass
class LoadInfo:
    """What a load did: which step, which tier served the most bytes, and what its reads report."""

    step: int
    tier: str | None  # the tier that served the most bytes
    reads: ReadLog = field(default_factory=ReadLog)
    seconds: float = 0.0
    # the background heal this load started ([engine] heal): `await info.heal` gives its HealReport
    heal: "asyncio.Task[HealReport] | None" = field(default=None, repr=False)

    @property
    def bytes_by_tier(self) -> dict[str, int]:
        """How many bytes each tier served."""
        return self.reads.bytes_by_tier

    @property
    def fallbacks(self) -> list[Fallback]:
        """Parts that the preferred tier could not serve intact, and why."""
        return self.reads.fallbacks

    @property
    def bytes_received(self) -> int:
        """Bytes this rank got by broadcast from the reader of its replica group."""
        return self.reads.bytes_received


@dataclass
class Reads:
    """What one load reads: `dests` maps a saved chunk (rank, byte offset) to the bytes it fills, either
    the target's own memory (same box, contiguous CPU target: no extra copy) or a scratch buffer;
    `subs` maps a chunk of which this rank wants only byte ranges to them, each [(start in the chunk, the
    memory it fills, the target's key where that memory is the target's own, else None)]: the overlap of a
    target with a chunk that is one contiguous stretch of the chunk (FSDP's dim-0 shards split or merged, a
    row-parallel shard's rows) is read alone, into the target when it is a contiguous stretch of it too, else
    into a piece of scratch; `copies` then moves the overlapping boxes from scratch into the targets."""

    # (blocked: one dict of 1M chunks resized in one C call stalls the loop, release.py)
    dests: BlockedDict[tuple[int, int], Sink] = field(default_factory=lambda: BlockedDict(by_rank_offset))
    # dests that are a target's memory: its key
    direct: BlockedDict[tuple[int, int], str] = field(default_factory=lambda: BlockedDict(by_rank_offset))
    subs: BlockedDict[tuple[int, int], list[tuple[int, memoryview, str | None]]] = field(
        default_factory=lambda: BlockedDict(by_rank_offset))
    copies: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)
    keep: list[torch.Tensor] = field(default_factory=list)  # scratch buffers the views point into

    def finish(self) -> None:
        with torch.no_grad():
            for src, dst in self.copies:
                dst.copy_(src)

    def release(self) -> None:
        """Drop the scratch buffers and the per-chunk maps, a batch at a time (call it in a thread: freeing large
        buffers takes milliseconds, and 1M entries freed in one go would hold the GIL for a tenth of a second)."""
        for blocked in (self.dests, self.direct, self.subs):
            blocked.release()
        for held in (self.copies, self.keep):
            empty(held)


class Boxed(NamedTuple):
    """A plain tensor that is the box at `offsets` of a saved tensor: a target given with its place in the
    global tensor (the DCP reader's destinations), where a DTensor carries its own."""

    tensor: torch.Tensor
    offsets: tuple[int, ...]


def target_devices(targets: Mapping[int, tuple[str, torch.Tensor]]) -> list[torch.device]:
    """The GPUs that hold some of the targets."""
    return sorted({local_tensor(t).device for _, t in targets.values() if local_tensor(t).is_cuda}, key=str)


def wait_for_devices(devices: Sequence[torch.device]) -> None:
    """Kernels that the caller queued on its own streams (a fill_, an optimizer step) may still write a GPU
    target: the load's copies, made from I/O threads on other streams, start once every kernel queued on the
    targets' devices is done. Copies into GPU targets are synchronous, so when the load returns the targets
    hold the checkpoint's values for any stream."""
    for device in devices:
        torch.cuda.synchronize(device)


def plan_reads(manifest: Manifest, targets: Mapping[int, tuple[str, torch.Tensor | Boxed]]) -> Reads:
    """Where each saved chunk that overlaps a target goes. A chunk that lies wholly inside a contiguous CPU
    or GPU target of its dtype, on a contiguous stretch of it (the same box, a Shard(0) piece of a full tensor,
    any piece of a 1-d one), is read straight into that memory; so is the part of a chunk that such a target
    holds when it is one contiguous stretch of both (a saved dim-0 shard split over several ranks); any other
    into scratch, then copied."""
    reads = Reads()
    scratch: dict[tuple[int, int], torch.Tensor] = {}
    table = manifest.tensors
    dtypes = to_list(table.dtype)

    def with_boxes() -> Iterator[tuple[int, str, torch.Tensor, tuple[int, ...], tuple[int, ...]]]:
        for index, (where, target) in targets.items():
            if type(target) is Boxed:
                yield index, where, target.tensor, tuple(target.offsets), tuple(target.tensor.shape)
            else:
                _, box_offsets, box_sizes = local_box(target)
                yield index, where, local_tensor(target), tuple(box_offsets), tuple(box_sizes)

    # the saved chunks each target overlaps, found with array work a batch of targets at a time: a rank of a
    # world of R ranks that saved FSDP shards looks at R chunks per tensor, of which it needs one or two (47 s of
    # Python per rank at 10,240 ranks x 1,000 tensors when each chunk was compared in Python)
    for batch, overlapping in _overlaps_by_batch(table, with_boxes()):
        for index, where, local, box_offsets, box_sizes in batch:
            _plan_target(reads, scratch, table, dtypes[index], where, local, box_offsets, box_sizes,
                         overlapping.get(index, ()))
        empty(overlapping)  # (a batch's entries freed a few at a time: ~1M objects at once hold the GIL)
        empty(batch)
    first: list[tuple[torch.Tensor, torch.Tensor]] = []
    for key in [k for k in reads.subs if k in reads.dests]:  # the chunk is read whole anyway: copy the pieces
        whole = as_byte_tensor(reads.dests[key]) if key not in scratch else scratch[key]
        for start, view, _ in reads.subs.pop(key):
            first.append((whole[start:start + len(view)], as_byte_tensor(view)))
    reads.copies[:0] = first  # before the copies out of the pieces
    for pieces in reads.subs.values():
        pieces.sort(key=lambda s: s[0])
    return reads


def _plan_target(reads: Reads, scratch: dict[tuple[int, int], torch.Tensor], table: "TensorTable", dtype_index: int,
                 where: str, local: torch.Tensor, box_offsets: tuple[int, ...], box_sizes: tuple[int, ...],
                 overlapping: Sequence[ChunkFound]) -> None:
    """Where the saved chunks that overlap one target (its box in the saved tensor) go (plan_reads)."""
    dtype = dtype_from_str(table.dtype_names[dtype_index])
    # the target's own memory takes the bytes: a CPU tensor's directly, a GPU tensor's by a copy from the
    # read buffer, chunk by chunk (no host copy of it in between)
    direct = (local.device.type in ("cpu", "cuda") and local.is_contiguous() and local.dtype == dtype
              and not local.is_conj() and not local.is_neg())  # (a conj/neg view's bytes are not its values)
    # (a CPU target is its own sink: Sinks makes its byte view only while the scatter writes it)
    sink = _itself if local.device.type == "cpu" else DeviceBytes
    for _, rank, byte_offset, nbytes, offsets, sizes in overlapping:
        key = (rank, byte_offset)
        if direct and sizes == box_sizes and offsets == box_offsets:  # the same box: the most common
            reads.dests[key] = sink(local)
            reads.direct[key] = where
            continue
        overlap = _intersect(offsets, sizes, box_offsets, box_sizes)
        if overlap is None:
            continue
        lo, hi = overlap
        dst = local[tuple(slice(a - o, b - o) for a, b, o in zip(lo, hi, box_offsets))]
        inside = lo == tuple(offsets) and hi == tuple(o + n for o, n in zip(offsets, sizes))
        if direct and inside and dst.is_contiguous():
            reads.dests[key] = sink(dst)
            reads.direct[key] = where
            continue
        start = _contiguous_start(offsets, sizes, lo, hi)
        if direct and start is not None and dst.is_contiguous() and dst.numel():
            piece_sink = tensor_bytes(dst) if local.device.type == "cpu" else DeviceBytes(dst)
            reads.subs.setdefault(key, []).append((start * dst.element_size(), piece_sink, where))
            continue
        if start is not None and dst.numel():  # one stretch of the chunk: read just it, then copy it over
            piece = torch.empty(dst.numel() * dtype.itemsize, dtype=torch.uint8)
            reads.keep.append(piece)
            reads.subs.setdefault(key, []).append((start * dtype.itemsize, tensor_bytes(piece), None))
            reads.copies.append((piece.view(dtype).view(dst.shape), dst))
            continue
        if key not in scratch:
            scratch[key] = torch.empty(nbytes, dtype=torch.uint8)
            reads.dests[key] = tensor_bytes(scratch[key])
            reads.keep.append(scratch[key])
        src = scratch[key].view(dtype).view(sizes)
        src = src[tuple(slice(a - o, b - o) for a, b, o in zip(lo, hi, offsets))]
        reads.copies.append((src, dst))


ChunkFound = tuple[int, int, int, int, tuple[int, ...], tuple[int, ...]]  # chunk, rank, byte offset, nbytes, box


def _overlaps_by_batch(table: "TensorTable", items: Iterable[tuple[Any, ...]], batch: int = 1 << 18
                       ) -> Iterator[tuple[list[tuple[Any, ...]], dict[int, list[ChunkFound]]]]:
    """`items` are (tensor index, anything, ..., box offsets, box sizes): a target's box in that saved tensor, the
    last two. Yields them in batches, each with its targets' non-empty saved chunks whose boxes overlap them (by
    tensor index, in the table's order), compared as arrays about `batch` chunks (and at most PIECE targets) at a
    time: the memory stays bounded whatever the world, and no single C call over every tensor of a state of 1M
    holds the GIL (this runs in a thread beside the event loop: manifest/pieces.py)."""
    chunk_at, ndims = table.chunk_at, table.ndim
    pending: list[tuple[Any, ...]] = []
    count = 0
    for item in items:
        pending.append(item)
        count += int(chunk_at[item[0] + 1] - chunk_at[item[0]])
        if count >= batch or len(pending) >= PIECE:
            yield pending, _overlaps(table, ndims, pending)
            pending, count = [], 0
    if pending:
        yield pending, _overlaps(table, ndims, pending)


def _overlaps(table: "TensorTable", ndims: np.ndarray, items: list[tuple[Any, ...]]) -> dict[int, list[ChunkFound]]:
    found: dict[int, list[ChunkFound]] = {}
    by_dims: dict[int, list[int]] = {}
    boxes = {item[0]: item[-2:] for item in items}
    for index, (offsets, sizes) in boxes.items():
        n = int(ndims[index])
        by_dims.setdefault(n if len(offsets) == n == len(sizes) else -1, []).append(index)
    for n, indexes in by_dims.items():
        _overlap_batch(table, indexes, n, boxes, found)
    return found


def _overlap_batch(table: "TensorTable", indexes: list[int], ndim: int,
                   boxes: Mapping[int, tuple[tuple[int, ...], tuple[int, ...]]], found: dict[int, list[ChunkFound]]
                   ) -> None:
    idx = np.asarray(indexes, dtype=np.int64)
    first, last = table.chunk_at[idx], table.chunk_at[idx + 1]
    if ndim > 0:
        _narrow(table, indexes, ndim, boxes, first, last)
    per = last - first
    owner = np.repeat(np.arange(len(idx)), per)  # the target of each chunk looked at
    chunk = np.arange(int(per.sum()), dtype=np.int64) - np.repeat(np.cumsum(per) - per, per) + np.repeat(first, per)
    keep = table.nbytes[chunk] > 0
    if ndim > 0:
        at = table.box_of(chunk)[:, None] + np.arange(ndim)
        c_off, c_size = table.offsets[at].astype(np.int64), table.sizes[at].astype(np.int64)  # (stored: unsigned)
        t_off = np.asarray([boxes[i][0] for i in indexes], dtype=np.int64).reshape(len(idx), ndim)[owner]
        t_size = np.asarray([boxes[i][1] for i in indexes], dtype=np.int64).reshape(len(idx), ndim)[owner]
        keep &= (np.minimum(c_off + c_size, t_off + t_size) > np.maximum(c_off, t_off)).all(axis=1)
    hits = np.flatnonzero(keep)
    chunk, owner = chunk[hits], owner[hits]
    if ndim > 0:
        offsets, sizes = map(tuple, c_off[hits].tolist()), map(tuple, c_size[hits].tolist())
    elif ndim == 0:
        offsets, sizes = [()] * len(hits), [()] * len(hits)
    else:  # dims that differ from the target's (a bug elsewhere, or a hand-made target): compared in Python,
        # over the dims they have in common, as before
        starts, ends = table.box_of(chunk).tolist(), table.box_of(chunk + 1).tolist()
        offsets = [tuple(table.offsets[a:b].tolist()) for a, b in zip(starts, ends)]
        sizes = [tuple(table.sizes[a:b].tolist()) for a, b in zip(starts, ends)]
    for c, o, rank, byte_offset, nbytes, box_offsets, box_sizes in zip(
            chunk.tolist(), owner.tolist(), table.rank[chunk].tolist(), table.byte_offset[chunk].tolist(),
            table.nbytes[chunk].tolist(), offsets, sizes):
        index = indexes[o]
        if ndim < 0 and _intersect(box_offsets, box_sizes, *boxes[index]) is None:
            continue
        found.setdefault(index, []).append((c, rank, byte_offset, nbytes, box_offsets, box_sizes))


MANY = 64  # chunks of one tensor above which its candidates are narrowed by a search on dim 0 (_narrow)


def _narrow(table: "TensorTable", indexes: list[int], ndim: int,
            boxes: Mapping[int, tuple[tuple[int, ...], tuple[int, ...]]], first: np.ndarray, last: np.ndarray) -> None:
    """Narrow each target's chunk range [first, last) (in place) to the chunks whose dim-0 start can put them
    over the target, for a tensor of more than MANY chunks stored in dim-0 order (FSDP's R shards: a rank needs
    one or two of them, and comparing all R a tensor made every rank's read plan touch the world's table). A
    chunk starting at s with dim-0 extent n overlaps target rows [a, b) only if s < b and s > a - n: with the
    starts sorted, a window found by two binary searches on the tensor's rows of the table, no fresh memory."""
    for k in np.flatnonzero(last - first > MANY).tolist():
        lo, hi = int(first[k]), int(last[k])
        at, end = int(table.box_of(lo)), int(table.box_of(hi))
        starts = table.offsets[at:end:ndim].astype(np.int64)  # (dim 0 of each chunk; as stored: maybe unsigned)
        if not bool((starts[1:] >= starts[:-1]).all()):
            continue  # not in dim-0 order: every chunk is compared
        offsets, sizes = boxes[indexes[k]]
        a, b = offsets[0], offsets[0] + sizes[0]
        first[k] = lo + int(np.searchsorted(starts, a - int(table.sizes[at:end:ndim].max()), side="right"))
        last[k] = max(int(first[k]), lo + int(np.searchsorted(starts, b, side="left")))


def _itself(t: torch.Tensor) -> torch.Tensor:
    return t


def _contiguous_start(offsets: Sequence[int], sizes: Sequence[int], lo: Sequence[int], hi: Sequence[int]) -> int | None:
    """Where (in elements) the box lo..hi starts inside the chunk at `offsets` of `sizes`, if the box is one
    contiguous stretch of the chunk's row-major memory; else None."""
    dims = len(sizes)
    partial = [d for d in range(dims) if not (lo[d] == offsets[d] and hi[d] == offsets[d] + sizes[d])]
    if partial and any(hi[d] - lo[d] != 1 for d in range(partial[-1])):  # before the last partial dim: extent 1
        return None
    start, stride = 0, 1
    for d in reversed(range(dims)):
        start += (lo[d] - offsets[d]) * stride
        stride *= sizes[d]
    return start


def _intersect(a_off: Sequence[int], a_size: Sequence[int], b_off: Sequence[int],
               b_size: Sequence[int]) -> tuple[tuple[int, ...], tuple[int, ...]] | None:
    lo = tuple(max(a, b) for a, b in zip(a_off, b_off))
    hi = tuple(min(a + s, b + t) for a, s, b, t in zip(a_off, a_size, b_off, b_size))
    if any(h <= l for l, h in zip(lo, hi)):
        return None if lo else ((), ())  # 0-d tensors always overlap
    return lo, hi


def rank_spans(manifest: Manifest, rank: int) -> list[tuple[int, int]]:
    """(byte offset, nbytes) of every non-empty chunk in `rank`'s stream, in stream order."""
    return manifest.tensors.chunk_spans(rank)


def part_views(manifest: Manifest, rank: int, part: int, spans: list[tuple[int, int]],
               reads: Reads) -> tuple[Sinks, tuple[str, ...], tuple[int, ...], list[tuple[int, int]]] | None:
    """The buffers that one part's bytes scatter into, in order, the keys of the targets whose own memory some
    of them are, where in the part each of those begins, and the (offset, length) in the part of every buffer
    this rank wants (the bytes between them are skipped); None if no wanted chunk is in the part."""
    start = part * manifest.part_size
    end = start + manifest.part_length(rank, part)
    first = max(bisect.bisect_right(spans, (start,)) - 1, 0)
    views = Sinks()
    targets: list[str] = []
    starts: list[int] = []
    wanted: list[tuple[int, int]] = []
    pos = start
    for offset, nbytes in spans[first:]:
        if offset >= end:
            break
        if offset + nbytes <= start:
            continue
        if offset > pos:
            views.skip(offset - pos)  # alignment padding
        lo, hi = max(offset, start), min(offset + nbytes, end)
        dest = reads.dests.get((rank, offset))
        pieces = reads.subs.get((rank, offset)) if dest is None else None
        if pieces:  # only some stretches of the chunk: the bytes around them skipped
            at = lo
            for piece_start, piece, where in pieces:
                a, b = max(offset + piece_start, lo), min(offset + piece_start + len(piece), hi)
                if b <= a:
                    continue
                if a > at:
                    views.skip(a - at)
                views.append(piece, a - offset - piece_start, b - offset - piece_start)
                wanted.append((a - start, b - a))
                if where is not None:  # a target's own memory (not a piece of scratch)
                    targets.append(where)
                    starts.append(a - start)
                at = b
            if hi > at:
                views.skip(hi - at)
        elif dest is None:
            views.skip(hi - lo)  # a chunk this rank does not need
        else:
            views.append(dest, lo - offset, hi - offset)
            wanted.append((lo - start, hi - lo))
            if (rank, offset) in reads.direct:
                targets.append(reads.direct[(rank, offset)])
                starts.append(lo - start)
        pos = hi
    if end > pos:
        views.skip(end - pos)
    return (views, tuple(targets), tuple(starts), wanted) if wanted else None  # (wanted: see PartRead.spans)


def parts_to_read(manifest: Manifest, reads: Reads, only: set[tuple[int, int]] | None = None,
                  spans: dict[int, list[tuple[int, int]]] | None = None) -> dict[tuple[int, int], PartRead]:
    """Every part (saved rank, index) that holds a chunk this rank needs, with the buffers it fills; `only`
    restricts the parts looked at (an export reads a few tensors at a time), `spans` caches rank_spans."""
    parts: dict[tuple[int, int], PartRead] = {}
    for rank_meta in manifest.ranks:
        rank = rank_meta.rank
        candidates = range(len(rank_meta.checksums)) if only is None else sorted(p for r, p in only if r == rank)
        if not candidates:
            continue
        rank_spans_ = spans[rank] if spans is not None else rank_spans(manifest, rank)
        for p in candidates:
            found = part_views(manifest, rank, p, rank_spans_, reads)
            if found is not None:
                parts[(rank, p)] = part_read(manifest, rank, p, *found)
    return parts


async def node_holdings(io: TierIO, manifest: Manifest, order: Sequence[str]) -> dict[str, frozenset[int]]:
    """For each node-local tier in `order`: the saved ranks whose checksum record (so whose parts) this node's
    copy of the checkpoint holds. One listing of the checkpoint's folder per tier; a tier that cannot be listed
    holds nothing here."""
    out: dict[str, frozenset[int]] = {}
    prefix = checkpoint_prefix(manifest.job, manifest.step, manifest.incarnation)
    for name in order:
        if io.file_tier(name) is None:
            continue
        try:
            keys = await io.list(name, prefix)
        except TierError:
            keys = []
        out[name] = frozenset(p.rank for p in map(parse_key, keys)
                              if p is not None and p.kind == "checksums" and p.incarnation == manifest.incarnation
                              and p.rank is not None)
    return out


async def read_parts(io: TierIO, coordinator: Coordinator, manifest: Manifest | None, order: Sequence[str],
                     reads: Reads | None, log: ReadLog, holdings: dict[str, frozenset[int]] | None = None) -> None:
    """Read every part that holds a wanted chunk into its destinations, from the tiers in `order`. A rank
    that failed before (no manifest or reads) still takes part, so the ranks' collectives stay in step;
    then no rank reads anything. `holdings` (node_holdings) says what this node's node-local tiers hold: with
    several ranks, each part is read on a node whose fastest tier holds it."""
    ready = manifest is not None and reads is not None
    parts = await asyncio.to_thread(parts_to_read, manifest, reads) if ready else {}  # type: ignore[arg-type]
    try:
        await _read(io, coordinator, manifest, order, parts, log, ready, holdings)
    finally:  # each part's buffers list every tensor in it: freed in a thread, not where the last reference goes
        await release_off_loop([*parts.values(), parts])
        del parts


async def _read(io: TierIO, coordinator: Coordinator, manifest: Manifest | None, order: Sequence[str],
                parts: dict[tuple[int, int], PartRead], log: ReadLog, ready: bool,
                holdings: dict[str, frozenset[int]] | None) -> None:
    if coordinator.distributed:
        def describe(key: tuple[int, int], views: list[memoryview]) -> PartRead:
            assert manifest is not None
            return part_read(manifest, key[0], key[1], views)

        await read_with_broadcast(coordinator, io, order, parts, log, ready=ready, holdings=holdings or {},
                                  describe=describe)
    elif ready:
        outcomes = await asyncio.gather(*(io.read_verified(p, order, log) for p in parts.values()),
                                        return_exceptions=True)
        failed = [o for o in outcomes if isinstance(o, BaseException)]
        if failed:
            raise failed[0]
