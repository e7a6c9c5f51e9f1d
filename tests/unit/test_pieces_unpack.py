"""`pieces.unpackb`: msgpack.unpackb's value and errors, with no C call that unpacks more than PIECE entries of
one container (one unpackb of a 1M-tensor manifest held the GIL ~0.1 s in the loading thread, and the event
loop waited as long: docs/benchmarks.md, *Event-loop stalls against the tensor count*)."""
import math

import msgpack
import pytest

from tiered_ckpt.manifest import pieces

PIECE, SMALL = 8, 2  # small, so every edge below is a few entries


@pytest.fixture
def small_pieces(monkeypatch):
    monkeypatch.setattr(pieces, "PIECE", PIECE)
    monkeypatch.setattr(pieces, "SMALL", SMALL)


class Counting:
    """Every value msgpack.Unpacker.unpack returned in pieces.py, to check the size of each C call."""

    def __init__(self, monkeypatch) -> None:
        self.values: list[object] = []
        real, seen = msgpack.Unpacker, self.values

        class Unpacker(real):  # type: ignore[misc, valid-type]
            def unpack(self):
                value = super().unpack()
                seen.append(value)
                return value

        monkeypatch.setattr(pieces.msgpack, "Unpacker", Unpacker)

    def longest(self) -> int:
        """The most entries one unpack() call made in one container (its own, not nested ones)."""
        return max((len(v) for v in self.values if isinstance(v, (list, dict))), default=0)


def _values(n: int) -> list[object]:
    """n values of each kind msgpack has, nested ones too."""
    kinds = [0, -1, 2 ** 40, -(2 ** 40), 1.5, True, None, "é" * 3, b"\x00\xff", [1, [2, "x"]], {"k": [1, 2]},
             msgpack.ExtType(5, b"ext")]
    return [kinds[i % len(kinds)] for i in range(n)]


EDGES = [0, 1, SMALL, SMALL + 1, PIECE - 1, PIECE, PIECE + 1, 2 * PIECE, 2 * PIECE + 1, 5 * PIECE + 3]


@pytest.mark.parametrize("n", EDGES)
def test_an_array_of_any_length_unpacks_as_unpackb_does_a_piece_at_a_time(small_pieces, monkeypatch, n):
    data = msgpack.packb(_values(n))
    calls = Counting(monkeypatch)
    assert pieces.unpackb(data) == msgpack.unpackb(data)
    assert calls.longest() <= PIECE


@pytest.mark.parametrize("n", EDGES)
def test_a_map_of_any_length_unpacks_as_unpackb_does_a_piece_at_a_time(small_pieces, monkeypatch, n):
    value = {f"key{i}": v for i, v in enumerate(_values(n))}
    data = msgpack.packb({"outer": value, "ints": {i: i for i in range(n)}})
    calls = Counting(monkeypatch)
    assert pieces.unpackb(data, strict_map_key=False) == msgpack.unpackb(data, strict_map_key=False)
    assert calls.longest() <= PIECE


@pytest.mark.parametrize("n", [15, 16, 65535, 65536, 70000])  # fixarray, array 16 and array 32 headers, as is
def test_each_header_width_unpacks_with_the_real_piece_size(n):
    assert pieces.PIECE < 65536 < 70000
    paths = [f"layers.{i}.weight" for i in range(n)]
    data = msgpack.packb({"tensors": {"path": paths, "dtype": [1, b"\x01" * n]}, "ranks": [{"rank": 0}]})
    assert pieces.unpackb(data) == msgpack.unpackb(data)


def test_a_long_array_inside_short_containers_is_cut_too(small_pieces, monkeypatch):
    data = msgpack.packb({"a": [[list(range(3 * PIECE))], "b"], "c": list(range(SMALL + 1))})
    calls = Counting(monkeypatch)
    assert pieces.unpackb(data) == msgpack.unpackb(data)
    assert calls.longest() <= PIECE


def test_long_pieces_cross_the_feeding_window(monkeypatch):
    """Values longer than the first window (64 KiB) and pieces whose length changes: fed until whole."""
    monkeypatch.setattr(pieces, "PIECE", 3)
    value = [b"x" * 10, b"y" * 200_000, b"z", "w" * 300_000, 1, 2, 3, b"v" * 70_000]
    data = msgpack.packb({"big": value, "blob": b"b" * 1_000_000})
    assert pieces.unpackb(data) == msgpack.unpackb(data)


def test_options_are_those_of_unpackb(small_pieces):
    data = msgpack.packb({"s": ["é"] * (2 * PIECE + 1), "b": b"raw"})
    assert pieces.unpackb(data, raw=True) == msgpack.unpackb(data, raw=True)
    keyed = msgpack.packb({1: "int key", "m": {i: i for i in range(PIECE + 1)}})
    assert pieces.unpackb(keyed, strict_map_key=False) == msgpack.unpackb(keyed, strict_map_key=False)
    for refused in (keyed, msgpack.packb({"m": {i: i for i in range(PIECE + 1)}})):
        with pytest.raises(ValueError):
            msgpack.unpackb(refused)
        with pytest.raises(ValueError, match="not allowed for map key"):
            pieces.unpackb(refused)


@pytest.mark.parametrize("n", [SMALL, PIECE + 1, 3 * PIECE])
def test_damaged_data_raises_what_unpackb_raises(small_pieces, n):
    data = msgpack.packb({"a": _values(n), "b": [b"x" * 100] * n + [None]})
    for cut in sorted({0, 1, 2, len(data) // 3, len(data) // 2, len(data) - 1} | set(range(0, len(data), 37))):
        with pytest.raises(ValueError):
            msgpack.unpackb(data[:cut])
        with pytest.raises(ValueError, match="incomplete input"):
            pieces.unpackb(data[:cut])
    with pytest.raises(msgpack.ExtraData):
        msgpack.unpackb(data + b"\x01")
    with pytest.raises(msgpack.ExtraData):
        pieces.unpackb(data + b"\x01")
    assert data[-1:] == b"\xc0"
    bad = data[:-1] + b"\xc1"  # nil made a byte msgpack never uses
    with pytest.raises(msgpack.FormatError):
        msgpack.unpackb(bad)
    with pytest.raises(msgpack.FormatError):
        pieces.unpackb(bad)


def test_a_manifest_is_read_a_piece_at_a_time_into_the_same_manifest(monkeypatch):
    """Manifest.from_bytes unpacks the path column in calls of at most PIECE paths, into the manifest written."""
    from tiered_ckpt.manifest import Manifest, RankMeta
    from tiered_ckpt.save.describe import describe
    from tiered_ckpt.save.world_plan import plan_world

    monkeypatch.setattr(pieces, "PIECE", 100)
    count = 1234
    descriptors = [(f"layer{i}.scale", "torch.float32", 4, (16,), (0,), (16,)) for i in range(count)]
    plan = plan_world([describe(descriptors, 0).payload_for(None)])
    manifest = Manifest(job="j", step=3, world_size=1, part_size=1 << 20, checksum="crc32c", tensors=plan.tensors,
                        ranks=(RankMeta(0, plan.rank_nbytes[0]),), skeleton=b"s", created=1.0,
                        metadata={"lr": [0.1] * 300, "note": "x"})
    data = manifest.to_bytes()
    calls = Counting(monkeypatch)
    read = Manifest.from_bytes(data)
    assert read == manifest and read.tensors.paths == manifest.tensors.paths
    assert 0 < calls.longest() <= 100 and len(calls.values) >= math.ceil(count / 100)


def _strings(n: int, seed: int) -> list[str]:
    """Distinct strs that share prefixes, differ in length, and hold non-ASCII, astral and lone surrogate code
    points (their UTF-8 bytes must sort as the code points do)."""
    import random

    rng = random.Random(seed)
    alphabet = ["a", "b", ".", "0", "9", "é", "ÿ", "Ā", "€", "\ud800", "\ue000", "\uffff", "😀", "\U0010ffff"]
    out = {"", "a", "ab", "a.b", "layer1", "layer10", "layer2"}
    while len(out) < n:
        out.add("layer" + "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 6))))
    values = sorted(out)[:n]
    rng.shuffle(values)
    return values


def _object_order(values: list[str]):
    import numpy as np

    return np.argsort(np.asarray(values, dtype=object), kind="stable")


@pytest.mark.parametrize("n", [0, 1, 2, PIECE - 1, PIECE, PIECE + 1, 4 * PIECE + 5, 300])
def test_string_order_is_the_object_sorts_order(small_pieces, n):
    values = _strings(n, seed=n)
    assert pieces.string_order(values).tolist() == _object_order(values).tolist()


def test_string_order_falls_back_where_bytes_would_not_sort_as_strs(small_pieces, monkeypatch):
    values = ["a\0", "a", "a\0\0", "b", "\0"] + _strings(3 * PIECE, seed=7)  # NUL padding would tie these
    assert pieces.string_order(values).tolist() == _object_order(values).tolist()
    monkeypatch.setattr(pieces, "SORT_BYTES", 10)  # too large a copy: the object sort
    values = _strings(3 * PIECE, seed=8)
    assert pieces.string_order(values).tolist() == _object_order(values).tolist()


def test_the_plan_frees_its_per_tensor_lists_a_batch_at_a_time(monkeypatch):
    """describe() and plan_world() hand what they made per tensor (the columns, the world's lists and dict of
    paths, the compared boxes and the pieces made of them) to release_all before they return: dropped whole at
    the return, 1M entries are freed in one step that holds the GIL (75 and 175 ms at 1M tensors, in the planning
    thread)."""
    from tiered_ckpt import release
    from tiered_ckpt.save import describe as describe_module, world_plan
    from tiered_ckpt.save.describe import describe
    from tiered_ckpt.save.world_plan import plan_world

    count = 3000
    handed: dict[str, list[int]] = {"describe": [], "plan": []}

    def recorder(name):
        def release_all(things):
            handed[name].extend(len(t) for t in things if isinstance(t, (list, dict)))
            release.release_all(things)
            assert all(len(t) == 0 for t in things if isinstance(t, (list, dict))) and not things
        return release_all

    monkeypatch.setattr(describe_module, "release_all", recorder("describe"))
    monkeypatch.setattr(world_plan, "release_all", recorder("plan"))
    descriptors = [(f"layer{i}.scale", "torch.float32", 4, (16,), (0,), (16,)) for i in range(count)]
    plan = plan_world([describe(descriptors, 0).payload_for(None), describe(descriptors, 1).payload_for(None)])
    assert len(plan.tensors) == count and plan.tensors.paths[-1] == f"layer{count - 1}.scale"
    assert handed["describe"].count(count) >= 5  # paths, dtypes, itemsizes, ndims, shared (and the flat columns)
    assert handed["plan"].count(count) >= 5 + 4  # its unpickled columns, the world's four lists and its dict
    handed["plan"].clear()  # ranks whose structures differ: their shared boxes compared, then placed
    differing = [describe(descriptors + [(f"extra{r}", "torch.float32", 4, (16,), (0,), (16,))], r)
                 for r in range(2)]
    plan = plan_world([d.payload_for(None) for d in differing])
    assert len(plan.tensors) == count + 2
    assert handed["plan"].count(count) >= 2  # the boxes placed largest first, and the pieces made of them


def test_replicated_small_boxes_are_ordered_as_the_tuple_sort_ordered_them():
    """_largest_first (array sorts that give the GIL back) is the order of sorted() over (-bytes, (path, offsets,
    sizes)): largest first, ties by path (non-ASCII too), then offsets, then sizes; 0-d boxes too."""
    import random

    from tiered_ckpt.save.world_plan import _largest_first

    rng = random.Random(5)
    paths = _strings(400, seed=5)
    small, seen = [], set()
    for _ in range(4000):
        t = rng.randrange(len(paths))
        ndim = t % 3
        offsets, sizes = (tuple(rng.randint(0, 3) for _ in range(ndim)) for _ in range(2))
        if (t, offsets, sizes) not in seen:
            seen.add((t, offsets, sizes))
            small.append((rng.choice([0, 4, 8, 64]), (paths[t], offsets, sizes), (t, offsets, sizes), {}))
    expected = sorted(range(len(small)), key=lambda i: (-small[i][0], small[i][1]))
    assert _largest_first(small, paths) == expected
    assert _largest_first(small[:1], paths) == [0] and _largest_first([], paths) == []
    scalars = [s for s in small if not s[2][1]]  # only 0-d boxes (an FSDP2 optimizer's step counters): no dims at all
    assert len(scalars) > 2
    assert _largest_first(scalars, paths) == sorted(range(len(scalars)), key=lambda i: (-scalars[i][0], scalars[i][1]))


@pytest.mark.parametrize("depth", [1, pieces.DEPTH - 1, pieces.DEPTH, pieces.DEPTH + 1, 500])
def test_nested_containers_unpack_as_unpackb_does(small_pieces, depth):
    value: object = [list(range(PIECE + 2)), {"k": b"v"}]
    for i in range(depth):
        value = [value, i] if i % 2 else {"d": value, "n": i}
    data = msgpack.packb(value)
    assert pieces.unpackb(data) == msgpack.unpackb(data) == value


def test_nesting_past_msgpacks_limit_raises_its_error():
    data = b"\x91" * 5000 + b"\x01"  # 5,000 arrays, one inside the other
    with pytest.raises(msgpack.StackError):
        msgpack.unpackb(data)
    with pytest.raises(msgpack.StackError):
        pieces.unpackb(data)


def test_long_bins_come_back_as_views_of_the_data_when_asked():
    value = {"cols": [[2, b"a" * pieces.VIEW], [1, b"short"]], "nested": [{"blob": b"z" * (3 * pieces.VIEW)}]}
    data = msgpack.packb(value)
    out = pieces.unpackb(data, views=True)
    long_one, short_one = out["cols"][0][1], out["cols"][1][1]
    assert isinstance(long_one, memoryview) and long_one.obj is data and bytes(long_one) == b"a" * pieces.VIEW
    assert type(short_one) is bytes and isinstance(out["nested"][0]["blob"], memoryview)
    assert pieces.unpackb(data) == value  # (without views: bytes, as unpackb)
    with pytest.raises(ValueError, match="incomplete"):  # a long bin cut short is refused as unpackb refuses it
        pieces.unpackb(data[:20], views=True)


def test_packed_parts_join_to_packbs_bytes_and_long_bins_are_not_copied(small_pieces):
    import numpy as np

    from tiered_ckpt.checksum import seal, seal_parts

    column = np.arange(pieces.VIEW, dtype="<u2")
    long_bin = b"q" * (pieces.VIEW + 1)
    value = {"cols": {"a": [2, memoryview(column).cast("B")], "b": [1, b"short"], "c": [4, long_bin]},
             "t": (1, 2, [b"x" * pieces.VIEW]),
             "many": list(range(3 * PIECE + 1)), "nested": [{"k": [long_bin, None, 1.5, "s"]}], "mid": list(range(100))}
    expected = msgpack.packb({**value, "cols": {"a": [2, column.tobytes()], "b": [1, b"short"], "c": [4, long_bin]}})
    parts = pieces.packed_parts(value)
    assert b"".join(parts) == expected == pieces.packb(value)
    assert any(p is long_bin for p in parts)  # (handed on as it is, not copied into the packer's buffer)
    assert seal_parts(parts) == seal(expected)
