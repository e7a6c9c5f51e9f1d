"""The load's search for the saved chunks each target overlaps (load/reads.py `_overlaps_by_batch`), done with
array work a batch at a time, against the comparison of every chunk in Python it replaced: the same chunks, in
the table's order, for random layouts of 0- to 3-dimensional tensors, empty chunks, targets whose dims are not
their tensor's, and batches small enough that one search spans many."""
import random

import msgpack
import pytest

from tiered_ckpt.load.reads import MANY, _intersect, _overlaps_by_batch
from tiered_ckpt.manifest.table import TensorTable


def _random_table(rng: random.Random, tensors: int) -> tuple[TensorTable, list[tuple[tuple, tuple]]]:
    rows, shapes = [], []
    for t in range(tensors):
        shape = tuple(rng.randint(0, 9) for _ in range(rng.randint(0, 3)))
        chunks = []
        for rank in range(rng.randint(1, 6)):
            offsets = tuple(rng.randint(0, max(n - 1, 0)) for n in shape)
            sizes = tuple(rng.randint(0, n - o) for n, o in zip(shape, offsets))
            count = 1
            for n in sizes:
                count *= n
            chunks.append((offsets, sizes, rank, 64 * t, 4 * count))
        rows.append((f"t{t}", "torch.float32", shape, chunks))
        shapes.append(shape)
    return TensorTable.from_rows(rows), shapes


def _oracle(table: TensorTable, index: int, offsets: tuple, sizes: tuple) -> list[tuple]:
    out = []
    for c in range(int(table.chunk_at[index]), int(table.chunk_at[index + 1])):
        if int(table.nbytes[c]) == 0:
            continue
        a, b = int(table.box_at[c]), int(table.box_at[c + 1])
        box = tuple(table.offsets[a:b].tolist()), tuple(table.sizes[a:b].tolist())
        if box == (offsets, sizes) or _intersect(*box, offsets, sizes) is not None:
            out.append((c, int(table.rank[c]), int(table.byte_offset[c]), int(table.nbytes[c]), *box))
    return out


@pytest.mark.parametrize("seed", range(20))
def test_the_chunks_found_are_those_a_comparison_of_each_finds(seed):
    rng = random.Random(seed)
    table, shapes = _random_table(rng, 40)
    boxes = {}
    for index in rng.sample(range(len(shapes)), 30):
        shape = shapes[index]
        if rng.random() < 0.1:  # a target whose dims are not its saved tensor's
            shape = shape + (1,) if rng.random() < 0.5 or not shape else shape[:-1]
        offsets = tuple(rng.randint(0, max(n - 1, 0)) for n in shape)
        boxes[index] = offsets, tuple(rng.randint(0, n - o) for n, o in zip(shape, offsets))
    for batch in (1, 7, 1 << 20):
        found, seen = {}, []
        for items, overlaps in _overlaps_by_batch(table, ((i, "x", *box) for i, box in boxes.items()), batch=batch):
            assert set(overlaps) <= {item[0] for item in items}
            seen += [item[0] for item in items]
            found.update(overlaps)
        assert seen == list(boxes)  # every target, in order
        for index, (offsets, sizes) in boxes.items():
            assert found.get(index, []) == _oracle(table, index, offsets, sizes), (seed, batch, index)


def _sharded_table(rng: random.Random, tensors: int, in_order: bool) -> tuple[TensorTable, list[tuple]]:
    """Tensors of more than MANY chunks (FSDP-like dim-0 shards of uneven extent, some empty, some overlapping
    their neighbours, a few also cut on dim 1), every offset and size below 2**16 and the tensors longer: stored as
    2-byte unsigned values, an offset plus a size wraps around unless widened first."""
    rows, shapes = [], []
    for t in range(tensors):
        shape = (rng.randint(90_000, 120_000), rng.randint(1, 4))
        base = rng.randint(0, 60_000)
        starts = sorted(rng.randint(base, 65_535) for _ in range(rng.randint(MANY + 1, 3 * MANY)))
        if not in_order:
            rng.shuffle(starts)
        chunks = []
        for rank, start in enumerate(starts):
            extent = rng.choice((0, 1, rng.randint(1, 400), rng.randint(1, 65_535)))
            col = rng.randint(0, shape[1] - 1) if rng.random() < 0.2 else 0
            width = shape[1] - col
            chunks.append(((start, col), (extent, width), rank, 0, 4 * extent * width))
        rows.append((f"t{t}", "torch.float32", shape, chunks))
        shapes.append(shape)
    return TensorTable.from_rows(rows), shapes


@pytest.mark.parametrize("in_order", [True, False])
@pytest.mark.parametrize("seed", range(6))
def test_tensors_of_many_chunks_are_searched_by_dim_0_as_stored_in_a_manifest(seed, in_order):
    rng = random.Random(seed)
    built, shapes = _sharded_table(rng, 8, in_order)
    decoded = TensorTable.from_columns(msgpack.unpackb(msgpack.packb(built.columns())))  # (as stored: 2-byte, read-only)
    assert decoded.offsets.dtype.itemsize == 2 and not decoded.offsets.flags.writeable
    boxes = {}
    for index, shape in enumerate(shapes):
        col = rng.randint(0, shape[1] - 1)
        if index % 2:  # a target whose last row is the first of a chunk (and only that one row of it)
            chunk = rng.choice(built[index].chunks)
            a = rng.randint(max(0, chunk.offsets[0] - 500), chunk.offsets[0])
            boxes[index] = (a, col), (chunk.offsets[0] + 1 - a, shape[1] - col)
            continue
        a = rng.choice((rng.randint(0, shape[0] - 1), rng.randint(65_536, shape[0] - 1)))  # (some past 2**16)
        boxes[index] = (a, col), (rng.choice((1, rng.randint(1, shape[0] - a))), shape[1] - col)
    for table in (built, decoded):
        found = {}
        for _, overlaps in _overlaps_by_batch(table, ((i, "x", *box) for i, box in boxes.items()), batch=1 << 20):
            found.update(overlaps)
        for index, (offsets, sizes) in boxes.items():
            assert found.get(index, []) == _oracle(built, index, offsets, sizes), (seed, index)
