"""The relay of a load's small payloads (load/relay.py): which plan entries go by the tree, and the tree's
layout: every subtree one stretch of the buffer, and a bounded number of messages a rank at any world."""
from __future__ import annotations

import torch

from tiered_ckpt.load import relay
from tiered_ckpt.load.relay import SMALL_ENTRY, SMALL_TOTAL, Tree, _extract, merged, small_entries


def test_merged_joins_overlapping_and_touching_spans():
    assert merged([(10, 4), (0, 2), (2, 3), (12, 6), (30, 1)]) == ((0, 5), (10, 8), (30, 1))


def test_small_entries_take_the_union_of_what_the_members_want():
    plan = [((0, 0), (0, 1, 2), 0), ((1, 0), (0, 1), 1), ((2, 0), (1, 2), 2)]
    lengths = {(0, 0): 1000, (1, 0): 2 * SMALL_ENTRY, (2, 0): 100}
    wants = [{(1, 0): ((8, 4),)}, {(0, 0): ((0, 4),)}, {(0, 0): ((2, 4), (100, 8))}]
    chosen = small_entries(plan, lengths, wants)
    # entry 0: ranks 1 and 2 want some of it; entry 1: rank 0 wants 4 bytes of a large part; entry 2: rank 1
    # wants the whole (small) part
    assert chosen == {0: ((0, 6), (100, 8)), 1: ((8, 4),), 2: ((0, 100),)}


def test_large_entries_and_those_past_the_total_are_left_to_direct_sends():
    n = SMALL_TOTAL // SMALL_ENTRY + 4
    plan = [((r, 0), (0, 1), 1) for r in range(n)] + [((n, 0), (0, 1), 1)]
    lengths = {(r, 0): SMALL_ENTRY for r in range(n)} | {(n, 0): SMALL_ENTRY + 1}
    chosen = small_entries(plan, lengths, [{}, {}])
    assert n not in chosen  # over SMALL_ENTRY
    assert sum(1 + sum(s for _, s in u) for u in chosen.values()) <= SMALL_TOTAL
    assert sorted(chosen) == list(range(len(chosen))) and len(chosen) < n  # the smallest first, in plan order


def test_each_subtree_is_one_stretch_and_each_entry_lies_in_its_readers():
    world = 11
    plan = [((r, 0), tuple(range(world)), r) for r in range(world) if r % 3]  # some ranks read nothing
    chosen = {i: ((0, 4 + i),) for i in range(len(plan))}
    tree = Tree.of(plan, chosen, world)
    assert tree.total == sum(5 + i for i in range(len(plan)))
    for r in range(world):
        children = Tree.children(r, world)
        own = sum(5 + i for i, (_, _, reader) in enumerate(plan) if reader == r)
        assert tree.size[r] == own + sum(tree.size[c] for c in children)
        at = tree.start[r] + own
        for c in children:
            assert tree.start[c] == at
            at += tree.size[c]
    for i, (_, _, reader) in enumerate(plan):
        assert tree.start[reader] <= tree.offsets[i] < tree.start[reader] + tree.size[reader]


def test_ranks_that_hold_and_want_nothing_are_left_out():
    world = 8
    plan = [((7, 0), (6, 7), 7)]  # rank 7 reads, rank 6 wants: the path 7 -> 3 -> 1 -> 0 -> 2 -> 6
    tree = Tree.of(plan, {0: ((0, 4),)}, world)
    on_path = {r for r in range(world) if tree.size[r] or tree.wants[r]}
    assert on_path == {0, 1, 2, 3, 6, 7}


def test_messages_a_rank_does_not_grow_with_the_world():
    """Every rank reads a part holding a step that other ranks want (FSDP2's AdamW steps: every other rank; here
    three, to keep the plan small at 10,240): each rank posts at most 3 sends and 3 receives, at 16 ranks as at
    10,240."""
    for world in (16, 10_240):
        plan = [((r, 0), tuple(sorted({r, (r + 1) % world, (r + world // 2) % world})), r) for r in range(world)]
        tree = Tree.of(plan, {i: ((0, 4),) for i in range(world)}, world)
        for r in (0, 1, world // 2, world - 1):
            children = Tree.children(r, world)
            sends = (r > 0 and tree.size[r] > 0) + sum(tree.wants[c] for c in children)
            receives = sum(tree.size[c] > 0 for c in children) + (r > 0 and tree.wants[r])
            assert sends <= 3 and receives <= 3, (world, r)


def test_extract_picks_the_wanted_spans_out_of_the_union():
    blob = torch.arange(20, dtype=torch.uint8)
    # the entry at 2 holds the part's spans (0, 6) and (100, 8): bytes 2..7 and 8..15 of the blob
    assert _extract(blob, 2, ((0, 6), (100, 8)), ((2, 4), (104, 2))).tolist() == [4, 5, 6, 7, 12, 13]


class _Wire:
    """Point-to-point messages between ranks running in threads of this process: what the relay posts on the
    engine's gloo group, matched by (source, destination, tag) as gloo matches them."""

    def __init__(self):
        import queue
        import threading
        self.lock, self.boxes, self.queue = threading.Lock(), {}, queue

    def box(self, key):
        with self.lock:
            return self.boxes.setdefault(key, self.queue.Queue())


class _Work:
    def __init__(self, wait):
        self.wait = wait


class _Ranks:
    """The Coordinator's point-to-point surface for one rank (post_send, post_recv) over a _Wire."""

    def __init__(self, wire, rank, world):
        self.wire, self.rank, self.world_size, self.collectives = wire, rank, world, 0

    def post_send(self, tensor, dst, tag):
        self.wire.box((self.rank, dst, tag)).put(tensor.clone())
        return _Work(lambda: None)

    def post_recv(self, tensor, src, tag):
        def wait():
            tensor.copy_(self.wire.box((src, self.rank, tag)).get(timeout=20))
        return _Work(wait)


def test_a_reader_whose_own_copy_fails_still_relays_the_entry_to_the_ranks_that_want_it():
    """Rank 0 reads a small part both ranks want; writing it into rank 0's own tensors fails. Rank 0 reports that
    error, and rank 1 still gets the part (before: rank 0 raised before sending, and rank 1 waited for its
    message until the group's timeout)."""
    import asyncio
    import threading

    import torch

    from tiered_ckpt.storage.verified_read import ReadLog

    key, data = (0, 0), torch.arange(16, dtype=torch.uint8)
    plan, lengths = [(key, (0, 1), 0)], {key: 16}
    chosen = relay.small_entries(plan, lengths, [{}, {}])
    wire, outcome, target = _Wire(), {}, torch.zeros(16, dtype=torch.uint8)

    class Part:
        def __init__(self, views):
            self.views, self.targets, self.spans = views, ("w",), None

    class IO:
        def __init__(self, broken):
            self.broken = broken

        async def run_blocking(self, fn, *args):
            if self.broken:
                raise OSError("rank 0's own tensors could not be written")
            return fn(*args)

    def rank(r):
        async def run():
            loop = asyncio.get_running_loop()
            prefetch, buffers = {}, {}
            if r == 0:
                prefetch[key] = loop.create_future()
                prefetch[key].set_result("memory")
                buffers[key] = data.clone()
            parts = {key: Part([memoryview(target.numpy())] if r == 1 else [memoryview(bytearray(16))])}
            return await relay.relay_small(_Ranks(wire, r, 2), plan, chosen, prefetch, buffers, parts, lengths,
                                           IO(broken=r == 0), ReadLog(), tag=7)
        try:
            outcome[r] = asyncio.run(run())
        except BaseException as e:  # (a receive that never came: queue.Empty after 20 s)
            outcome[r] = e

    threads = [threading.Thread(target=rank, args=(r,)) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert [type(e).__name__ for e in outcome[0]] == ["OSError"]
    assert outcome[1] == [] and torch.equal(target, data)
