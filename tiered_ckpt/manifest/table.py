"""The tensors of a manifest or a plan as columns: one list of paths and a few integer arrays.

A state of 100k small tensors held as a TensorMeta, a ChunkMeta and their tuples each is ~500k objects that
Python's garbage collector walks in every full collection, for as long as the plan is cached or the manifest
read; decoding them made a load trigger full collections of 0.4 s each. As columns they are a dozen objects,
coded to and from the manifest's wire columns by array work. A TensorMeta is made only when asked for (and is
dropped after). Hot paths read the columns: `paths`, `index_by_path`, `chunk_spans`.
"""
from __future__ import annotations

from functools import cached_property
from typing import TYPE_CHECKING, Any, Iterable, Iterator, Sequence, TypeVar, overload

import numpy as np

from ..release import BlockedDict, by_hash, empty, hash_block_mask
from .pieces import hashes, rows
from .tensors import ChunkMeta, TensorMeta, dtype_from_str

if TYPE_CHECKING:
    from numpy.typing import NDArray


CHECKED = 1 << 20  # chunks checked at a time (TensorTable.check)
ChunkRow = tuple[Sequence[int], Sequence[int], int, int, int]  # offsets, sizes, rank, byte offset, nbytes
Row = TypeVar("Row")


class ColumnRows(Sequence[Row]):
    """A Sequence over columns whose rows are objects made when one is asked for (`_row`), never kept: what
    TensorTable and the plan's LocalCopies hand out. Subclasses give `__len__` and `_row`."""

    def _row(self, index: int) -> Row:
        raise NotImplementedError

    @overload
    def __getitem__(self, index: int) -> Row: ...
    @overload
    def __getitem__(self, index: slice) -> list[Row]: ...

    def __getitem__(self, index: int | slice) -> Row | list[Row]:
        if isinstance(index, slice):
            return [self._row(i) for i in range(*index.indices(len(self)))]
        if index < 0:
            index += len(self)
        if not 0 <= index < len(self):
            raise IndexError(f"row {index} of {len(self)}")
        return self._row(index)


def _starts(lengths: NDArray[np.int64]) -> NDArray[np.int64]:
    """Where each row of a ragged column begins in its flat array, and (last) the total."""
    out = np.zeros(len(lengths) + 1, dtype=np.int64)
    np.cumsum(lengths, out=out[1:])
    return out


def stored_width(values: NDArray[Any]) -> int:
    """Bytes a value of the narrowest unsigned width that holds every one of (non-negative) `values`: 1, 2, 4 or 8,
    as the manifest stores an integer column."""
    top = int(values.max(initial=0))
    return next(w for w in (1, 2, 4, 8) if top < 1 << (8 * w))


def _encode(values: NDArray[Any]) -> list[Any]:
    """Non-negative ints as [width, little-endian bytes] in the narrowest unsigned width that holds them (a view of
    `values` when they are stored so already: a table read from a manifest)."""
    width = stored_width(values)
    stored = values if values.dtype == np.dtype(f"<u{width}") else values.astype(f"<u{width}")
    return [width, memoryview(np.ascontiguousarray(stored)).cast("B")]


def _decode(data: list[Any], *, stored: bool = False) -> NDArray[Any]:
    """An integer column as int64; with `stored`, one of 1, 2 or 4 bytes a value is left as stored (a read-only
    unsigned view of the record's bytes, not widened into fresh memory: 560 MB of int64 for the chunk columns of a
    10,240-rank manifest, most of a loading rank's metadata CPU on a machine where fresh memory is costly)."""
    width, raw = data
    if int(width) not in (1, 2, 4, 8):
        raise ValueError(f"integer column of width {width!r}")
    if stored and int(width) < 8:
        return np.frombuffer(raw, dtype=f"<u{int(width)}")
    values = np.frombuffer(raw, dtype=f"<u{int(width)}").astype(np.int64)
    if len(values) and int(values.min()) < 0:  # a u8 above 2**63 wrapped around
        raise ValueError("integer column out of range")
    return values


def _decodes_to(data: list[Any], table: TensorTable) -> bool:
    """Whether an integer column holds the dims of each chunk of `table`, compared as stored (not widened into a
    fresh array first)."""
    stored = _decode(data, stored=True)
    if table.uniform_ndim is not None:
        return len(stored) == len(table.rank) and bool((stored == table.uniform_ndim).all())
    return bool(np.array_equal(stored, table.chunk_ndim))


class TensorTable(ColumnRows[TensorMeta]):
    """Tensors (path, dtype, global shape) and their chunks (box, rank, byte range in that rank's stream),
    column-wise. Per tensor t: `ndim[t]` dims at `shape[shape_at[t]:...]`, chunks `chunk_at[t]` to
    `chunk_at[t+1]`; per chunk c: `rank[c]`, `byte_offset[c]`, `nbytes[c]`, and its box's `offsets` and `sizes`
    at `box_of(c)` (each of its tensor's ndim). The per-tensor columns are int64; the per-chunk ones of a table
    read from a manifest may be unsigned and read-only as stored (`from_columns`): widen what you compute with."""

    def __init__(self, paths: list[str], dtype_names: list[str], dtype: NDArray[np.int64], ndim: NDArray[np.int64],
                 shape: NDArray[np.int64], nchunks: NDArray[np.int64], rank: NDArray[np.int64],
                 byte_offset: NDArray[np.int64], nbytes: NDArray[np.int64], offsets: NDArray[np.int64],
                 sizes: NDArray[np.int64]):
        count = len(paths)
        if not (len(dtype) == len(ndim) == len(nchunks) == count):
            raise ValueError(f"{count} paths but {len(dtype)} dtypes, {len(ndim)} shapes, {len(nchunks)} chunk counts")
        if len(dtype) and (int(dtype.max()) >= len(dtype_names) or int(dtype.min()) < 0):
            raise ValueError("a dtype index out of range")
        self.paths, self.dtype_names, self.dtype, self.ndim, self.shape = paths, dtype_names, dtype, ndim, shape
        self.nchunks, self.rank, self.byte_offset, self.nbytes = nchunks, rank, byte_offset, nbytes
        self.offsets, self.sizes = offsets, sizes
        self.shape_at, self.chunk_at = _starts(ndim), _starts(nchunks)
        chunks = int(self.chunk_at[-1])
        if not (len(rank) == len(byte_offset) == len(nbytes) == chunks) or len(shape) != int(self.shape_at[-1]):
            raise ValueError(f"column lengths do not add up ({chunks} chunks, {len(rank)} ranks, "
                             f"{len(shape)} shape values for {int(self.shape_at[-1])})")
        # every chunk's box has its tensor's dims; when all tensors have the same, a chunk's box is found by a
        # product, with no array of 10M starts at 10,240 ranks (box_at, made only when the dims differ)
        self.uniform_ndim = int(ndim[0]) if len(ndim) and int(ndim.min()) == int(ndim.max()) else None
        if len(offsets) != int(np.dot(ndim, nchunks)) or len(sizes) != len(offsets):
            raise ValueError("chunk boxes do not have their tensors' dims")

    @cached_property
    def chunk_ndim(self) -> NDArray[Any]:
        """Each chunk's dims (its tensor's), a byte each where they fit."""
        return np.repeat(self.ndim.astype(np.uint8) if int(self.ndim.max(initial=0)) < 256 else self.ndim,
                         self.nchunks)

    @cached_property
    def box_at(self) -> NDArray[np.int64]:
        """Where each chunk's box starts in `offsets` and `sizes`, and (last) their length."""
        return _starts(self.chunk_ndim)

    def box_of(self, chunks: Any) -> Any:
        """Where the boxes of `chunks` (an index or an array of them) start in `offsets` and `sizes`."""
        if self.uniform_ndim is not None:
            return chunks * self.uniform_ndim
        return self.box_at[chunks]

    # -- made from, and coded to, other forms ------------------------------------------------------------
    @classmethod
    def from_metas(cls, tensors: Iterable[TensorMeta]) -> TensorTable:
        """From TensorMeta objects (format 1 and 2 manifests, tests)."""
        return cls.from_rows((t.path, t.dtype, t.shape, [(c.offsets, c.sizes, c.rank, c.byte_offset, c.nbytes)
                                                         for c in t.chunks]) for t in tensors)

    @classmethod
    def from_rows(cls, rows: Iterable[tuple[str, str, Sequence[int], Iterable[ChunkRow]]]) -> TensorTable:
        """From (path, dtype, shape, chunks) per tensor, each chunk (offsets, sizes, rank, byte offset, nbytes):
        the plan builds its table so, with no object per tensor left behind."""
        paths: list[str] = []
        names: dict[str, int] = {}
        dtype, ndim, shape, nchunks = [], [], [], []
        rank, byte_offset, nbytes, offsets, sizes = [], [], [], [], []
        for path, dtype_name, tensor_shape, chunks in rows:
            paths.append(path)
            dtype.append(names.setdefault(dtype_name, len(names)))
            ndim.append(len(tensor_shape))
            shape.extend(tensor_shape)
            count = 0
            for box_offsets, box_sizes, chunk_rank, chunk_offset, chunk_nbytes in chunks:
                if not len(box_offsets) == len(box_sizes) == len(tensor_shape):
                    raise ValueError(f"a chunk of {path!r} has {len(box_offsets)} dims, the tensor "
                                     f"{len(tensor_shape)}")
                rank.append(chunk_rank)
                byte_offset.append(chunk_offset)
                nbytes.append(chunk_nbytes)
                offsets.extend(box_offsets)
                sizes.extend(box_sizes)
                count += 1
            nchunks.append(count)
        arrays = (np.asarray(v, dtype=np.int64) for v in (dtype, ndim, shape, nchunks, rank, byte_offset, nbytes,
                                                         offsets, sizes))
        return cls(paths, list(names), *arrays)

    @classmethod
    def from_columns(cls, cols: dict[str, Any]) -> TensorTable:
        """From the manifest's wire columns (format 3 and later)."""
        offsets, sizes = cols["offsets"], cols["sizes"]
        table = cls([str(p) for p in cols["path"]], [str(d) for d in cols["dtypes"]], _decode(cols["dtype"]),
                    _decode(cols["shape"]["len"]), _decode(cols["shape"]["flat"]), _decode(cols["nchunks"]),
                    *(_decode(c, stored=True) for c in (cols["rank"], cols["byte_offset"], cols["nbytes"],
                                                         offsets["flat"], sizes["flat"])))
        if not (_decodes_to(offsets["len"], table) and _decodes_to(sizes["len"], table)):
            raise ValueError("chunk boxes do not have their tensors' dims")
        return table

    def columns(self) -> dict[str, Any]:
        """The wire columns: little-endian integer arrays in their narrowest width, dtypes by index, so msgpack
        codes a few byte strings instead of millions of small objects."""
        def ragged(lengths: NDArray[np.int64], flat: NDArray[np.int64]) -> dict[str, Any]:
            return {"len": _encode(lengths), "flat": _encode(flat)}

        return {"path": self.paths, "dtypes": self.dtype_names, "dtype": _encode(self.dtype),
                "shape": ragged(self.ndim, self.shape), "nchunks": _encode(self.nchunks),
                "offsets": ragged(self.chunk_ndim, self.offsets), "sizes": ragged(self.chunk_ndim, self.sizes),
                "rank": _encode(self.rank), "byte_offset": _encode(self.byte_offset), "nbytes": _encode(self.nbytes)}

    # -- the Sequence of TensorMeta ----------------------------------------------------------------------
    def __len__(self) -> int:
        return len(self.paths)

    def _row(self, index: int) -> TensorMeta:
        first, last = int(self.chunk_at[index]), int(self.chunk_at[index + 1])
        return TensorMeta(self.paths[index], self.dtype_names[self.dtype[index]], self.shape_of(index),
                          tuple(self._chunk(c) for c in range(first, last)))

    def nbytes_of(self, index: int) -> int:
        """A whole tensor's bytes (its global shape and dtype), without making its TensorMeta."""
        n = dtype_from_str(self.dtype_names[self.dtype[index]]).itemsize
        for size in self.shape_of(index):
            n *= size
        return n

    def shape_of(self, index: int) -> tuple[int, ...]:
        return tuple(self.shape[self.shape_at[index]:self.shape_at[index + 1]].tolist())

    def _chunk(self, c: int) -> ChunkMeta:
        a, b = int(self.box_of(c)), int(self.box_of(c + 1))
        return ChunkMeta(tuple(self.offsets[a:b].tolist()), tuple(self.sizes[a:b].tolist()), int(self.rank[c]),
                         int(self.byte_offset[c]), int(self.nbytes[c]))

    def __iter__(self) -> Iterator[TensorMeta]:
        """Every tensor, the columns turned into Python ints once (not an array lookup per value)."""
        shape, offsets, sizes = self.shape.tolist(), self.offsets.tolist(), self.sizes.tolist()
        shape_at, chunk_at, box_at = self.shape_at.tolist(), self.chunk_at.tolist(), self.box_at.tolist()
        rank, byte_offset, nbytes = self.rank.tolist(), self.byte_offset.tolist(), self.nbytes.tolist()
        names = self.dtype_names
        for t, (path, d) in enumerate(zip(self.paths, self.dtype.tolist())):
            chunks = tuple(ChunkMeta(tuple(offsets[box_at[c]:box_at[c + 1]]), tuple(sizes[box_at[c]:box_at[c + 1]]),
                                     rank[c], byte_offset[c], nbytes[c]) for c in range(chunk_at[t], chunk_at[t + 1]))
            yield TensorMeta(path, names[d], tuple(shape[shape_at[t]:shape_at[t + 1]]), chunks)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, TensorTable):
            return NotImplemented
        mine, theirs = np.asarray(self.dtype_names, dtype=object), np.asarray(other.dtype_names, dtype=object)
        return (self.paths == other.paths and len(self.dtype) == len(other.dtype)
                and bool(np.all(mine[self.dtype] == theirs[other.dtype]) if len(self.dtype) else True)
                and all(np.array_equal(getattr(self, f), getattr(other, f)) for f in
                        ("ndim", "shape", "nchunks", "rank", "byte_offset", "nbytes", "offsets", "sizes")))

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return f"TensorTable({len(self)} tensors, {len(self.rank)} chunks)"

    def release(self) -> None:
        """Empty the paths (one str per tensor) a batch at a time: called in a worker thread by the table's last
        user, since the list dropped whole is 1M frees in one C call, on whichever thread drops it (release.py)."""
        empty(self.paths)

    # -- column work for the hot paths -------------------------------------------------------------------
    def index_by_path(self) -> "BlockedDict[str, int]":
        """path → position, in blocks by hash (one dict of 1M paths grows by resizes that each hold the GIL up to
        70 ms: release.py). Of strs and ints only, so the garbage collector does not track it."""
        paths = self.paths
        block = hashes(paths)  # (by_hash's blocks, a piece at a time: pieces.py)
        mask = hash_block_mask()
        block &= mask
        # stable (within a block, paths in table order: a path listed twice keeps its last position, as a dict
        # comprehension did), and on bytes, which numpy sorts by radix in one pass
        order = np.argsort(block.astype(np.uint8) if mask < 256 else block, kind="stable")
        bounds = np.searchsorted(block[order], np.arange(mask + 2)).tolist()
        return BlockedDict.of_blocks(by_hash, {b: {paths[i]: i for i in order[bounds[b]:bounds[b + 1]].tolist()}
                                               for b in range(mask + 1) if bounds[b + 1] > bounds[b]})

    def chunk_spans(self, rank: int) -> list[tuple[int, int]]:
        """(byte offset, nbytes) of every non-empty chunk in `rank`'s stream, in stream order."""
        mine = (self.rank == rank) & (self.nbytes > 0)
        starts, lengths = self.byte_offset[mine], self.nbytes[mine]
        order = np.lexsort((lengths, starts))
        return list(zip(rows(starts[order]), rows(lengths[order])))  # (a piece at a time: pieces.py)

    def check(self, rank_nbytes: Sequence[int]) -> str | None:
        """What is wrong with the chunks given each rank's stream length, or None: ranks in range, byte ranges
        inside their rank's stream, no negative size."""
        world = len(rank_nbytes)
        if len(self.rank) == 0:
            return None
        if int(self.rank.min()) < 0 or int(self.rank.max()) >= world:
            return "a chunk's rank is out of range"
        stream_ends = np.asarray(rank_nbytes, dtype=np.int64)
        for start in range(0, len(self.rank), CHECKED):  # (a batch at a time: no world-sized temporaries)
            rank, byte_offset, nbytes = (c[start:start + CHECKED] for c in (self.rank, self.byte_offset, self.nbytes))
            ends = stream_ends[rank]
            # (nbytes > ends - byte_offset: both are non-negative then, so it cannot overflow as a sum could)
            bad = np.flatnonzero((byte_offset < 0) | (nbytes < 0) | (nbytes > ends - byte_offset))
            if len(bad):
                tensor = int(np.searchsorted(self.chunk_at, start + bad[0], side="right")) - 1
                return f"a chunk of {self.paths[tensor]!r}"
        return None
