"""local_box remembers a DTensor's box per layout: the same answers as DTensor's own computation, for each
rank's place in the mesh (a fake process group plays ranks 2 and 3 of a 2x2 mesh in this one process)."""
import pytest
import torch
import torch.distributed as dist

from tiered_ckpt.distributed import dtensor


@pytest.mark.parametrize("rank", [2, 3])
def test_the_box_is_dtensors_own_for_this_ranks_place_in_the_mesh(rank):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate, Shard
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
    from torch.testing._internal.distributed.fake_pg import FakeStore

    assert not dist.is_initialized()
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=4)
    try:
        mesh = init_device_mesh("cpu", (2, 2))
        for places in ([Shard(0), Shard(1)], [Replicate(), Shard(0)], [Shard(1), Shard(1)]):
            for shape in ((7, 5), (8, 4), (3, 9)):  # uneven shards too
                t = DTensor.from_local(torch.zeros(1, 1), mesh, places, run_check=False, shape=torch.Size(shape),
                                       stride=(shape[1], 1))
                sizes, offsets = compute_local_shape_and_global_offset(shape, mesh, places)
                expected = (shape, tuple(offsets), tuple(sizes))
                assert dtensor.local_box(t) == expected  # computed
                assert dtensor.local_box(t) == expected  # remembered: ranks 2 and 3 get their own
        assert dtensor._boxes  # remembered, without holding the mesh
        assert not any(isinstance(v, type(mesh)) for key in dtensor._boxes for v in key)
    finally:
        dist.destroy_process_group()
