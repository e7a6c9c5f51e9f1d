"""Device → host copies launched while the state is still being walked.

A save of GPU tensors blocks for the walk of the state (`flatten`), the plan's key, then the copy; the copy is
DMA that needs no CPU, so the Python before it is time the link sits idle (a third of a 1 GiB save on an H200).
Saves are SPMD and a state keeps its structure from one save to the next, so the last staging of a plan says
where each tensor will go: `EarlyCopies` remembers it, and the next save, holding a buffer for that plan
before it walks, launches each large CUDA tensor's copy (over 1 MiB) on its side stream as soon as the walk
reaches it.

A launch is a guess, checked twice: each copy only where the tensor's device, dtype and shape are those of
its place in the buffer, and the whole only where the walked state then gets the same plan (its key: names,
dtypes, shapes, placements). Otherwise the launched copies are waited for and the save stages as if none had
been made. Small tensors are left to the gather (gather.py); host tensors to the staging thread.
"""
from __future__ import annotations

import contextlib
import threading
from typing import TYPE_CHECKING, Any, Mapping, NamedTuple, Sequence

import torch

from ..distributed.dtensor import local_tensor
from .gather import SMALL

if TYPE_CHECKING:
    from .plan import Plan
    from .staging_buffer import StagingBuffer


class Learned(NamedTuple):
    """Where one plan's boxes come from, as its last staging found them (one object, replaced whole: a launch
    made from it never sees half of a newer one)."""

    plan: Plan
    devices: list[Any]  # per box of plan.local: its source's CUDA device, None on the host
    rows: dict[int, list[int]]  # tensor index (in the walk) → the boxes launched from it
    device_of: dict[int, int]  # tensor index → its device index (-1: host), for every box's source
    cuda: list[torch.device]  # the CUDA devices of the boxes' sources


class EarlyCopies:
    """What the last staging of a plan learned: each box's source device, and which boxes to launch early
    (CUDA ones that the gather leaves alone). One per engine; `learn` runs in the staging thread."""

    def __init__(self, *, min_bytes: int = SMALL + 1, host_sources: bool = False):
        # smaller boxes are many and cheap to move: their copies cost launches, not link time, and the gather
        # (or the staging thread) makes them after the walk; launching them here would only slow the walk
        self.min_bytes = min_bytes
        self.host_sources = host_sources  # launch host tensors' copies too (for CPU tests of the same logic)
        self.learned: Learned | None = None

    def learn(self, plan: Plan, devices: Sequence[Any], gathered: set[int]) -> None:
        known = self.learned
        if known is not None and plan is known.plan and devices == known.devices:
            return
        rows: dict[int, list[int]] = {}
        device_of: dict[int, int] = {}
        local = plan.local
        for r, (index, nbytes, device) in enumerate(zip(local.index, local.nbytes, devices)):
            device_of[index] = -1 if device is None else device.index
            if nbytes >= self.min_bytes and r not in gathered and (device is not None or self.host_sources):
                rows.setdefault(index, []).append(r)
        self.learned = Learned(plan, list(devices), rows, device_of,
                               sorted({d for d in devices if d is not None}, key=str))

    def launch(self, known: Learned, buffer: StagingBuffer, events: Mapping[torch.device, Any]) -> Launch:
        """A launch into `buffer` of what `known` (this object's `learned`, read once by the caller) says."""
        return Launch(known, buffer, events)


class Launch:
    """One save's early copies. In one thread, `launch.start()` then `flatten(state, on_tensor=launch.on_tensor,
    on_state_dict=launch.on_state_dict)`; then handed to `copy.stage`, which keeps them (`fits`) or waits for
    them and stages everything itself. `close()` (any thread) stops further launches: a walk
    that goes on after its save was cancelled queues nothing into a buffer that went back to the pool."""

    def __init__(self, learned: Learned, buffer: StagingBuffer, events: Mapping[torch.device, Any]):
        self.plan, self.devices, self.rows, self.device_of, self.cuda = learned
        self.buffer = buffer
        self.events = events
        self.views: list[torch.Tensor] = []
        self.streams: dict[torch.device, Any] = {}
        self.launched: set[int] = set()  # boxes whose copy is queued (or done, on the host)
        self.ok = True  # every tensor walked so far matched its place
        self.closed = False
        self._lock = threading.Lock()  # a launch in progress, against close()

    def start(self) -> None:
        """The buffer's views and the side streams, ordered after the producer (in the walk's thread: a new
        buffer makes its views here)."""
        self.views = self.buffer.views_for(self.plan)
        for d in self.cuda:
            stream = self.streams[d] = torch.cuda.Stream(device=d)
            if d in self.events:  # ordered after the producer, as the staging thread orders its own copies
                stream.wait_event(self.events[d])
            else:
                stream.wait_stream(torch.cuda.current_stream(d))

    def on_state_dict(self) -> None:
        """The walk called a stateful object's state_dict(), which may have queued kernels that make the tensors
        it returned (on this thread's current stream): later copies wait for them."""
        for d, stream in self.streams.items():
            stream.wait_stream(torch.cuda.current_stream(d))

    def on_tensor(self, index: int, value: torch.Tensor) -> None:
        """The walk reached tensor `index`: launch its boxes' copies if it is what the plan expects there."""
        expected = self.device_of.get(index)
        if expected is None or not self.ok:
            return  # a tensor this rank does not write (another replica writes it), or the guess already failed
        src = local_tensor(value)
        if src.get_device() != expected:  # (the plan's key holds no device) the staging thread decides anew
            self.ok = False
            return
        rows = self.rows.get(index)
        if rows is None:
            return
        local = self.plan.local
        try:
            for r in rows:
                dim0 = local.dim0[r]
                piece = src if dim0 is None else src.narrow(0, *dim0)
                dst = self.views[r]
                if piece.dtype != dst.dtype or piece.shape != dst.shape:
                    self.ok = False
                    return
                with self._lock:
                    if self.closed:
                        self.ok = False
                        return
                    # the side stream is current only for the copy (user state_dict() code runs on its own
                    # streams), and grad mode is off only for it (a copy from a parameter records nothing)
                    with torch.no_grad(), (torch.cuda.stream(self.streams[torch.device("cuda", expected)])
                                           if expected >= 0 else contextlib.nullcontext()):
                        dst.copy_(piece, non_blocking=expected >= 0)
                    self.launched.add(r)
        except Exception:  # e.g. a broken device: the staging thread copies again and raises what it finds
            self.ok = False

    def fits(self, plan: Plan, devices: Sequence[Any]) -> bool:
        """Whether the staging of `plan`, whose sources are on `devices`, can keep these copies."""
        return self.ok and plan is self.plan and devices == self.devices

    def close(self) -> None:
        """No launch after this returns (one in progress finishes first)."""
        with self._lock:
            self.closed = True

    def synchronize(self) -> None:
        """Wait for every launched copy (before the buffer is written again, or handed back)."""
        for stream in self.streams.values():
            stream.synchronize()
