"""The save planner (build_plan) and the read planner (plan_reads) on their own, without an engine."""
import pytest
import torch

from tiered_ckpt.load import reads as loading
from tiered_ckpt.errors import StateError
from tiered_ckpt.layout import part_count
from tiered_ckpt.load.reads import plan_reads
from tiered_ckpt.manifest import Manifest, RankMeta
from tiered_ckpt.save.plan import ALIGN, build_plan
from tiered_ckpt.buffers import tensor_bytes


def descriptor(path, shape, offsets=None, sizes=None, dtype="torch.float32", itemsize=4):
    return (path, dtype, itemsize, tuple(shape), tuple(offsets or (0,) * len(shape)), tuple(sizes or shape))


def plans(everyone, part_size=1 << 20):
    return [build_plan(("k",), everyone, r, part_size) for r in range(len(everyone))]


def test_replicated_tensors_are_written_once_and_spread_evenly():
    state = [descriptor(f"t{i}", (n,)) for i, n in enumerate([300_000, 120_000, 50_000, 50_000, 20_000, 7_000, 10])]
    everyone = [state] * 4
    ps = plans(everyone)
    assert all(p.rank_nbytes == ps[0].rank_nbytes and p.tensors == ps[0].tensors for p in ps)  # every rank agrees
    total = sum(4 * n for n in [300_000, 120_000, 50_000, 50_000, 20_000, 7_000, 10])
    written = sum(c.nbytes for t in ps[0].tensors for c in t.chunks)
    assert written == total  # each byte once, not once per replica
    assert max(ps[0].rank_nbytes) / (sum(ps[0].rank_nbytes) / 4) < 1.01
    for t in ps[0].tensors:  # the chunks of each tensor tile it exactly (large ones are split along dim 0)
        assert sum(c.sizes[0] for c in t.chunks) == t.shape[0]
    t0 = next(t for t in ps[0].tensors if t.path == "t0")
    assert len(t0.chunks) > 1 and len({c.rank for c in t0.chunks}) == len(t0.chunks)  # cut, one piece a holder


def tiles_once(plan):
    """Every tensor's chunks cover it exactly once (dim-0 cuts of whole rows)."""
    for t in plan.tensors:
        if not t.shape:
            assert len(t.chunks) == 1
            continue
        rows = sorted((c.offsets[0], c.offsets[0] + c.sizes[0]) for c in t.chunks if c.sizes[0])
        assert [a for a, _ in rows] == [0] + [b for _, b in rows[:-1]] and rows[-1][1] == t.shape[0], t.path


def test_replicated_tensors_at_a_large_world_are_cut_into_few_pieces_and_stay_level():
    # 40 replicated tensors on 512 ranks: a cut per holder would make 40 x 512 chunks (and scan 512 holders for
    # each); cutting the tensors, end to end, into one stretch a rank makes at most 40 + 511
    world, state = 512, [descriptor(f"t{i}", (4096 + 512 * (i % 7), 64)) for i in range(40)]
    plan = build_plan(("k",), [state] * world, 0, 1 << 20)
    assert sum(len(t.chunks) for t in plan.tensors) <= 40 + world - 1
    assert max(plan.rank_nbytes) / (sum(plan.rank_nbytes) / world) < 1.01
    tiles_once(plan)
    for t in plan.tensors:
        assert len({c.rank for c in t.chunks}) == len(t.chunks)


def test_plans_of_mixed_layouts_agree_on_every_rank_whether_or_not_ranks_share_objects():
    # two pipeline stages interleaved over 8 ranks (each stage's tensors replicated over its 4 ranks), a
    # tensor sharded over all 8, a small tensor every rank has; each rank's list as its own unpickled copy
    import pickle
    def rank_state(r):
        stage = [descriptor(f"stage{r % 2}.w{i}", (1000 + 100 * i, 8)) for i in range(5)]
        shard = descriptor("emb", (64, 8), (8 * r, 0), (8, 8))
        return stage + [shard, descriptor("step", (), dtype="torch.int64", itemsize=8)]
    shared = [rank_state(r) for r in range(8)]
    copies = [pickle.loads(pickle.dumps(s)) for s in shared]
    ps = plans(copies)
    assert all(p.tensors == ps[0].tensors and p.rank_nbytes == ps[0].rank_nbytes for p in ps)
    other = plans(shared)  # objects shared between ranks
    assert other[3].tensors == ps[3].tensors and other[3].local == ps[3].local
    tiles_once(ps[0])
    for t in ps[0].tensors:  # a stage's tensors are written by its own ranks, the shards by their owners
        stage = {r for r in range(8) if r % 2 == int(t.path[5])} if t.path.startswith("stage") else set(range(8))
        assert {c.rank for c in t.chunks} <= stage
    emb = next(t for t in ps[0].tensors if t.path == "emb")
    assert sorted((c.offsets[0], c.rank) for c in emb.chunks) == [(8 * r, r) for r in range(8)]
    assert max(ps[0].rank_nbytes) / (sum(ps[0].rank_nbytes) / 8) < 1.01
    for r, p in enumerate(ps):  # each rank stages its pieces from its own tensors, at their rows
        for copy in p.local:
            path, _, _, shape, _, sizes = copies[r][copy.index]
            assert copy.shape == (copy.dim0[1], *sizes[1:]) if copy.dim0 else copy.shape == sizes


def test_sharded_tensors_stay_with_their_owner_and_chunks_are_aligned():
    everyone = [[descriptor("w", (10, 3), (0, 0), (5, 3)), descriptor("b", (7,), dtype="torch.int8", itemsize=1)],
                [descriptor("w", (10, 3), (5, 0), (5, 3))]]
    ps = plans(everyone)
    w = next(t for t in ps[0].tensors if t.path == "w")
    assert sorted((c.rank, c.offsets) for c in w.chunks) == [(0, (0, 0)), (1, (5, 0))]
    for p in ps:
        assert all(c.offset % ALIGN == 0 for c in p.local)
        assert sum(c.nbytes for c in p.local) <= p.nbytes
    assert [c.index for c in ps[1].local] == [0]  # rank 1 holds only its shard of w


def test_parts_cut_the_stream_at_part_size():
    ps = plans([[descriptor("a", (1000,)), descriptor("b", (3000,))]], part_size=4096)
    p = ps[0]
    assert p.num_parts == part_count(p.nbytes, 4096) == 4
    assert [p.part_range(i) for i in range(p.num_parts)] == [(0, 4096), (4096, 8192), (8192, 12288), (12288, p.nbytes)]


def test_a_tensor_that_differs_between_ranks_is_refused_naming_it():
    with pytest.raises(StateError, match=r"'w'.*rank 1"):
        plans([[descriptor("w", (4,))], [descriptor("w", (5,))]])


def manifest_for(plan, job="j", step=1):
    return Manifest(job=job, step=step, world_size=plan.world_size, part_size=plan.part_size, checksum="crc32c",
                    tensors=plan.tensors, ranks=tuple(RankMeta(r, n, (0,) * part_count(n, plan.part_size))
                                                        for r, n in enumerate(plan.rank_nbytes)),
                    skeleton=b"", created=0.0)


def test_same_layout_reads_go_straight_into_contiguous_targets():
    plan = plans([[descriptor("w", (8, 4))]])[0]
    target = torch.zeros(8, 4)
    reads = plan_reads(manifest_for(plan), {0: ("w", target)})
    [(key, sink)] = reads.dests.items()
    assert key == (0, plan.tensors[0].chunks[0].byte_offset)
    assert sink is target  # the target is its own sink: no byte view is kept for it (buffers.Sinks)
    [part] = loading.parts_to_read(manifest_for(plan), reads).values()
    assert part.views.nbytes == target.numel() * 4 and part.targets == ("w",)
    source = torch.arange(32, dtype=torch.float32)
    part.views.scatter([tensor_bytes(source)])  # what a verified read does
    assert torch.equal(target.flatten(), source)
    assert reads.copies == []


def test_resharded_rows_are_read_straight_into_the_target(monkeypatch):
    """Saved as two row shards of 5; loaded by a rank holding rows 3..8 (a different sharding): the rows it
    holds of each saved shard are one contiguous stretch of that shard, read straight into the target (no
    scratch, no copy, and no byte of the other rows). The box a DTensor would report is given directly
    (tests/multirank runs real DTensors)."""
    ps = plans([[descriptor("w", (10, 2), (0, 0), (5, 2))], [descriptor("w", (10, 2), (5, 0), (5, 2))]])
    manifest = manifest_for(ps[0])
    full = torch.arange(20, dtype=torch.float32).view(10, 2)
    target = torch.zeros(5, 2)
    monkeypatch.setattr(loading, "local_box", lambda t: ((10, 2), (3, 0), (5, 2)))
    reads = plan_reads(manifest, {0: ("w", target)})
    assert not reads.dests and not reads.copies and len(reads.subs) == 2
    for chunk in manifest.tensors[0].chunks:  # fill the pieces as the tiers would: the bytes at their starts
        rows = tensor_bytes(full[chunk.offsets[0] : chunk.offsets[0] + chunk.sizes[0]].contiguous())
        for start, view, _ in reads.subs[(chunk.rank, chunk.byte_offset)]:
            view[:] = rows[start : start + len(view)]
    assert sum(len(v) for pieces in reads.subs.values() for _, v, _ in pieces) == target.numel() * 4
    assert torch.equal(target, full[3:8])


def test_resharded_columns_copy_only_the_overlap_through_scratch(monkeypatch):
    """Saved as two row shards; loaded by a rank holding column 0 of every row: not a contiguous stretch of a
    saved shard, so each shard is read into scratch and its overlap copied."""
    ps = plans([[descriptor("w", (10, 2), (0, 0), (5, 2))], [descriptor("w", (10, 2), (5, 0), (5, 2))]])
    manifest = manifest_for(ps[0])
    full = torch.arange(20, dtype=torch.float32).view(10, 2)
    target = torch.zeros(10, 1)
    monkeypatch.setattr(loading, "local_box", lambda t: ((10, 2), (0, 0), (10, 1)))
    reads = plan_reads(manifest, {0: ("w", target)})
    assert len(reads.dests) == 2 and len(reads.copies) == 2 and not reads.subs
    for chunk in manifest.tensors[0].chunks:
        rows = full[chunk.offsets[0] : chunk.offsets[0] + chunk.sizes[0]].contiguous()
        reads.dests[(chunk.rank, chunk.byte_offset)][:] = tensor_bytes(rows)
    reads.finish()
    assert torch.equal(target, full[:, :1])




def test_rank_0_answers_every_rank_even_when_its_replica_check_fails(monkeypatch):
    """Whatever stops rank 0's planning becomes an answer in the scatter (else every other rank waits there until
    the group's timeout): here the fingerprint comparison itself raises."""
    import tiered_ckpt.save.plan as plan_module

    def broken(_):
        raise ValueError("unreadable fingerprints")
    monkeypatch.setattr(plan_module, "_warn_if_replicas_differ", broken)
    shares, world, error = plan_module._plan_world([(None, None, None, None, {})] * 3)
    assert world is None and isinstance(error, ValueError)
    assert shares == [("error", "ValueError", "unreadable fingerprints")] * 3
