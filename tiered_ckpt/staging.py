"""Host staging buffers, reused across saves, and the copy of a state's tensors into them.

A buffer is one flat uint8 tensor (pinned when CUDA is present, so device-to-host copies are DMA on a
side stream). Buffers are allocated once, touched once (first-touch page faults cost 4-5x a memcpy), and
then recycled: a save never allocates host memory proportional to the state after the first one.
At most `max_inflight` buffers exist; a save that needs one waits for a release, it never drops.
"""
from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Any, Mapping, Sequence

import torch

from .distributed.dtensor import local_tensor

if TYPE_CHECKING:  # plan.py uses tensor_bytes from here
    from .plan import Plan


def tensor_bytes(t: torch.Tensor) -> memoryview:
    """A writable byte view of a contiguous CPU tensor's memory (no copy). The view holds a reference to
    the tensor's storage (through a uint8 view and its numpy array), so memory can never be freed under a
    thread that still reads or writes it, e.g. after a timed-out or cancelled read."""
    if t.device.type != "cpu" or not t.is_contiguous():
        raise ValueError("tensor_bytes needs a contiguous CPU tensor")
    return memoryview(t.detach().reshape(-1).view(torch.uint8).numpy()).cast("B")


class StagingBuffer:
    def __init__(self, nbytes: int, pin: bool):
        self.tensor = torch.empty(max(nbytes, 1), dtype=torch.uint8, pin_memory=pin)
        self.tensor.zero_()  # touch every page now, not during a save
        self.view = tensor_bytes(self.tensor)
        self.pinned = pin
        self._views: tuple[tuple, list[torch.Tensor]] | None = None  # (plan key, typed views) of the last plan

    def views_for(self, plan: Plan) -> list[torch.Tensor]:
        """Typed, shaped views of this buffer at the plan's offsets; built once per plan, not per save."""
        if self._views is None or self._views[0] is not plan.key:
            views = [self.tensor[c.offset : c.offset + c.nbytes].view(c.dtype).view(c.shape) for c in plan.local]
            self._views = (plan.key, views)
        return self._views[1]

    @property
    def capacity(self) -> int:
        return self.tensor.numel()


class StagingPool:
    def __init__(self, max_inflight: int, *, pin: bool | None = None):
        self.max_inflight = max_inflight
        self.pin = torch.cuda.is_available() if pin is None else pin
        self._free: list[StagingBuffer] = []
        self._count = 0
        self._cond = asyncio.Condition()

    @property
    def exhausted(self) -> bool:
        return not self._free and self._count >= self.max_inflight

    async def acquire(self, nbytes: int) -> StagingBuffer:
        async with self._cond:
            await self._cond.wait_for(lambda: self._free or self._count < self.max_inflight)
            buf = next((b for b in self._free if b.capacity >= nbytes), None)
            if buf is not None:
                self._free.remove(buf)
                return buf
            if self._free:  # too small for a grown state: replace it
                self._free.pop()
                self._count -= 1
            self._count += 1
        try:
            return await asyncio.to_thread(StagingBuffer, nbytes, self.pin)
        except BaseException:
            async with self._cond:
                self._count -= 1
                self._cond.notify()
            raise

    async def release(self, buf: StagingBuffer) -> None:
        async with self._cond:
            self._free.append(buf)
            self._cond.notify()

    def clear(self) -> None:
        self._free.clear()
        self._count = 0

    @property
    def held_bytes(self) -> int:
        return sum(b.capacity for b in self._free)


def producer_events(tensors: Sequence[torch.Tensor] | None = None) -> dict[torch.device, Any]:
    """For each CUDA device that `tensors` live on (None: the current device), an event recorded now on the
    calling thread's current stream: the point after which the tensors hold the values to save. Staging
    copies wait for it, so a copy can never read a tensor before a pending kernel (the optimizer step, the
    forward) has written it. Record it in the thread that runs the training step. Empty without CUDA."""
    if not torch.cuda.is_available():
        return {}
    if tensors is None:
        devices = {torch.device("cuda", torch.cuda.current_device())}
    else:
        devices = {local_tensor(t).device for t in tensors if local_tensor(t).is_cuda}
    return {d: torch.cuda.current_stream(d).record_event() for d in devices}


def stream_steps(devices: Sequence[torch.device | None], events: Mapping[torch.device, Any]) -> list[tuple[Any, ...]]:
    """The order of operations that copies sources on `devices` (None for a CPU source) to host memory:
    for each CUDA device, a side stream that first waits for the producer (its event, or else the current
    stream of the copying thread), then the copies (CUDA ones on their device's side stream), then every
    side stream synchronized, so the buffer holds the data when staging returns. Kept apart from the CUDA
    calls so that a CPU test can check the ordering."""
    cuda_devices = sorted({d for d in devices if d is not None}, key=str)
    steps: list[tuple[Any, ...]] = []
    for d in cuda_devices:
        steps.append(("stream", d))
        steps.append(("wait_event", d, events[d]) if d in events else ("wait_stream", d))
    steps += [("copy", i, d) for i, d in enumerate(devices)]
    steps += [("synchronize", d) for d in cuda_devices]
    return steps


def stage(plan: Plan, tensors: Sequence[torch.Tensor], buf: StagingBuffer,
          events: Mapping[torch.device, Any] | None = None) -> None:
    """Copy this rank's boxes into `buf` at the plan's offsets. Runs in a worker thread (copy_ drops the
    GIL). CUDA tensors are copied on side streams ordered after `events` (see stream_steps)."""
    sources = []
    for c in plan.local:
        src = local_tensor(tensors[c.index])
        sources.append(src if c.dim0 is None else src.narrow(0, *c.dim0))
    views = buf.views_for(plan)
    streams: dict[torch.device, Any] = {}
    with torch.no_grad():
        for step in stream_steps([s.device if s.is_cuda else None for s in sources], events or {}):
            op, *args = step
            if op == "stream":
                streams[args[0]] = torch.cuda.Stream(device=args[0])
            elif op == "wait_event":
                streams[args[0]].wait_event(args[1])
            elif op == "wait_stream":
                streams[args[0]].wait_stream(torch.cuda.current_stream(args[0]))
            elif op == "copy":
                index, device = args
                src, dst = sources[index], views[index]
                if device is None:
                    dst.copy_(src)
                else:
                    with torch.cuda.stream(streams[device]):
                        dst.copy_(src, non_blocking=True)
            else:  # synchronize
                streams[args[0]].synchronize()
