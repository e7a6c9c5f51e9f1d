"""The manifest's and the plan's tensors as columns (manifest/table.py, save/plan.LocalCopies): the same
TensorMeta and LocalCopy values as before, coded to the same wire columns, checked when decoded, and a few
objects for Python's garbage collector instead of several per tensor."""
import gc

import msgpack
import pytest
import torch

from tiered_ckpt.checksum import seal
from tiered_ckpt.errors import IntegrityError
from tiered_ckpt.manifest import ChunkMeta, Manifest, RankMeta, TensorMeta
from tiered_ckpt.manifest.table import TensorTable
from tiered_ckpt.save.plan import LocalCopy, build_plan

METAS = [TensorMeta("a", "torch.float32", (4, 6), (ChunkMeta((0, 0), (2, 6), 0, 0, 48), ChunkMeta((2, 0), (2, 6), 1, 64, 48))),
         TensorMeta("step", "torch.int64", (), (ChunkMeta((), (), 1, 0, 8),)),
         TensorMeta("empty", "torch.bfloat16", (0, 3), (ChunkMeta((0, 0), (0, 3), 0, 64, 0),)),
         TensorMeta("b", "torch.float32", (5,), ())]


def manifest(tensors, ranks=(112, 128)) -> Manifest:
    return Manifest("job", 7, len(ranks), 1 << 20, "crc32c", tensors,
                    tuple(RankMeta(r, n, (0,)) for r, n in enumerate(ranks)), b"", 0.0)


def test_a_table_gives_back_the_tensors_it_was_made_of():
    table = TensorTable.from_metas(METAS)
    assert list(table) == METAS and len(table) == 4
    assert [table[i] for i in range(4)] == METAS and table[-1] == METAS[-1] and table[1:3] == METAS[1:3]
    with pytest.raises(IndexError):
        table[4]
    assert table == TensorTable.from_columns(table.columns())
    assert table != TensorTable.from_metas(METAS[:3])
    assert table.index_by_path() == {"a": 0, "step": 1, "empty": 2, "b": 3}
    assert table.chunk_spans(0) == [(0, 48)] and table.chunk_spans(1) == [(0, 8), (64, 48)]  # empty chunks left out


def test_a_manifest_round_trips_through_its_bytes_as_columns():
    m = manifest(METAS)
    back = Manifest.from_bytes(m.to_bytes())
    assert list(back.tensors) == METAS and back.tensors == m.tensors


@pytest.mark.parametrize("damage, says", [
    (lambda cols: cols["rank"].__setitem__(1, bytes([0, 5, 1, 0])), "rank is out of range"),
    (lambda cols: cols["byte_offset"].__setitem__(1, bytes([0, 100, 0, 64])), "a chunk of 'a'"),
    (lambda cols: cols["offsets"]["len"].__setitem__(1, bytes([2, 1, 0, 2])), "dims"),
    (lambda cols: cols["nchunks"].__setitem__(1, bytes([2, 1, 1, 1])), "do not add up"),
    (lambda cols: cols["path"].__setitem__(1, "a"), "listed twice"),
    (lambda cols: cols["dtype"].__setitem__(1, bytes([0, 9, 2, 0])), "dtype index"),
    # a byte range whose end overflows 64 bits, and a value above 2**63 in a shape: refused, not wrapped
    (lambda cols: (cols["byte_offset"].__setitem__(slice(None), [8, (2 ** 62).to_bytes(8, "little") * 4]),
                   cols["nbytes"].__setitem__(slice(None), [8, (2 ** 62).to_bytes(8, "little") * 4])), "a chunk of"),
    (lambda cols: cols["shape"]["flat"].__setitem__(slice(None), [8, (2 ** 64 - 1).to_bytes(8, "little") * 5]),
     "out of range"),
])
def test_a_sealed_manifest_with_inconsistent_columns_is_refused_naming_the_record(damage, says):
    body = msgpack.unpackb(_body(manifest(METAS)), strict_map_key=False)
    damage(body["tensors"])
    with pytest.raises(IntegrityError, match=f"step7.manifest is not a valid manifest.*{says}"):
        Manifest.from_bytes(seal(msgpack.packb(body)), source="step7.manifest")


def _body(m: Manifest) -> bytes:
    from tiered_ckpt.checksum import unseal
    return unseal(m.to_bytes(), "test")


def _tracked_growth(make):
    """(result, tracked objects it added) with collections off."""
    gc.collect()
    gc.disable()
    try:
        before = len(gc.get_objects())
        result = make()
        return result, len(gc.get_objects()) - before
    finally:
        gc.enable()


N = 5000


def test_a_decoded_manifest_holds_a_few_objects_not_several_per_tensor():
    big = manifest([TensorMeta(f"layer{i}.w", "torch.float32", (16,), (ChunkMeta((0,), (16,), 0, 64 * i, 64),))
                    for i in range(N)], ranks=(64 * N,))
    data = big.to_bytes()
    decoded, grown = _tracked_growth(lambda: Manifest.from_bytes(data))
    assert len(decoded.tensors) == N and decoded.tensors[N - 1].chunks[0].byte_offset == 64 * (N - 1)
    assert grown < 50, f"a decoded manifest of {N} tensors keeps {grown} tracked objects"


def test_a_plan_holds_a_few_objects_not_several_per_tensor():
    boxes = [(f"layer{i}.w", "torch.float32", 4, (16,), (0,), (16,)) for i in range(N)]
    plan, grown = _tracked_growth(lambda: build_plan(("k",), [boxes], 0, 1 << 20))
    assert plan.local[3] == LocalCopy(plan.local.index[3], None, 3 * 64, 64, (16,), torch.float32)
    assert list(plan.local)[:2] == plan.local[:2] and plan.local.in_order
    assert grown < 50, f"a plan of {N} tensors keeps {grown} tracked objects"


def test_a_tensors_bytes_come_from_the_columns():
    table = TensorTable.from_metas(METAS)
    assert [table.nbytes_of(i) for i in range(4)] == [4 * 6 * 4, 8, 0, 5 * 4]


def test_a_decoded_manifest_keeps_its_chunk_columns_as_stored_and_owns_what_it_hands_out():
    """The chunk columns of a large manifest are read-only views of its bytes (no widened copy), the decoded
    tensors are the saved ones, and nothing the manifest hands out (metadata, skeletons) is a view of a buffer
    its caller may reuse."""
    n = 20_000  # (a column of 2 values a chunk, 2 bytes each, longer than pieces.VIEW)
    big = manifest([TensorMeta(f"layer{i}.w", "torch.float32", (16, 70_000),
                               (ChunkMeta((0, 65_000 + i % 500), (16, 10), i % 3, 640 * i, 640),)) for i in range(n)],
                   ranks=(640 * n, 640 * n, 640 * n))
    big = Manifest(**{**big.__dict__, "metadata": {"blob": b"m" * 100_000}, "skeleton": b"s" * 100_000})
    buffer = bytearray(big.to_bytes())
    decoded = Manifest.from_bytes(buffer)
    table = decoded.tensors
    assert table.offsets.dtype.itemsize == 2 and table.rank.dtype.itemsize == 1 and not table.offsets.flags.writeable
    assert isinstance(table.offsets.base, memoryview)  # (as stored in the record's bytes, not a copy)
    buffer[:] = bytes(len(buffer))  # the caller reuses its buffer
    assert table == big.tensors and list(table)[n - 1] == list(big.tensors)[n - 1]
    assert type(decoded.metadata["blob"]) is bytes and decoded.metadata["blob"] == b"m" * 100_000
    assert type(decoded.skeleton) is bytes and decoded.skeleton == b"s" * 100_000
