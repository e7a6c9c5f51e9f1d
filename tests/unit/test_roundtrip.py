"""Bit-exact round trips of every dtype and awkward shape, modules, optimizers and plain values."""
import pytest
import torch

import tiered_ckpt as tc
from tiered_ckpt.state import _UNSUPPORTED

ALL_DTYPES = sorted({v for v in vars(torch).values() if isinstance(v, torch.dtype)}, key=str)
QUANTIZED = {torch.qint8, torch.quint8, torch.qint32, torch.quint4x2, torch.quint2x4}
STORABLE = [d for d in ALL_DTYPES if d not in _UNSUPPORTED]
assert QUANTIZED <= _UNSUPPORTED


def random_tensor(shape, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    itemsize = torch.empty((), dtype=dtype).element_size()
    n = 1
    for s in shape:
        n *= s
    raw = torch.randint(0, 256, (n * itemsize,), dtype=torch.uint8, generator=g)
    return raw.view(dtype).reshape(shape)


def same_bits(a, b):
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(
        a.contiguous().reshape(-1).view(torch.uint8), b.contiguous().reshape(-1).view(torch.uint8))


def test_every_storable_dtype_is_covered():
    names = {str(d) for d in STORABLE}
    for must in ["float64", "float32", "float16", "bfloat16", "float8_e4m3fn", "float8_e5m2", "int8", "int16",
                 "int32", "int64", "uint8", "bool", "complex64", "complex128"]:
        assert f"torch.{must}" in names


@pytest.mark.parametrize("dtype", STORABLE, ids=str)
async def test_dtype_round_trip_bit_exact(engine, dtype):
    shapes = {"matrix": (7, 13), "scalar": (), "empty": (0, 5), "vector": (1000,)}
    state = {k: random_tensor(s, dtype, seed=i) for i, (k, s) in enumerate(shapes.items())}
    state["strided"] = random_tensor((6, 10), dtype, seed=9)[:, ::3]  # non-contiguous
    state["transposed"] = random_tensor((5, 4), dtype, seed=10).t()
    expected = {k: v.clone() for k, v in state.items()}
    await (await engine.save(1, state)).wait()
    for tier in ("host", "disk"):
        out = {k: random_tensor(v.shape, dtype, seed=50 + i) for i, (k, v) in enumerate(state.items())}
        out["transposed"] = random_tensor((5, 4), dtype, seed=99).t()  # a non-contiguous target too
        info = await engine.load(out, tiers=[tier])
        assert info.tier == tier
        for k in state:
            assert same_bits(out[k], expected[k]), (dtype, k, tier)


@pytest.mark.parametrize("dtype", sorted(QUANTIZED | _UNSUPPORTED, key=str), ids=str)
async def test_unstorable_dtype_is_a_clear_error(engine, dtype):
    t = torch.quantize_per_tensor(torch.ones(3), 0.1, 0, dtype) if dtype in QUANTIZED else torch.empty(3, dtype=dtype)
    with pytest.raises(tc.StateError, match=r"'layer/w'.*dtype"):
        await engine.save(1, {"layer": {"w": t}})


async def test_module_optimizer_and_plain_values(engine):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.LayerNorm(16), torch.nn.Linear(16, 2))
    optim = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for _ in range(3):
        model(torch.randn(4, 8)).pow(2).sum().backward()
        optim.step()
        optim.zero_grad()
    extra = {"lr": 3e-4, "name": "run-1", "betas": (0.9, 0.95), "none": None, "blob": b"\x00\x01", "big": 2**62,
             "nested": [1, [2.5, {"k": True}]], "rng": torch.get_rng_state()}
    await (await engine.save(3, {"model": model, "optim": optim, "extra": extra})).wait()

    model2 = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.LayerNorm(16), torch.nn.Linear(16, 2))
    optim2 = torch.optim.AdamW(model2.parameters(), lr=1.0)  # fresh: no state yet
    extra2 = {"lr": 0.0, "name": "", "betas": None, "none": 1, "blob": b"", "big": 0, "nested": None,
              "rng": torch.zeros_like(extra["rng"])}
    info = await engine.load({"model": model2, "optim": optim2, "extra": extra2})
    assert info.step == 3
    for a, b in zip(model.state_dict().values(), model2.state_dict().values()):
        assert same_bits(a, b)
    s1, s2 = optim.state_dict(), optim2.state_dict()
    assert s1["param_groups"] == s2["param_groups"]
    for pid in s1["state"]:
        for k in s1["state"][pid]:
            assert same_bits(s1["state"][pid][k], s2["state"][pid][k])
    assert {k: v for k, v in extra2.items() if k != "rng"} == {k: v for k, v in extra.items() if k != "rng"}
    assert isinstance(extra2["betas"], tuple)
    assert same_bits(extra2["rng"], extra["rng"])
    # and training continues identically
    x = torch.randn(4, 8)
    for m, o in ((model, optim), (model2, optim2)):
        m(x).pow(2).sum().backward()
        o.step()
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), model2.parameters()))


async def test_shape_mismatch_names_key_and_both_shapes(engine):
    await (await engine.save(1, {"w": torch.zeros(3, 4)})).wait()
    with pytest.raises(tc.StateError, match=r"'w'.*\(4, 3\).*\(3, 4\)"):
        await engine.load({"w": torch.zeros(4, 3)})
    with pytest.raises(tc.StateError, match=r"'extra'.*not in the checkpoint"):
        await engine.load({"w": torch.zeros(3, 4), "extra": 1})


async def test_failed_load_leaves_state_untouched(engine):
    await (await engine.save(1, {"a": {"lr": 5}, "w": torch.ones(3)})).wait()
    state = {"a": {"lr": 1}, "w": torch.zeros(4)}
    with pytest.raises(tc.StateError):
        await engine.load(state)
    assert state["a"]["lr"] == 1


async def test_partial_load_of_a_subset(engine):
    await (await engine.save(1, {"model": {"w": torch.ones(3)}, "optim": {"m": torch.ones(2)}})).wait()
    state = {"model": {"w": torch.zeros(3)}}
    await engine.load(state)
    assert torch.equal(state["model"]["w"], torch.ones(3)) and "optim" not in state


async def test_arbitrary_objects_refused_unless_pickle_allowed(make_config):
    class Custom:
        def __init__(self):
            self.x = 41

    async with tc.Engine(make_config()) as engine:
        with pytest.raises(tc.StateError, match=r"'extra/obj'.*allow_pickle"):
            await engine.save(1, {"extra": {"obj": Custom()}})
        assert [c async for c in engine.list()] == []  # nothing was started
    async with tc.Engine(make_config(allow_pickle=True)) as engine:
        await (await engine.save(1, {"extra": {"obj": {1, 2}}})).wait()
        state = {"extra": {"obj": None}}
        await engine.load(state)
        assert state["extra"]["obj"] == {1, 2}
    async with tc.Engine(make_config()) as engine:  # a pickled value is not opened without opting in
        with pytest.raises(tc.StateError, match="pickle"):
            await engine.load({"extra": {"obj": None}})


async def test_thousands_of_small_tensors_in_one_part(engine):
    state = {f"t{i}": torch.full((3,), float(i)) for i in range(3000)}
    await (await engine.save(1, state)).wait()
    out = {k: torch.zeros(3) for k in state}
    await engine.load(out)
    assert all(torch.equal(out[k], state[k]) for k in state)


@pytest.mark.parametrize("view", [lambda t: t.conj(), lambda t: t._neg_view()], ids=["conj", "neg"])
async def test_a_conjugate_or_negative_view_target_gets_the_saved_values(engine, view):
    """Such a view's memory holds other numbers than its values: it is filled through scratch (copy_ keeps the
    view's meaning), never by writing the saved bytes into its memory."""
    saved = torch.tensor([1 + 2j, 3 - 4j], dtype=torch.complex64)
    await (await engine.save(1, {"z": saved})).wait()
    target = view(torch.zeros(2, dtype=torch.complex64))
    await engine.load({"z": target})
    assert torch.equal(target.resolve_conj().resolve_neg(), saved)
