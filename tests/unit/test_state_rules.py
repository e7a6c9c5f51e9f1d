"""What comes back, and how: values vs tensors, dtype casts, tied weights, per-rank entries, wrapped-model
keys, and states that match nothing. Each rule is in docs/state.md."""
import pytest
import torch

import tiered_ckpt as tc


async def test_a_subtree_without_tensors_is_a_value_replaced_whole(engine):
    saved = {"w": torch.ones(4), "extra": {"lrs": [0.001, 0.0005], "history": {"loss": [3.2, 2.9, 2.7]}, "note": None}}
    await (await engine.save(1, saved)).wait()
    extra = {"lrs": [], "history": {}, "note": "x"}
    state = {"w": torch.zeros(4), "extra": extra}
    await engine.load(state)
    assert state["extra"] == {"lrs": [0.001, 0.0005], "history": {"loss": [3.2, 2.9, 2.7]}, "note": None}
    assert state["extra"] is extra  # dicts and lists are refilled in place: references the caller holds see it
    assert torch.equal(state["w"], torch.ones(4))


async def test_containers_that_hold_tensors_still_match_strictly(engine):
    await (await engine.save(1, {"ws": [torch.ones(2), torch.ones(3)]})).wait()
    with pytest.raises(tc.StateError, match=r"'ws'.*length 1"):
        await engine.load({"ws": [torch.zeros(2)]})


async def test_a_state_with_nothing_in_common_is_an_error_naming_the_saved_keys(engine):
    await (await engine.save(1, {"model": {"w": torch.ones(2)}, "step": 1})).wait()
    with pytest.raises(tc.StateError, match=r"no key in common.*\['model', 'step'\]"):
        await engine.load({})
    with pytest.raises(tc.StateError, match=r"'optimizer' is in the given state but not in the checkpoint.*"
                                            r"\['model', 'step'\]"):
        await engine.load({"optimizer": {"m": torch.zeros(2)}})
    for nothing_to_fill in (None, 0, "model"):  # each used to read the whole checkpoint into nothing, and return
        with pytest.raises(tc.StateError, match="fills the state it is given in place"):
            await engine.load(nothing_to_fill)


@pytest.mark.parametrize("saved_dtype, target_dtype", [(torch.bfloat16, torch.float32), (torch.float32, torch.float16),
                                                       (torch.float64, torch.bfloat16)])
async def test_a_saved_dtype_is_cast_to_the_target_dtype(engine, saved_dtype, target_dtype):
    source = torch.linspace(-3, 3, 60, dtype=torch.float64).reshape(6, 10)
    model = torch.nn.Linear(10, 6).to(saved_dtype)
    with torch.no_grad():
        model.weight.copy_(source)
    await (await engine.save(1, {"model": model, "t": source.to(saved_dtype)})).wait()
    target = torch.nn.Linear(10, 6).to(target_dtype)
    strided = torch.zeros(10, 6, dtype=target_dtype).t()  # a non-contiguous target takes the scratch path
    await engine.load({"model": target, "t": strided})
    expected = source.to(saved_dtype).to(target_dtype)
    assert target.weight.dtype == target_dtype and torch.equal(target.weight.detach(), expected)
    assert torch.equal(strided, expected)


async def test_a_shape_mismatch_names_only_the_shape(engine):
    await (await engine.save(1, {"w": torch.zeros(3, 4)})).wait()
    with pytest.raises(tc.StateError, match=r"'w'.*shape \(4, 3\).*shape \(3, 4\)") as err:
        await engine.load({"w": torch.zeros(4, 3, dtype=torch.float64)})
    assert "float" not in str(err.value)


class TiedLM(torch.nn.Module):
    def __init__(self, tie: bool = True):
        super().__init__()
        self.embed = torch.nn.Embedding(100, 16)
        self.head = torch.nn.Linear(16, 100, bias=False)
        if tie:
            self.head.weight = self.embed.weight


async def test_tied_weights_are_written_once_and_stay_tied(engine):
    torch.manual_seed(0)
    model = TiedLM()
    await (await engine.save(1, {"model": model})).wait()
    manifest = await engine.read_manifest(1)
    assert manifest.nbytes == 100 * 16 * 4  # one copy of the shared storage, not two
    fresh = TiedLM()
    await engine.load({"model": fresh})
    assert fresh.head.weight is fresh.embed.weight and torch.equal(fresh.embed.weight, model.embed.weight)
    untied = TiedLM(tie=False)  # a target without the tie gets both filled
    await engine.load({"model": untied})
    assert torch.equal(untied.embed.weight, model.embed.weight) and torch.equal(untied.head.weight, model.embed.weight)


async def test_per_rank_entries_round_trip_in_one_process(engine):
    rng = torch.get_rng_state()
    await (await engine.save(1, {"rng": tc.PerRank(rng), "loader": tc.PerRank({"pos": 17})})).wait()
    state = {"rng": tc.PerRank(torch.zeros_like(rng)), "loader": tc.PerRank({"pos": 0})}
    await engine.load(state)
    assert torch.equal(state["rng"].value, rng) and state["loader"].value == {"pos": 17}


async def test_a_wrapped_models_prefix_is_named_in_the_error(engine):
    wrapped = torch.nn.DataParallel(torch.nn.Linear(3, 2))  # keys "module.weight", as DDP saves them
    await (await engine.save(1, {"model": wrapped})).wait()
    with pytest.raises(tc.StateError, match=r"'model/weight'.*'module\.' prefix"):
        await engine.load({"model": torch.nn.Linear(3, 2)})
    plain = torch.nn.Linear(3, 2)
    await (await engine.save(2, {"model": plain})).wait()
    with pytest.raises(tc.StateError, match=r"'model/module\.weight'.*'module\.' prefix the checkpoint lacks"):
        await engine.load({"model": torch.nn.DataParallel(torch.nn.Linear(3, 2))}, step=2)


async def test_loading_into_a_meta_tensor_is_an_error(engine):
    await (await engine.save(1, {"w": torch.ones(3)})).wait()
    with pytest.raises(tc.StateError, match=r"'w'.*meta device"):
        await engine.load({"w": torch.empty(3, device="meta")})


async def test_train_state_of_a_bf16_run_loads_into_an_fp32_model(engine):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 2)).to(torch.bfloat16)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(3, 4, dtype=torch.bfloat16)).float().pow(2).sum().backward()
    optim.step()
    await (await engine.save(1, {"train": tc.TrainState(model, optim)})).wait()
    fp32 = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 2))
    optim32 = torch.optim.AdamW(fp32.parameters(), lr=1e-3)
    await engine.load({"train": tc.TrainState(fp32, optim32)})
    for a, b in zip(model.parameters(), fp32.parameters()):
        assert b.dtype == torch.float32 and torch.equal(a.float(), b.detach())
    saved_avg, loaded_avg = optim.state_dict()["state"][0]["exp_avg"], optim32.state_dict()["state"][0]["exp_avg"]
    assert torch.equal(saved_avg.float(), loaded_avg)  # torch's Optimizer casts its state to the params' dtype


async def test_a_value_equal_to_the_saved_one_is_a_match_not_an_empty_load(engine):
    await (await engine.save(1, {"w": torch.ones(2), "step": 5, "done": False})).wait()
    state = {"step": 5}
    await engine.load(state)  # the same small int object: nothing to assign, but the key matched
    assert state == {"step": 5}


async def test_two_entries_with_one_path_are_refused(engine):
    with pytest.raises(tc.StateError, match=r"two entries.*'a/b'"):
        await engine.save(1, {"a/b": torch.ones(3), "a": {"b": torch.ones(2)}})
    with pytest.raises(tc.StateError, match=r"two entries.*'0'"):
        await engine.save(1, {0: torch.ones(3), "0": torch.ones(2)})


async def test_an_expanded_target_is_refused_before_any_byte_is_read_naming_the_key(engine):
    """Several elements of a stride-0 view are one memory location: torch refuses to write into it, and the load
    said so with a raw error naming no key."""
    await (await engine.save(1, {"model": {"w": torch.ones(3, 4), "b": torch.ones(4)}})).wait()
    b = torch.zeros(4)
    expanded = torch.zeros(4).expand(3, 4)
    with pytest.raises(tc.StateError, match=r"tensor 'model/w' \(shape \(3, 4\), stride \(0, 1\)\).*share one memory"):
        await engine.load({"model": {"w": expanded, "b": b}})
    assert torch.equal(b, torch.zeros(4)) and torch.equal(expanded, torch.zeros(3, 4))  # nothing was written
    single = torch.zeros(1, 4).expand(1, 4)  # stride 0 along a dimension of size 1: one element each, fine
    await (await engine.save(2, {"v": torch.ones(1, 4)})).wait()
    await engine.load({"v": single}, step=2)
    assert torch.equal(single, torch.ones(1, 4))


async def test_per_rank_missing_policies_are_checked_and_unused_at_the_same_world_size(engine):
    """`missing` is "error", "keep" or a function; anything else is refused when the PerRank is made. A rank that
    existed at save time gets its own value whatever `missing` says (tests/multirank covers a larger world)."""
    with pytest.raises(ValueError, match="missing=.*'error', 'keep' or a function"):
        tc.PerRank(torch.zeros(3), missing="zero")
    await (await engine.save(1, {"rng": tc.PerRank(torch.full((3,), 5.0)), "pos": tc.PerRank({"i": 7})})).wait()
    state = {"rng": tc.PerRank(torch.zeros(3), missing=lambda saved: torch.ones(3)), "pos": tc.PerRank({}, "keep")}
    await engine.load(state)
    assert state["rng"].value.tolist() == [5.0] * 3 and state["pos"].value == {"i": 7}


async def test_an_empty_key_keeps_its_place_in_every_path_and_round_trips(engine):
    """A key "" is a path element like any other ("/b" under it, "/x@rank0" for a PerRank there): the save's
    walk builds paths a key at a time, and the load's matcher must find the same names."""
    from tiered_ckpt.state import flatten

    t = torch.arange(4.0)
    assert flatten({"": {"b": t}, "b": t + 1}).paths == ["/b", "b"]
    assert flatten({"": tc.PerRank({"x": t})}).paths == ["/x@rank0"]
    await (await engine.save(1, {"": {"b": t}, "b": t + 1})).wait()
    out = {"": {"b": torch.zeros(4)}, "b": torch.zeros(4)}
    await engine.load(out)
    assert torch.equal(out[""]["b"], t) and torch.equal(out["b"], t + 1)


async def test_an_optimizer_over_other_parameters_is_refused_before_the_model_is_touched(engine):
    """An optimizer built over fewer parameters (a layer frozen on resume): torch's load_state_dict refuses it,
    but only ran after the model's tensors were loaded. Now the groups are compared before any byte is read."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
    optim = torch.optim.Adam(model.parameters(), lr=0.1)
    model(torch.randn(2, 4)).sum().backward()
    optim.step()
    await (await engine.save(1, {"model": model, "optim": optim})).wait()
    fresh = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
    before = {k: v.clone() for k, v in fresh.state_dict().items()}
    partial = torch.optim.Adam(list(fresh.parameters())[:2], lr=0.1)
    with pytest.raises(tc.StateError, match=r"'optim/param_groups'.*\[2\] parameters, the saved one's \[4\]"):
        await engine.load({"model": fresh, "optim": partial})
    assert all(torch.equal(v, before[k]) for k, v in fresh.state_dict().items())
    assert not partial.state


async def test_a_load_state_dict_that_refuses_is_a_state_error_naming_the_object(engine):
    class Picky:
        def __init__(self):
            self.w = torch.ones(3)

        def state_dict(self):
            return {"w": self.w}

        def load_state_dict(self, sd):
            raise ValueError("not today")

    await (await engine.save(1, {"picky": Picky()})).wait()
    with pytest.raises(tc.StateError, match=r"'picky': Picky.load_state_dict refused .*ValueError: not today"):
        await engine.load({"picky": Picky()})
