"""Nothing per tensor on the event loop: no Python function runs once per tensor on the loop's thread during a
save or a load, what a load made per tensor is freed in a worker thread, and the memory tier's staging buffers
are unmapped off the loop at close. Counted by thread identity, not timed (the stalls themselves are measured by
`python -m tiered_ckpt.bench.stalls`: docs/benchmarks.md, *Event-loop stalls against the tensor count*)."""
import collections
import gc
import pickle
import sys
import threading
import weakref

import pytest
import torch

import tiered_ckpt as tc
from tiered_ckpt.manifest import pieces
from tiered_ckpt.buffers import Sinks
from tiered_ckpt.manifest.table import TensorTable
from tiered_ckpt import release
from tiered_ckpt.release import BATCH, empty, release_all
from tiered_ckpt.save import mapped
from tiered_ckpt.save.describe import describe
from tiered_ckpt.save.plan import structure_key
from tiered_ckpt.save.world_plan import plan_world
from tiered_ckpt.storage.verified_read import Overwritten, ReadLog

COUNT = 3000  # tensors: well above any per-part or per-save count of calls, well below a slow test


def _state(count: int = COUNT) -> dict[str, torch.Tensor]:
    return {f"layer{i}.scale": torch.full((16,), float(i)) for i in range(count)}


class CallsOnThisThread:
    """Python calls on the current thread (the loop's, in an async test) per function of the package, from
    sys.setprofile: a generator resumed once per tensor counts once per tensor."""

    def __init__(self) -> None:
        self.calls: collections.Counter[str] = collections.Counter()

    def _profile(self, frame, event, arg) -> None:
        if event == "call" and "tiered_ckpt" in frame.f_code.co_filename:
            self.calls[f"{frame.f_code.co_filename.split('tiered_ckpt/')[-1]}:{frame.f_code.co_name}"] += 1

    def __enter__(self) -> "CallsOnThisThread":
        sys.setprofile(self._profile)
        return self

    def __exit__(self, *exc) -> None:
        sys.setprofile(None)

    def per_tensor(self) -> dict[str, int]:
        return {name: n for name, n in self.calls.items() if n >= COUNT // 2}


async def test_no_function_runs_once_per_tensor_on_the_loop_during_saves_and_a_load(make_config):
    state = _state()
    target = {k: torch.zeros(16) for k in state}
    async with tc.Engine(make_config(part_size="64KiB")) as engine:  # 3 parts of ~1,000 tensors
        with CallsOnThisThread() as loop:
            await (await engine.save(1, state)).wait()
            await (await engine.save(2, state)).wait()
            await engine.load(target)
    assert loop.calls, "the profile saw no call of the package on the loop thread"
    assert loop.per_tensor() == {}
    assert all(torch.equal(target[k], v) for k, v in state.items())


async def test_a_load_frees_what_it_made_per_part_off_the_loop(make_config, monkeypatch):
    """Each part's Sinks lists every tensor in the part: the last reference goes in a worker thread."""
    freed_on: list[int] = []
    made = Sinks.__init__

    def tracked(self) -> None:
        made(self)
        weakref.finalize(self, lambda: freed_on.append(threading.get_ident()))

    monkeypatch.setattr(Sinks, "__init__", tracked)
    state = _state()
    async with tc.Engine(make_config(part_size="64KiB")) as engine:
        await (await engine.save(1, state)).wait()
        target = {k: torch.zeros(16) for k in state}
        await engine.load(target)
        gc.collect()
        assert freed_on, "no Sinks was made or freed by the load"
        assert threading.get_ident() not in freed_on


@pytest.mark.parametrize("heal", [True, False])
async def test_a_load_empties_its_manifests_paths_off_the_loop(make_config, monkeypatch, heal):
    """The manifest a load read holds one path per tensor: its last user (the heal, or else the load) empties them
    in a worker thread, so the table freed on the loop (when that coroutine ends) holds none."""
    freed: list[tuple[int, int]] = []  # (thread, paths the table still held)
    made = TensorTable.__init__

    def tracked(self, paths, *args) -> None:
        made(self, paths, *args)
        weakref.finalize(self, lambda: freed.append((threading.get_ident(), len(paths))))

    monkeypatch.setattr(TensorTable, "__init__", tracked)
    state = _state()
    async with tc.Engine(make_config(part_size="64KiB", heal=heal)) as engine:
        await (await engine.save(1, state)).wait()
        freed.clear()
        info = await engine.load({k: torch.zeros(16) for k in state})
        if info.heal is not None:
            await info.heal
        del info
        gc.collect()
        assert freed, "no manifest table the load read was freed"
        assert [n for thread, n in freed if thread == threading.get_ident()] in ([], [0] * len(freed))
        assert any(n == 0 for _, n in freed), "the load's manifest was freed holding its paths"


async def test_a_successful_load_forgets_the_overwritten_keys_off_the_loop(make_config, monkeypatch):
    """The keys the reads reached (the load's own path strings, one per tensor) are only for a failed load's
    message: once every rank succeeded they are dropped in a worker thread, not left in the returned LoadInfo
    for its caller to free on the loop."""
    released_on: list[int] = []
    real = Overwritten.release

    def release(self) -> None:
        released_on.append(threading.get_ident())
        real(self)

    monkeypatch.setattr(Overwritten, "release", release)
    state = _state()
    async with tc.Engine(make_config(part_size="64KiB")) as engine:
        await (await engine.save(1, state)).wait()
        info = await engine.load({k: torch.zeros(16) for k in state})
    assert not info.reads.overwritten
    assert released_on and threading.get_ident() not in released_on


async def test_close_unmaps_the_memory_tiers_staging_buffers_off_the_loop(make_config, monkeypatch):
    """The buffers that hold the memory tier's checkpoints (one view per tensor each) are unmapped at close, in
    a worker thread, not where their last reference is dropped (the loop)."""
    unmapped_on: list[int] = []
    real = mapped._unmap

    def unmap(*args) -> None:
        unmapped_on.append(threading.get_ident())
        real(*args)

    monkeypatch.setattr(mapped, "_unmap", unmap)
    state = _state(500)
    engine = tc.Engine(make_config(part_size="64KiB"))
    async with engine:
        for step in (1, 2, 3):
            await (await engine.save(step, state)).wait()
        assert engine.pool.retained, "no staging buffer holds a memory tier checkpoint"
    assert unmapped_on, "close unmapped none of the retained staging buffers"
    assert threading.get_ident() not in unmapped_on


def test_overwritten_keys_are_kept_per_part_and_read_as_a_set_only_when_asked():
    """A load's bookkeeping of the entries reached, on the loop after each part: no walk over the part's keys."""
    iterated: list[int] = []

    class Keys(tuple):
        def __iter__(self):
            iterated.append(threading.get_ident())
            return super().__iter__()

    log = ReadLog()
    log.overwritten.update(Keys(("a", "b")))
    log.overwritten.update(Keys(("c",)))
    log.overwritten.update(())
    assert log.overwritten and not iterated
    assert set(log.overwritten) == {"a", "b", "c"} and "b" in log.overwritten and len(log.overwritten) == 3
    assert not ReadLog().overwritten


def test_release_empties_large_containers_a_batch_at_a_time():
    """What `release_all` is given is emptied whole (lists, dicts, sets, and objects through their release())."""
    sinks = Sinks()
    for _ in range(3 * BATCH + 5):
        sinks.append(memoryview(bytearray(1)))
    listed, mapped_, kept = list(range(3 * BATCH + 7)), {i: str(i) for i in range(BATCH + 1)}, set(range(BATCH * 2))
    things = [sinks, listed, mapped_, kept]
    release_all(things)
    assert (len(sinks), sinks.nbytes, listed, mapped_, kept, things) == (0, 0, [], {}, set(), [])
    other = "left as it is"
    empty(other)


def test_a_loads_part_reads_let_their_spans_go_a_batch_at_a_time():
    """A load's part of small tensors lists the (offset, length) of every one it wants: 125k tuples a part at 1M
    tensors. Kept as a tuple, they were freed when the list of the load's parts was cleared, all eight parts'
    1M tuples in one step (82 ms the loop waited); release() empties them a batch at a time."""
    from tiered_ckpt.load.reads import Reads, part_views
    from tiered_ckpt.manifest import ChunkMeta, Manifest, RankMeta, TensorMeta
    from tiered_ckpt.storage.verified_read import PartRead

    count = 3 * BATCH + 5
    manifest = Manifest("j", 1, 1, 1 << 20, "crc32c",
                        [TensorMeta(f"t{i}", "torch.float32", (1,), (ChunkMeta((0,), (1,), 0, 64 * i, 4),))
                         for i in range(count)], (RankMeta(0, 64 * count, (0,)),), b"", 0.0)
    reads = Reads()
    for i in range(count):
        reads.dests[(0, 64 * i)] = memoryview(bytearray(4))
    views, targets, starts, wanted = part_views(manifest, 0, 0, manifest.tensors.chunk_spans(0), reads)
    part = PartRead("k", views, 64 * count, 0, targets, target_starts=starts, spans=wanted)
    assert len(part.spans) == count
    part.release()
    assert wanted == [] and part.spans is wanted  # (the same list, emptied: nothing of it left to free at once)


def test_a_loads_maps_of_every_tensor_and_chunk_grow_a_block_at_a_time(monkeypatch):
    """One dict of 1M entries grows by resizes that each hold the GIL 40-70 ms (release.py), in the thread that
    plans the load, and the loop waits as long: the load's maps per tensor (the given tensors paired with the saved
    ones, the manifest's paths) and per chunk (where each chunk's bytes go) are cut into blocks."""
    from tiered_ckpt.load.reads import plan_reads
    from tiered_ckpt.manifest import ChunkMeta, Manifest, RankMeta, TensorMeta
    from tiered_ckpt.state.match import LoadTarget

    monkeypatch.setattr(release, "INDEX_SHIFT", 6)  # 64 tensors a block
    monkeypatch.setattr(release, "OFFSET_SHIFT", 12)  # 4 KiB of a rank's stream: 64 chunks of 64 bytes
    manifest = Manifest("j", 1, 1, 1 << 20, "crc32c",
                        [TensorMeta(f"t{i}", "torch.float32", (1,), (ChunkMeta((0,), (1,), 0, 64 * i, 4),))
                         for i in range(COUNT)], (RankMeta(0, 64 * COUNT, (0,)),), b"", 0.0)
    target = LoadTarget()
    for i in range(COUNT):
        target.add(i, f"t{i}", torch.zeros(1))
    reads = plan_reads(manifest, target.tensors)
    by_path = manifest.tensors.index_by_path()
    assert by_path["t17"] == 17 and target.tensors[17] == ("t17", target.tensors[17][1]) and len(target.tensors) == COUNT
    for mapping, most in ((target.tensors, 64), (reads.dests, 64), (reads.direct, 64),
                          (by_path, 3 * COUNT // release.BLOCKS)):
        assert len(mapping) == COUNT and mapping.largest_block <= most, type(mapping)


def test_the_plans_structure_is_pickled_and_unpickled_a_piece_at_a_time(monkeypatch):
    """A worker thread holds the GIL through one C call: describe() pickles the paths, and the world plan
    unpickles them, in calls of at most PIECE entries (1M paths in one `pickle.dumps`: ~0.3 s the loop waits)."""
    monkeypatch.setattr(pieces, "PIECE", 100)
    longest: list[int] = []
    real_dumps, real_loads = pickle.dumps, pickle.loads

    def entries(value) -> None:  # what one call pickled or unpickled: the longest list in it
        if isinstance(value, (list, tuple)):
            longest.append(max([len(value), *(len(v) for v in value if isinstance(v, (list, tuple)))]))

    def dumps(value, *args, **kwargs):
        entries(value)
        return real_dumps(value, *args, **kwargs)

    def loads(data, *args, **kwargs):
        value = real_loads(data, *args, **kwargs)
        entries(value)
        return value

    monkeypatch.setattr(pickle, "dumps", dumps)
    monkeypatch.setattr(pickle, "loads", loads)
    descriptors = [(f"layer{i}.scale", "torch.float32", 4, (16,), (0,), (16,)) for i in range(COUNT)]
    described = describe(descriptors, 0)
    plan = plan_world([described.payload_for(None)])
    assert len(plan.tensors) == COUNT and list(plan.tensors.paths[:2]) == ["layer0.scale", "layer1.scale"]
    assert longest and max(longest) <= 100


def test_the_plan_key_is_hashed_and_compared_a_piece_at_a_time(monkeypatch):
    """The plan cache's key holds no tuple of more than PIECE entries (a tuple of 1M paths is hashed and compared
    in one C call each, in the lookup's thread but holding the GIL), and still tells states apart."""
    monkeypatch.setattr(pieces, "PIECE", 1000)
    state = _state()

    def key(paths=None, tensors=None):
        return structure_key(paths or [f"{p}" for p in state], tensors or list(state.values()), 1, 1 << 20)

    def longest(value) -> int:  # the longest tuple in the key (its own attributes, and the tuples in them)
        inside = gc.get_referents(value) if not isinstance(value, tuple) else value
        own = len(value) if isinstance(value, tuple) else 0
        return max([own, *(longest(v) for v in inside if isinstance(v, tuple))])

    first = key()
    assert 0 < longest(first) <= 1000
    assert first == key() and hash(first) == hash(key())
    renamed = [*state][:1500] + ["other"] + [*state][1501:]
    assert first != key(paths=renamed)
    assert first != key(tensors=[*state.values()][:2000] + [torch.zeros(16, dtype=torch.float64)]
                        + [*state.values()][2001:])


class LongestCalls:
    """The longest list or tuple given to np.asarray and the largest array turned into a list (tolist), on this
    thread: each one C call that holds the GIL for as long as it takes."""

    def __init__(self, monkeypatch) -> None:
        import numpy as np

        self.made: list[int] = [0]
        self.listed: list[int] = [0]
        real = np.asarray

        def asarray(value, *args, **kwargs):
            if isinstance(value, (list, tuple)):
                self.made.append(len(value))
            return real(value, *args, **kwargs)

        monkeypatch.setattr(np, "asarray", asarray)

    def _profile(self, frame, event, arg) -> None:
        if event == "c_call" and getattr(arg, "__name__", "") == "tolist":
            self.listed.append(getattr(getattr(arg, "__self__", None), "size", 0))

    def __enter__(self) -> "LongestCalls":
        sys.setprofile(self._profile)
        return self

    def __exit__(self, *exc) -> None:
        sys.setprofile(None)


def test_the_world_plan_and_a_ranks_share_make_no_list_or_array_of_every_tensor_in_one_call(monkeypatch):
    """The world plan's columns (and a rank's share of it, and the load's read planning) go between lists and
    arrays in calls of at most PIECE entries: one np.asarray of 1M tuples or one tolist() of 1M rows held the GIL
    50-180 ms at 300k tensors, in the planning thread, and the loop waited as long."""
    monkeypatch.setattr(pieces, "PIECE", 100)
    descriptors = [(f"layer{i}.scale", "torch.float32", 4, (16,), (0,), (16,)) for i in range(COUNT)]
    with LongestCalls(monkeypatch) as calls:
        described = describe(descriptors, 0)
        plan = plan_world([described.payload_for(None)])
        local = described.local(plan.shares[0])
        spans = plan.tensors.chunk_spans(0)
    assert len(plan.tensors) == COUNT and len(local) == COUNT and len(spans) == COUNT
    assert max(calls.made) <= 100 and max(calls.listed) <= 4 * 100, (max(calls.made), max(calls.listed))


def test_the_manifest_is_packed_a_piece_at_a_time_into_the_same_bytes(monkeypatch):
    """msgpack packs the manifest's path column (one str per tensor) in calls of at most PIECE paths (one packb of
    1M paths held the GIL ~50 ms), into the bytes one packb of the whole makes."""
    import msgpack

    from tiered_ckpt.checksum import unseal
    from tiered_ckpt.manifest import Manifest, RankMeta

    monkeypatch.setattr(pieces, "PIECE", 100)
    descriptors = [(f"layer{i}.scale", "torch.float32", 4, (16,), (0,), (16,)) for i in range(COUNT)]
    plan = plan_world([describe(descriptors, 0).payload_for(None)])
    manifest = Manifest(job="j", step=3, world_size=1, part_size=1 << 20, checksum="crc32c", tensors=plan.tensors,
                        ranks=(RankMeta(0, plan.rank_nbytes[0]),), skeleton=b"", created=1.0,
                        metadata={"lr": [0.1] * 300, "note": "x"})
    longest = [0]
    real = msgpack.Packer

    class Counting(real):
        def pack(self, value):
            if isinstance(value, list):
                longest[0] = max(longest[0], len(value))
            return super().pack(value)

    monkeypatch.setattr(pieces.msgpack, "Packer", Counting)
    data = manifest.to_bytes()
    assert 0 < longest[0] <= 100
    body = {f: getattr(manifest, f) for f in ("job", "step", "world_size", "part_size", "checksum")}
    assert unseal(data, "m") == msgpack.packb(msgpack.unpackb(unseal(data, "m")))  # the bytes of one packb
    assert Manifest.from_bytes(data) == manifest and len(manifest.tensors) == COUNT
    assert {k: v for k, v in msgpack.unpackb(unseal(data, "m")).items() if k in body} == body
