"""Scratch for chunks read on their way to a GPU target: pinned, and carved out of few allocations (one
pinned allocation per chunk made a 1 GiB load take a second on an H200). The pinned allocator itself needs
CUDA; here it is replaced by plain memory, which is what the carving logic sees either way."""
import torch

from tiered_ckpt.load.reads import Scratch


class CountingScratch(Scratch):
    allocations: list[int] = []

    @staticmethod
    def _allocate_pinned(nbytes: int) -> torch.Tensor:
        CountingScratch.allocations.append(nbytes)
        return torch.empty(nbytes, dtype=torch.uint8)


def test_thousands_of_pinned_pieces_come_from_a_few_allocations_and_never_overlap():
    CountingScratch.allocations = []
    scratch = CountingScratch()
    sizes = [64 << 10] * 1638 + [4 << 20] * 77 + [64 << 20] * 10 + [6]  # a 1 GiB state's mix, and an odd size
    pieces = [scratch.take(n, pin=True) for n in sizes]
    assert [p.numel() for p in pieces] == sizes
    assert len(CountingScratch.allocations) <= 32
    assert sum(CountingScratch.allocations) <= 2 * sum(sizes)  # doubling: never more than twice what is asked
    spans = sorted((p.data_ptr(), p.data_ptr() + p.numel()) for p in pieces)
    assert all(a_end <= b_start for (_, a_end), (b_start, _) in zip(spans, spans[1:]))
    assert all(p.data_ptr() % Scratch.ALIGN == 0 for p in pieces)
    pieces[1].view(torch.float64)  # aligned for any dtype
    assert scratch.pinned


def test_a_small_load_pins_little_and_unpinned_scratch_is_one_buffer_per_piece():
    CountingScratch.allocations = []
    scratch = CountingScratch()
    scratch.take(1000, pin=True)
    scratch.take(1000, pin=True)
    assert CountingScratch.allocations == [1 << 20]
    plain = CountingScratch()
    a, b = plain.take(100, pin=False), plain.take(100, pin=False)
    assert a.data_ptr() != b.data_ptr() and not plain.pinned and CountingScratch.allocations == [1 << 20]
