"""state/scalars.py: the 0-d tensors the Lightning plugin keeps as values come back as the same tensors,
value and dtype, for every dtype it converts; anything else is left as it is."""
import math

import pytest
import torch

from tiered_ckpt.state.scalars import SCALAR, scalars_as_values, values_as_scalars
from tiered_ckpt.state import decode_skeleton, flatten
from tiered_ckpt.state.skeleton import encode_skeleton


@pytest.mark.parametrize("value", [
    torch.tensor(0.1), torch.tensor(math.inf), torch.tensor(-math.inf), torch.tensor(1 / 3, dtype=torch.float64),
    torch.tensor(0.1, dtype=torch.bfloat16), torch.tensor(65504.0, dtype=torch.float16),
    torch.tensor(2**63 - 1), torch.tensor(-(2**63)), torch.tensor(255, dtype=torch.uint8),
    torch.tensor(-7, dtype=torch.int8), torch.tensor(True), torch.tensor(3, dtype=torch.int32)])
def test_a_scalar_comes_back_exactly_through_the_skeleton(value):
    tree = {"ModelCheckpoint": {"best_model_score": value, "best_k_models": {"/a/epoch=1.ckpt": value}}}
    stored = scalars_as_values(tree)
    flat = flatten(stored)
    assert flat.tensors == []  # no tensor left: the values live in the skeleton
    back = values_as_scalars(decode_skeleton(encode_skeleton(flat.skeleton)))
    for got in (back["ModelCheckpoint"]["best_model_score"], back["ModelCheckpoint"]["best_k_models"]["/a/epoch=1.ckpt"]):
        assert got.dtype == value.dtype and got.shape == () and torch.equal(got, value)


def test_nan_stays_nan():
    back = values_as_scalars(scalars_as_values({"s": torch.tensor(math.nan)}))
    assert back["s"].dtype == torch.float32 and torch.isnan(back["s"])


def test_other_values_are_left_alone():
    tree = {"t": torch.ones(2), "c": torch.tensor(1 + 2j), "n": [1, (2.5, "x")], "d": {SCALAR: ["float32", 1.0],
                                                                                         "other": 1}}
    stored = scalars_as_values(tree)
    assert stored["t"] is tree["t"] and stored["c"] is tree["c"] and stored["n"] == [1, (2.5, "x")]
    back = values_as_scalars(stored)
    assert back["d"] == tree["d"]  # a dict with another key beside the marker is a dict
    for lookalike in ({SCALAR: "x"}, {SCALAR: ["float8_e4m3fn", 1.0]}, {SCALAR: ["float32", "1"]}, {SCALAR: [1]}):
        assert values_as_scalars({"v": lookalike}) == {"v": lookalike}  # not one this version wrote: as it is
    assert type(back["n"][1]) is tuple
