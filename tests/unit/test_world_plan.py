"""The coordinator's world plan against the planner every rank ran before (plan_oracle.py): the same chunks (each
box written once, by the same rank), the same bytes per rank and balance, on every layout; and every rank's
LocalCopies, staged and read back through the world's table, give each tensor back bit for bit."""
import math
import pickle

import numpy as np
import pytest

from tiered_ckpt.errors import StateError
from tiered_ckpt.save.describe import describe
from tiered_ckpt.save.plan import ALIGN, build_plan
from tiered_ckpt.save.world_plan import plan_world

from .plan_oracle import old_plan


def box(path, shape, offsets=None, sizes=None, alone=False, dtype="torch.float32", itemsize=4):
    return (path, dtype, itemsize, tuple(shape), tuple(offsets or (0,) * len(shape)), tuple(sizes or shape), alone)


def dim0_shards(path, shape, shards, shard, alone=True):
    """torch.chunk's split along dim 0 (FSDP2's): empty shards at the end."""
    step = -(-shape[0] // shards)
    start = min(shard * step, shape[0])
    return box(path, shape, (start, *(0,) * (len(shape) - 1)), (min(step, shape[0] - start), *shape[1:]), alone)


def ddp(world):
    state = [box(f"t{i}", (n, 3)) for i, n in enumerate([3000, 1200, 500, 500, 200, 70, 1])] + [box("step", ())]
    return [state] * world


def fsdp(world, alone=True):
    return [[dim0_shards(f"w{i}", (rows, 4), world, r, alone) for i, rows in enumerate([7, 64, 130, 3, 1000])]
            for r in range(world)]


def hsdp(world, replicas=2):
    replicas = replicas if world % replicas == 0 else 1
    shards = world // replicas
    return [[dim0_shards(f"w{i}", (rows, 4), shards, r % shards, alone=False)
             for i, rows in enumerate([7, 64, 130, 3, 1000, 4096])] for r in range(world)]


def mixed(world):
    def rank_state(r):
        stage = [box(f"stage{r % 2}.w{i}", (1000 + 100 * i, 8)) for i in range(5)]
        return stage + [dim0_shards("emb", (61, 8), world, r), box("step", (), dtype="torch.int64", itemsize=8)]
    return [rank_state(r) for r in range(world)]


def per_rank(world):
    return [[box(f"t{i}", (100 * (i + 1),)) for i in range(4)] + [box(f"rng@rank{r}", (16,), alone=r % 2 == 0)]
            + [dim0_shards("w", (9, 2), world, r)] for r in range(world)]


def empty_tensors(world):
    return [[box("none", (0, 4)), dim0_shards("nothing", (0, 3), world, r), box("x", (5,)),
             dim0_shards("few", (2, 3), world, r)] for r in range(world)]


LAYOUTS = {"ddp": ddp, "fsdp": fsdp, "fsdp_unflagged": lambda w: fsdp(w, alone=False), "hsdp": hsdp, "mixed": mixed,
           "per_rank": per_rank, "empty": empty_tensors}


def written(plan):
    """Every chunk that holds bytes (and the one of a tensor without elements): (path, offsets, sizes, rank)."""
    return sorted((t.path, c.offsets, c.sizes, c.rank, c.nbytes) for t in plan.tensors for c in t.chunks
                  if c.nbytes or math.prod(t.shape) == 0)


def old_written(everyone):
    chunks, _, _ = old_plan([[b[:6] for b in boxes] for boxes in everyone])
    shapes = {b[0]: b[3] for boxes in everyone for b in boxes}
    return sorted((path, o, s, r, n) for path, cs in chunks.items() for o, s, r, _, n in cs
                  if n or math.prod(shapes[path]) == 0)


def bytes_per_rank(rows, world):
    out = [0] * world
    for *_, r, n in rows:
        out[r] += n
    return out


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
@pytest.mark.parametrize("world", [1, 2, 4, 8])
def test_the_world_plan_writes_the_chunks_the_old_planner_wrote(layout, world):
    everyone = LAYOUTS[layout](world)
    plan = build_plan(("k",), everyone, 0, 1 << 20)
    new, old = written(plan), old_written(everyone)
    if layout == "empty":  # the old plan wrote an empty shard's box too, and on whichever rank it liked
        new, old = [c for c in new if c[4]], [c for c in old if c[4]]
    assert new == old
    assert bytes_per_rank(new, world) == bytes_per_rank(old, world)


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
@pytest.mark.parametrize("world", [1, 3, 8])
def test_every_layout_staged_and_read_back_through_the_table_is_bit_exact(layout, world):
    everyone = LAYOUTS[layout](world)
    rng = np.random.default_rng(0)
    shapes = {b[0]: b[3] for boxes in everyone for b in boxes}
    types = {b[0]: np.float32 if b[2] == 4 else np.int64 for boxes in everyone for b in boxes}
    values = {p: rng.integers(0, 1 << 20, size=s).astype(types[p]) for p, s in shapes.items()}
    plans = [build_plan(("k",), everyone, r, 1 << 20) for r in range(world)]
    streams = []
    for r, plan in enumerate(plans):  # the staging copy: each box's rows into the rank's buffer at its offset
        assert plan.nbytes == plans[0].rank_nbytes[r]
        buf = bytearray(plan.nbytes)
        ends = []
        for copy in plan.local:
            path, _, _, _, offsets, sizes, *_ = everyone[r][copy.index]
            local = np.asarray(values[path])[tuple(slice(o, o + s) for o, s in zip(offsets, sizes))]
            if copy.dim0 is not None:
                local = local[copy.dim0[0]:copy.dim0[0] + copy.dim0[1]]
            data = np.ascontiguousarray(local).tobytes()
            assert len(data) == copy.nbytes and copy.offset % ALIGN == 0 and local.shape == copy.shape
            buf[copy.offset:copy.offset + copy.nbytes] = data
            ends.append((copy.offset, copy.offset + copy.nbytes))
        ends.sort()
        assert all(a[1] <= b[0] for a, b in zip(ends, ends[1:]))  # no two boxes overlap in the stream
        streams.append(bytes(buf))
    for t in plans[0].tensors:  # the load: every chunk from its rank's stream into the global tensor
        out = np.full(t.shape, -1, dtype=types[t.path])
        for c in t.chunks:
            piece = np.frombuffer(streams[c.rank][c.byte_offset:c.byte_offset + c.nbytes], dtype=types[t.path])
            out[tuple(slice(o, o + s) for o, s in zip(c.offsets, c.sizes))] = piece.reshape(c.sizes)
        assert np.array_equal(out, values[t.path]), t.path


def test_the_fsdp_boxes_a_rank_holds_alone_are_placed_as_the_compared_ones_are():
    flagged, unflagged = build_plan(("k",), fsdp(16), 3, 1 << 20), build_plan(("k",), fsdp(16, False), 3, 1 << 20)
    assert flagged.tensors == unflagged.tensors and flagged.local == unflagged.local


def test_boxes_claimed_alone_by_two_ranks_are_still_written_once():
    # two pipeline stages whose (wrongly) same-named shards cover the same rows, each claiming them its own
    # (and a tensor sharded over all four, so that no two ranks sent equal boxes)
    everyone = [[dim0_shards("w", (8, 2), 2, r % 2), dim0_shards("v", (8, 2), 4, r)] for r in range(4)]
    plan = build_plan(("k",), everyone, 0, 1 << 20)
    w = plan.tensors[plan.tensors.index_by_path()["w"]]
    assert sum(c.sizes[0] for c in w.chunks) == 8
    assert written(plan) == old_written(everyone)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("alone", [False, True])
def test_boxes_that_overlap_without_being_equal_are_each_written_as_before(alone):
    # rank 0 holds rows 0-2 of w, rank 1 rows 1-3: the planner looped for ever on them (nothing to take back)
    everyone = [[box("w", (4,), (0,), (3,), alone)], [box("w", (4,), (1,), (3,), alone)]]
    plan = build_plan(("k",), everyone, 0, 1 << 20)
    assert written(plan) == old_written(everyone)


def test_replicated_state_stays_level_and_in_few_pieces_at_a_large_world():
    world = 512
    everyone = [[box(f"t{i}", (4096 + 512 * (i % 7), 64)) for i in range(40)]] * world
    plan = build_plan(("k",), everyone, 0, 1 << 20)
    assert len(plan.tensors.rank) <= 40 + world - 1
    assert max(plan.rank_nbytes) / (sum(plan.rank_nbytes) / world) < 1.01


def test_hsdp_replicas_are_written_once_and_level():
    everyone = hsdp(64, replicas=4)
    plan = build_plan(("k",), everyone, 0, 1 << 20)
    assert written(plan) == old_written(everyone)
    loads = plan.rank_nbytes
    assert max(loads) / (sum(loads) / 64) < 1.05


@pytest.mark.parametrize("layout", ["fsdp", "ddp"])
def test_ranks_send_rank_0_neither_its_structure_nor_its_boxes_again(layout):
    everyone = LAYOUTS[layout](4)
    described = [describe(b, r) for r, b in enumerate(everyone)]
    first = described[0].digest
    payloads = [d.payload_for(first if r else None) for r, d in enumerate(described)]
    assert payloads[0][1] is not None and payloads[0][2] is not None
    assert all(p[1] is None for p in payloads[1:])  # the structure: every layout's ranks share rank 0's
    assert all((p[2] is None) == (layout == "ddp") for p in payloads[1:])  # the boxes: DDP's are rank 0's too
    assert len(pickle.dumps(payloads[1])) < len(pickle.dumps(payloads[0])) / 2
    world = plan_world(payloads)
    assert world.tensors == build_plan(("k",), everyone, 0, 1 << 20).tensors


def test_a_tensor_that_differs_between_ranks_is_refused_naming_it_and_the_rank():
    with pytest.raises(StateError, match=r"'w'.*rank 2"):
        build_plan(("k",), [[box("w", (4,))], [box("w", (4,))], [box("w", (5,))]], 0, 1 << 20)
    with pytest.raises(StateError, match=r"'rng@rank1'.*rank 1"):
        build_plan(("k",), [[box("rng@rank1", (4,))], [box("rng@rank1", (5,))]], 0, 1 << 20)


@pytest.mark.parametrize("seed", range(8))
@pytest.mark.parametrize("short", [False, True])
def test_groups_placed_alike_once_make_the_picks_each_would_make(seed, short):
    """_spread places groups whose boxes and starting loads are alike once (HSDP: every shard's replicas): the
    ranks chosen and the loads left are those of placing every group box by box, largest first, to its
    least-loaded rank (the lowest of equals), with ties, rows alike and rows not; `short`: some groups lack a
    few boxes (HSDP's shards past the end of a short tensor), others alike but for them."""
    from tiered_ckpt.save.world_plan import _spread

    rng = np.random.default_rng(seed)
    n_groups, per, width, world = 12, 9, 3, 36
    groups = [list(range(g * width, (g + 1) * width)) for g in range(n_groups)]
    pattern = rng.integers(1, 5, per) * 64
    nbytes, grp, tid = [], [], []
    for g in range(n_groups):
        sizes = pattern if g % 3 else rng.integers(1, 5, per) * 64  # most groups alike, some not
        kept = np.arange(per)
        if short and g % 2:
            kept = np.sort(rng.choice(per, int(rng.integers(1, per)), replace=False))
        nbytes += sizes[kept].tolist()
        grp += [g] * len(kept)
        tid += kept.tolist()
    nbytes, grp, tid = (np.asarray(v, dtype=np.int64) for v in (nbytes, grp, tid))
    load = np.zeros(world, np.int64)
    load[rng.integers(0, world, 4)] = 64  # a few ranks start loaded: their groups are not alike
    expected_load, expected = load.copy(), np.empty(len(grp), np.int64)
    paths = [f"t{i}" for i in range(per)]
    for g in range(n_groups):  # box by box, as a heap would
        mine = np.flatnonzero(grp == g)
        order = sorted(mine.tolist(), key=lambda i: (-nbytes[i], paths[tid[i]]))
        for i in order:
            rank = min(groups[g], key=lambda r: (expected_load[r], r))
            expected[i] = rank
            expected_load[rank] += nbytes[i]
    chosen = _spread(np.ones(len(grp), bool), grp, nbytes, tid, groups, load, paths)
    assert chosen.tolist() == expected.tolist() and load.tolist() == expected_load.tolist()
