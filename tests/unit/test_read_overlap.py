"""The load's search for the saved chunks each target overlaps (load/reads.py `_overlaps_by_batch`), done with
array work a batch at a time, against the comparison of every chunk in Python it replaced: the same chunks, in
the table's order, for random layouts of 0- to 3-dimensional tensors, empty chunks, targets whose dims are not
their tensor's, and batches small enough that one search spans many."""
import random

import pytest

from tiered_ckpt.load.reads import _intersect, _overlaps_by_batch
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
