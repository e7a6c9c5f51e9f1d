"""buffers.Sinks: the buffers one part's bytes fill, kept as what they are (a CPU tensor's byte view is made only
while it is written), filled exactly as the plain list of memoryviews they replace would be."""
import gc

import pytest
import torch

from tiered_ckpt.buffers import Sinks, tensor_bytes
from tiered_ckpt.storage.tiers.base import scatter


def _layout():
    """A tensor, a memoryview range, an empty buffer, a range of a tensor and a filler buffer (part_views now
    skips such bytes: Sinks.skip, tested below against this layout)."""
    a, b = torch.zeros(3, dtype=torch.int32), torch.zeros(10, dtype=torch.uint8)
    raw, filler = bytearray(8), bytearray(5)
    sinks = Sinks()
    sinks.append(a)
    sinks.append(memoryview(raw), 2, 7)
    sinks.append(memoryview(bytearray(0)))
    sinks.append(b, 4, 10)
    sinks.append(memoryview(filler))
    plain = [tensor_bytes(a), memoryview(raw)[2:7], memoryview(bytearray(0)), tensor_bytes(b)[4:10], memoryview(filler)]
    return sinks, plain, (a, raw, b, filler)


def _snapshot(held):
    a, raw, b, filler = held
    return a.clone(), bytes(raw), b.clone(), bytes(filler)


@pytest.mark.parametrize("start, pieces", [(0, [bytes(range(1, 29))]), (0, [bytes(range(1, 40))]),
                                           (9, [b"\x07" * 3, b"\x08" * 9]), (17, [bytes(range(50, 61))]),
                                           (28, [b"\xff" * 4])])
def test_sinks_fill_as_the_list_of_views_they_replace(start, pieces):
    sinks, _, held = _layout()
    other_sinks, plain, other_held = _layout()
    sinks.scatter(pieces, start)
    scatter(pieces, [v for v in plain], start)
    assert sinks.nbytes == 28 and len(sinks) == 5
    for mine, theirs in zip(_snapshot(held), _snapshot(other_held)):
        assert (torch.equal(mine, theirs) if isinstance(mine, torch.Tensor) else mine == theirs)


@pytest.mark.parametrize("start, pieces", [(0, [bytes(range(1, 29))]), (3, [b"\x05" * 20]), (25, [b"\x06" * 9])])
def test_skipped_bytes_are_stepped_over_and_the_rest_filled_as_before(start, pieces):
    """A skipped stretch (a chunk the rank does not want) takes its place in the value like the filler buffer it
    replaces, but keeps no memory: the buffers around it get the same bytes."""
    sinks, _, held = _layout()
    skipping = Sinks()
    a, raw, b = torch.zeros(3, dtype=torch.int32), bytearray(8), torch.zeros(10, dtype=torch.uint8)
    skipping.append(a)
    skipping.append(memoryview(raw), 2, 7)
    skipping.append(memoryview(bytearray(0)))
    skipping.append(b, 4, 10)
    skipping.skip(5)
    sinks.scatter(pieces, start)
    skipping.scatter(pieces, start)
    assert skipping.nbytes == sinks.nbytes == 28 and skipping.length(4) == 5
    assert torch.equal(a, held[0]) and bytes(raw) == bytes(held[1]) and torch.equal(b, held[2])
    assert len(skipping[4]) == 5  # a view of it (for a driver that reads into views) is fresh memory
    assert skipping.select([(23, 5)]).nbytes == 0  # never a wanted buffer
    with pytest.raises(ValueError):
        skipping.skip(-1)


def test_indexing_gives_each_buffer_and_select_takes_spans():
    sinks, _, (a, raw, b, _) = _layout()
    assert [sinks.length(i) for i in range(len(sinks))] == [12, 5, 0, 6, 5]
    sinks[3][:] = b"\x09" * 6
    assert b.tolist() == [0] * 4 + [9] * 6
    picked = sinks.select([(12, 5), (17, 6)])
    assert len(picked) == 2 and picked.nbytes == 11
    picked.scatter([b"\x01" * 11])
    assert bytes(raw) == b"\x00\x00" + b"\x01" * 5 + b"\x00" and b.tolist() == [0] * 4 + [1] * 6
    with pytest.raises(ValueError):
        Sinks().append(a, 0, 13)


def test_sinks_keep_no_byte_view_per_tensor():
    targets = [torch.zeros(4) for _ in range(2000)]
    gc.collect()
    gc.disable()
    try:
        before = len(gc.get_objects())
        sinks = Sinks()
        for t in targets:
            sinks.append(t)
        grown = len(gc.get_objects()) - before
    finally:
        gc.enable()
    assert grown < 20, f"{grown} tracked objects for 2000 tensors"
    sinks.scatter([bytes(16) + b"\x00\x00\x80\x3f" * 4 * 1999])  # 1.0 in every tensor but the first
    assert targets[0].sum() == 0 and all(t.tolist() == [1.0] * 4 for t in targets[1:])


def test_a_tensor_given_other_memory_meanwhile_is_refused_not_written():
    """A read abandoned by a timeout may still scatter from its thread; if the caller has since given the tensor
    other memory (`t.data = ...`), nothing is written there."""
    t = torch.zeros(4)
    sinks = Sinks()
    sinks.append(t)
    t.data = torch.zeros(1)
    with pytest.raises(RuntimeError, match="other memory"):
        sinks.scatter([b"\x01" * 16])
    assert t.tolist() == [0.0]


@pytest.mark.parametrize("view", [lambda t: t.conj(), lambda t: t._neg_view()])
def test_a_tensor_whose_bytes_are_not_its_values_is_refused(view):
    with pytest.raises(ValueError, match="bytes are its values"):
        Sinks().append(view(torch.zeros(2, dtype=torch.complex64)))
