"""The order of CUDA operations in a staging copy, checked on the CPU: a side stream never copies a tensor
before the stream that produced it reached the save (a pending optimizer step or forward would otherwise
be read half-done), and staging returns only once every copy finished. The real CUDA run of the same
steps happens where a GPU is available (docs/benchmarks.md)."""
import torch

from tiered_ckpt.save.plan import build_plan
from tiered_ckpt.save.copy import stage, stream_steps
from tiered_ckpt.save.staging_buffer import StagingBuffer

CUDA0, CUDA1 = torch.device("cuda", 0), torch.device("cuda", 1)


def positions(steps, op, device):
    return [i for i, s in enumerate(steps) if s[0] == op and device in s[1:]]


def test_each_device_waits_for_its_producer_before_any_copy_and_syncs_after_all():
    devices = [CUDA0, None, CUDA1, CUDA0, None]
    steps = list(stream_steps(devices, {CUDA0: "event0"}))
    for d in (CUDA0, CUDA1):
        [made] = positions(steps, "stream", d)
        waits = [i for i, s in enumerate(steps) if s[0] in ("wait_event", "wait_stream") and s[1] == d]
        copies = [i for i, s in enumerate(steps) if s[0] == "copy" and s[2] == d]
        [synced] = positions(steps, "synchronize", d)
        assert len(waits) == 1 and made < waits[0] < min(copies) and max(copies) < synced
    assert ("wait_event", CUDA0, "event0") in steps  # the event recorded at save() time
    assert ("wait_stream", CUDA1) in steps  # no event for this device: the current stream
    assert [s[1] for s in steps if s[0] == "copy"] == list(range(5))  # every source copied once, in order


def test_a_side_stream_is_selected_once_per_run_of_copies_from_its_device():
    """Selecting a stream costs more than copying a small tensor: a state of thousands of tensors on one GPU
    selects its side stream once, and every CUDA copy runs while its own device's stream is selected."""
    devices = [CUDA0, CUDA0, None, CUDA0, CUDA1, CUDA1, CUDA0]
    steps = list(stream_steps(devices, {}))
    assert [s for s in steps if s[0] == "select"] == [("select", CUDA0), ("select", CUDA1), ("select", CUDA0)]
    selected = None
    for s in steps:
        if s[0] == "select":
            selected = s[1]
        elif s[0] == "deselect":
            selected = None
        elif s[0] == "copy" and s[2] is not None:
            assert selected == s[2]
    deselect = steps.index(("deselect",))
    assert deselect > max(i for i, s in enumerate(steps) if s[0] == "copy")
    assert deselect < min(i for i, s in enumerate(steps) if s[0] == "synchronize")
    assert list(stream_steps([CUDA0] * 1000, {})).count(("select", CUDA0)) == 1


def test_cpu_only_sources_need_no_stream_operation():
    assert list(stream_steps([None, None], {})) == [("copy", 0, None), ("copy", 1, None)]


def test_stage_copies_cpu_tensors_into_the_buffer():
    tensors = [torch.arange(10, dtype=torch.float32), torch.ones(3, 4, dtype=torch.float64)]
    descriptors = [(f"t{i}", str(t.dtype), t.element_size(), tuple(t.shape), (0,) * t.dim(), tuple(t.shape))
                   for i, t in enumerate(tensors)]
    plan = build_plan(("k",), [descriptors], 0, 1 << 20)
    buf = StagingBuffer(plan.nbytes, pin=False)
    stage(plan, tensors, buf)
    views = buf.views_for(plan)
    assert all(torch.equal(v, tensors[c.index]) for v, c in zip(views, plan.local))
