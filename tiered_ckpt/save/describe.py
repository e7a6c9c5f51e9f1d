"""A rank's side of a plan miss: what it sends the coordinator of its tensors, and its share of the answer.

A rank's tensors are sent in three parts, so that the coordinator reads what ranks have in common once:
- the structure (paths, dtypes, element sizes, global shapes), pickled and named by a digest; ranks whose
  structure is rank 0's (every rank under DDP and FSDP) send the digest alone;
- the boxes (offsets and sizes, padded to the structure's largest rank with offset 0 and size 1, and whether
  the box is this rank's alone) as one integer array in its narrowest width (2-4 bytes a value under FSDP);
  ranks whose boxes are rank 0's (every rank under DDP) send none, and the coordinator unpacks them once;
- tensors of this rank's own (`tc.PerRank`, whose paths end in `@rank<r>`), apart, so that they do not make
  every rank's structure differ.

A box is this rank's alone when no other rank can hold it: a DTensor whose mesh dimensions are all sharded (or
have one rank), not empty, or a tensor of this rank's own. The coordinator places such boxes with array work
(FSDP's R x tensors boxes), and the others (replicated, or plain tensors held under one name by several
ranks) by comparing them.

The answer is, for each box this rank writes: its descriptor, the rows of it (when a replicated box is cut),
and its offset in the rank's stream; the rank makes its LocalCopies from that and its own boxes.
"""
from __future__ import annotations

import hashlib
import math
import pickle
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np
import torch

from ..manifest import pieces
from ..manifest.pieces import dumps as dumps_in_pieces, int_array
from ..release import release_all
from .local_copies import LocalCopies

Descriptor = tuple  # (path, dtype name, itemsize, global shape, offsets, sizes[, alone])
DIGEST = 16


def pack_ints(values: np.ndarray) -> bytes:
    """Non-negative ints as one width byte and little-endian values in the narrowest width that holds them."""
    top = int(values.max()) if len(values) else 0
    width = next(w for w in (1, 2, 4, 8) if top < 1 << (8 * w))
    return bytes([width]) + values.astype(f"<u{width}").tobytes()


def unpack_ints(data: bytes) -> np.ndarray:
    return np.frombuffer(data, dtype=f"<u{data[0]}", offset=1).astype(np.int64)


@dataclass
class Described:
    """What this rank sent (`payload`) and what it keeps to read the answer: per descriptor (shared ones first,
    then its own), the local tensor it comes from, its local box sizes and its dtype."""

    payload: tuple[Any, ...]
    index: list[int]
    sizes: list[tuple[int, ...]]
    dtypes: list[str]
    itemsizes: list[int]
    digest: tuple[bytes, bytes]  # of the structure and of the boxes

    def payload_for(self, first: tuple[bytes, bytes] | None) -> tuple[Any, ...]:
        """What this rank sends: without its structure, or its boxes, where they are rank 0's (`first`: rank 0's
        digests; None on rank 0 itself)."""
        name, structure, boxes, *rest = self.payload
        same = (False, False) if first is None else (self.digest[0] == first[0], self.digest[1] == first[1])
        return (name, None if same[0] else structure, None if same[1] else boxes, *rest)

    def local(self, reply: bytes) -> LocalCopies:
        """This rank's LocalCopies from its share of the coordinator's answer (rows of descriptor, cut start or
        -1, cut length, byte offset)."""
        # turned into Python ints a piece at a time: one tolist() of 1M rows holds the GIL ~0.1 s (pieces.py)
        rows = pieces.rows(np.frombuffer(reply, dtype="<i8").reshape(-1, 4)) if reply else ()
        local = LocalCopies()
        dtypes: dict[str, torch.dtype] = {}
        for d, start, length, offset in rows:
            sizes = self.sizes[d]
            if start < 0:
                dim0, shape = None, sizes
            else:
                dim0, shape = (start, length), (length, *sizes[1:])
            name = self.dtypes[d]
            dtype = dtypes.get(name)
            if dtype is None:
                dtype = dtypes[name] = getattr(torch, name.removeprefix("torch."))
            local.append(self.index[d], dim0, offset, self.itemsizes[d] * math.prod(shape), shape, dtype)
        return local


def own_suffix(rank: int) -> str:
    return f"@rank{rank}"  # state/skeleton.per_rank_name's mark of a PerRank entry's paths


def describe(descriptors: Sequence[Descriptor], rank: int, fingerprints: bytes = b"") -> Described:
    """Encode this rank's descriptors (in its tensors' order) for the plan gather."""
    suffix = own_suffix(rank)
    shared = [i for i, d in enumerate(descriptors) if not d[0].endswith(suffix)]
    own = [i for i, d in enumerate(descriptors) if d[0].endswith(suffix)]
    order = shared + own
    ndim = max((len(descriptors[i][3]) for i in shared), default=0) or 1
    paths, dtypes, itemsizes, ndims, shapes = [], [], [], [], []
    offsets: list[int] = []
    sizes: list[int] = []
    alone: list[int] = []
    for i in shared:
        d = descriptors[i]
        path, dtype, itemsize, shape, box_offsets, box_sizes = d[:6]
        paths.append(path)
        dtypes.append(dtype)
        itemsizes.append(itemsize)
        ndims.append(len(shape))
        shapes.extend(shape)
        pad = ndim - len(shape)
        offsets.extend(box_offsets)
        offsets.extend((0,) * pad)
        sizes.extend(box_sizes)
        sizes.extend((1,) * pad)
        alone.append(1 if len(d) > 6 and d[6] else 0)
    # pickled and made an array a piece at a time: one C call over every tensor holds the GIL (manifest/pieces.py)
    structure = pickle.dumps([dumps_in_pieces(column) for column in (paths, dtypes, itemsizes, ndims, shapes)])
    digest = hashlib.blake2b(structure, digest_size=DIGEST).digest()
    boxes = pack_ints(np.concatenate([[ndim], int_array(offsets), int_array(sizes),
                                      int_array(alone)]).astype(np.int64, copy=False))
    mine = pickle.dumps([tuple(descriptors[i][:6]) for i in own], protocol=pickle.HIGHEST_PROTOCOL) if own else b""
    described = Described((digest, structure, boxes, mine, fingerprints), order,
                          [tuple(descriptors[i][5]) for i in order], [descriptors[i][1] for i in order],
                          [descriptors[i][2] for i in order],
                          (digest, hashlib.blake2b(boxes, digest_size=DIGEST).digest()))
    # the columns freed a batch at a time: dropped whole at the return, 1M entries each are freed in one step that
    # holds the GIL (75 ms at 1M tensors, in this thread, the loop waiting: release.py)
    release_all([paths, dtypes, itemsizes, ndims, shapes, offsets, sizes, alone, shared])
    return described
