"""DeviceBytes: how a load's reads write a GPU target's memory chunk by chunk. Its behaviour does not depend
on the device (a host → device copy where the tensor is on a GPU), so it is checked here on a CPU tensor;
the GPU run is in docs/benchmarks.md."""
import pytest
import torch

from tiered_ckpt.buffers import DeviceBytes, as_byte_tensor, tensor_bytes
from tiered_ckpt.storage.tiers.base import scatter


def test_a_scatter_across_slices_writes_every_byte_into_the_tensor_and_nothing_beside():
    target = torch.zeros(6, dtype=torch.float32)
    expected = torch.arange(6, dtype=torch.float32)
    raw = bytes(tensor_bytes(expected.clone()))
    sink = DeviceBytes(target)
    views = [sink[0:10], memoryview(bytearray(3)), sink[10:24]]  # a filler between two stretches of the target
    data = raw[:10] + b"xyz" + raw[10:]
    scatter([memoryview(data)[:7], memoryview(data)[7:]], views)  # pieces that do not line up with the views
    assert torch.equal(target, expected)
    assert bytes(views[1]) == b"xyz"


def test_slices_nest_and_the_byte_tensor_is_the_targets_memory():
    target = torch.zeros(8, dtype=torch.uint8)
    inner = DeviceBytes(target)[2:7][1:3]
    assert len(inner) == 2
    inner[0:2] = b"\x05\x06"  # a read-only source is copied first
    assert target.tolist() == [0, 0, 0, 5, 6, 0, 0, 0]
    as_byte_tensor(inner).fill_(9)
    assert target.tolist() == [0, 0, 0, 9, 9, 0, 0, 0]
    with pytest.raises(ValueError, match="3 bytes for a slice of 2"):
        inner[0:2] = b"abc"


def test_a_parameter_that_requires_grad_is_written_in_place():
    param = torch.nn.Parameter(torch.zeros(4))
    DeviceBytes(param)[0:16] = bytes(tensor_bytes(torch.ones(4)))
    assert torch.equal(param.detach(), torch.ones(4)) and param.requires_grad


def test_a_non_contiguous_tensor_and_an_index_are_refused():
    with pytest.raises(ValueError, match="contiguous"):
        DeviceBytes(torch.zeros(4, 4).t())
    with pytest.raises(TypeError, match="slices"):
        DeviceBytes(torch.zeros(4))[0]
