"""Small GPU tensors gathered on their GPU before one copy to the host (save/gather.py), checked on the CPU:
which sources are gathered and into which runs, the order of the stream operations around the gathers, and
that a gather puts every byte where the plan says (a Layout works the same on CPU tensors)."""
import torch

from tiered_ckpt.save.copy import stream_steps
from tiered_ckpt.save.gather import Gatherer, Layout, Run, gather_runs
from tiered_ckpt.save.plan import build_plan
from tiered_ckpt.save.staging_buffer import StagingBuffer

CUDA0, CUDA1 = torch.device("cuda", 0), torch.device("cuda", 1)


def plan_of(tensors, key=("k",)):
    descriptors = [(f"t{i}", str(t.dtype), t.element_size(), tuple(t.shape), (0,) * t.dim(), tuple(t.shape))
                   for i, t in enumerate(tensors)]
    return build_plan(key, [descriptors], 0, 1 << 20)


def test_small_neighbours_on_one_gpu_form_runs_and_large_or_lone_ones_do_not():
    tensors = [torch.zeros(16), torch.zeros(16), torch.zeros(1 << 19), torch.zeros(16), torch.zeros(16),
               torch.zeros(16), torch.zeros(0), torch.zeros(16)]
    plan = plan_of(tensors)
    local = plan.local
    devices = [CUDA0, CUDA0, CUDA0, CUDA0, None, CUDA0, CUDA0, CUDA1]
    runs = gather_runs(local, devices, limit=1 << 20)
    # 0, 1 side by side; 2 is 2 MiB (copied on its own); 3 and 5 are split by a host source, so each stands alone;
    # 6 is empty; 7 is alone on its device
    assert runs == {CUDA0: [Run(0, local[0].offset, local[1].offset + local[1].nbytes - local[0].offset, (0, 1))]}
    assert gather_runs(local, devices, limit=64) == {}  # no room for two: nothing gathered
    assert gather_runs(local, [None] * len(local), limit=1 << 20) == {}


def test_alignment_padding_does_not_split_a_run():
    tensors = [torch.zeros(10), torch.zeros(3, dtype=torch.float64), torch.zeros(5, dtype=torch.int16)]
    plan = plan_of(tensors)
    assert plan.local[1].offset > plan.local[0].offset + plan.local[0].nbytes  # padded to 64 bytes
    [run] = gather_runs(plan.local, [CUDA0] * 3, limit=1 << 20)[CUDA0]
    assert run.indexes == (0, 1, 2) and run.nbytes == plan.local[2].offset + plan.local[2].nbytes


def test_a_layout_puts_every_gathered_byte_where_the_plan_says():
    tensors = [torch.arange(10, dtype=torch.float32), torch.full((3, 4), 7.0, dtype=torch.float64),
               torch.arange(5, dtype=torch.int16), torch.ones(2, 3, dtype=torch.bfloat16) * 3]
    plan = plan_of(tensors)
    cpu = torch.device("cpu")
    [runs] = gather_runs(plan.local, [cpu] * 4, limit=1 << 20).values()
    buf = StagingBuffer(plan.nbytes, pin=False)
    buf.tensor.fill_(0xAB)
    Layout(plan.local, runs, cpu).copy([tensors[c.index] for c in plan.local], buf.tensor)
    views = buf.views_for(plan)
    assert all(torch.equal(v, tensors[c.index]) for v, c in zip(views, plan.local))
    padding = [b for c, n in zip(plan.local, plan.local[1:]) for b in buf.tensor[c.offset + c.nbytes:n.offset].tolist()]
    assert padding and set(padding) == {0}  # zeros, as in a buffer never written there


def test_gathers_run_on_their_side_stream_after_the_wait_and_before_the_other_copies():
    devices = [CUDA0, CUDA0, CUDA0, None, CUDA1]
    steps = list(stream_steps(devices, {CUDA0: "e0"}, gathers=[CUDA0], skip={0, 1}))
    gather = steps.index(("gather", CUDA0))
    assert steps.index(("wait_event", CUDA0, "e0")) < gather
    assert steps[gather - 1] == ("select", CUDA0)
    assert [s[1] for s in steps if s[0] == "copy"] == [2, 3, 4]  # the gathered sources are not copied again
    assert gather < min(i for i, s in enumerate(steps) if s[0] == "copy")
    assert steps.count(("select", CUDA0)) == 1  # copy 2 follows the gather on the stream already selected
    assert steps.index(("synchronize", CUDA0)) > gather


def test_the_gatherer_keeps_a_plans_scratch_between_saves_and_drops_it_for_another_plan():
    cpu = torch.device("cpu")
    tensors = [torch.zeros(16), torch.zeros(16)]
    plan, other = plan_of(tensors), plan_of(tensors + [torch.zeros(16)], key=("other",))
    gatherer = Gatherer(1 << 20)
    first = gatherer.layouts(plan, [cpu, cpu])
    assert gatherer.layouts(plan, [cpu, cpu])[cpu] is first[cpu]  # no new scratch for the same plan
    assert gatherer.nbytes == 64 + 16 * 4
    assert gatherer.layouts(other, [cpu] * 3)[cpu] is not first[cpu] and gatherer.nbytes == 2 * 64 + 16 * 4
    gatherer.clear()
    assert gatherer.nbytes == 0
    assert Gatherer(0).layouts(plan, [cpu, cpu]) == {}


def test_no_room_on_the_gpu_for_the_scratch_means_copies_one_by_one(monkeypatch, caplog):
    from tiered_ckpt.save import gather

    def full(*args, **kwargs):
        raise torch.cuda.OutOfMemoryError("CUDA out of memory")

    monkeypatch.setattr(gather, "Layout", full)
    cpu = torch.device("cpu")
    gatherer = Gatherer(1 << 20)
    assert gatherer.layouts(plan_of([torch.zeros(16), torch.zeros(16)]), [cpu, cpu]) == {}
    assert "no room" in caplog.text and gatherer.nbytes == 0


def test_a_stretch_longer_than_the_scratch_is_gathered_up_to_the_limit():
    tensors = [torch.zeros(16) for _ in range(10)]  # 64 bytes each, side by side
    plan = plan_of(tensors)
    [run] = gather_runs(plan.local, [CUDA0] * 10, limit=4 * 64 + 63)[CUDA0]
    assert run.indexes == (0, 1, 2, 3) and run.nbytes == 4 * 64


def test_sources_that_moved_to_another_device_get_a_new_layout():
    cpu, meta = torch.device("cpu"), torch.device("meta")
    plan = plan_of([torch.zeros(16), torch.zeros(16)])
    gatherer = Gatherer(1 << 20)
    first = gatherer.layouts(plan, [cpu, cpu])
    assert set(gatherer.layouts(plan, [meta, meta])) == {meta}  # same plan, other device: made again
    assert gatherer.layouts(plan, [meta, meta])[meta] is not first.get(meta)


def test_every_run_starts_aligned_in_the_scratch_so_its_views_take_any_dtype():
    """bf16 neighbours whose run ends at an odd byte, a large tensor copied on its own, then fp64 neighbours:
    the second run must start on an 8-byte (here 64-byte) boundary of the scratch."""
    tensors = [torch.arange(5, dtype=torch.bfloat16), torch.arange(5, dtype=torch.bfloat16),
               torch.zeros(1 << 20), torch.arange(4, dtype=torch.float64), torch.arange(4, dtype=torch.float64) * 2]
    plan = plan_of(tensors)
    cpu = torch.device("cpu")
    [runs] = gather_runs(plan.local, [cpu] * 5, limit=1 << 20).values()
    assert len(runs) == 2 and all(r.start % 64 == 0 for r in runs)
    buf = StagingBuffer(plan.nbytes, pin=False)
    Layout(plan.local, runs, cpu).copy([tensors[c.index] for c in plan.local], buf.tensor)
    views = buf.views_for(plan)
    gathered = [i for r in runs for i in r.indexes]
    assert all(torch.equal(views[i], tensors[plan.local[i].index]) for i in gathered)


def test_lone_small_sources_take_no_room_from_the_runs():
    """Lone small tensors between large ones are copied on their own and must not use up the scratch: a limit
    that holds exactly the runs gathers all of them."""
    tensors = []
    for _ in range(4):
        tensors += [torch.zeros(16), torch.zeros(1 << 19)]  # small tensors, each next to a 2 MiB one
    tensors += [torch.zeros(16) for _ in range(4)]
    plan = plan_of(tensors)
    devices = [CUDA0] * len(tensors)
    unbounded = gather_runs(plan.local, devices, limit=1 << 30)[CUDA0]
    lone = len([c for c in plan.local if c.nbytes == 64]) - sum(len(r.indexes) for r in unbounded)
    assert lone > 0  # the layout has lone small sources, or the test proves nothing
    exact = unbounded[-1].start + unbounded[-1].nbytes
    assert gather_runs(plan.local, devices, limit=exact)[CUDA0] == unbounded
