"""The staging copy: a state's tensors into a host buffer, at the plan's offsets, in a worker thread.

CUDA tensors are copied on a side stream per device, ordered after the point where the training step
produced them (`producer_events`), so a copy never reads a tensor before a pending kernel wrote it.
"""
from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Any, Callable, Collection, Iterator, Mapping, Sequence

import torch

from ..distributed.dtensor import local_tensor

if TYPE_CHECKING:
    from .early import EarlyCopies, Launch
    from .gather import Gatherer
    from .plan import Plan
    from .staging_buffer import StagingBuffer


def producer_events(tensors: Sequence[torch.Tensor] | None = None, *,
                    devices: Sequence[torch.device] | None = None) -> dict[torch.device, Any]:
    """For each CUDA device that `tensors` live on (or each of `devices`; neither: the current device), an
    event recorded now on the calling thread's current stream: the point after which the tensors hold the
    values to save. Staging copies wait for it, so a copy can never read a tensor before a pending kernel (the
    optimizer step, the forward) has written it. Record it in the thread that runs the training step. Empty
    without CUDA."""
    if not torch.cuda.is_available():
        return {}
    if devices is not None:  # known already (early.py: the last staging's)
        indexes = {d.index for d in devices}
    elif tensors is None:
        indexes = {torch.cuda.current_device()}
    else:  # get_device(): an int (-1 on the host), cheaper than a torch.device per tensor of 100k
        indexes = {t.get_device() for t in map(local_tensor, tensors) if t.is_cuda}
    devices = [torch.device("cuda", i) for i in sorted(indexes)]
    return {d: torch.cuda.current_stream(d).record_event() for d in devices}


def stream_steps(devices: Sequence[torch.device | None], events: Mapping[torch.device, Any],
                 gathers: Collection[torch.device] = (), skip: Collection[int] = ()) -> Iterator[tuple[Any, ...]]:
    """The order of operations that copies sources on `devices` (None for a CPU source) to host memory:
    for each CUDA device, a side stream that first waits for the producer (its event, or else the current
    stream of the copying thread), then on each device of `gathers` its small sources gathered and copied
    (gather.py), then the other copies (all but `skip`, the gathered ones; CUDA ones on their device's side
    stream, selected once per run of copies from that device: selecting a stream costs more than a small
    copy), then every side stream synchronized, so the buffer holds the data when staging returns. Kept apart
    from the CUDA calls so that a CPU test can check the ordering. A generator: no list of a step per tensor."""
    cuda_devices = sorted({d for d in devices if d is not None}, key=str)
    for d in cuda_devices:
        yield "stream", d
        yield ("wait_event", d, events[d]) if d in events else ("wait_stream", d)
    selected = None
    for d in sorted(gathers, key=str):
        yield "select", d
        selected = d
        yield "gather", d
    for i, d in enumerate(devices):
        if i in skip:
            continue
        if d is not None and d != selected:
            yield "select", d
            selected = d
        yield "copy", i, d
    if selected is not None:
        yield ("deselect",)
    for d in cuda_devices:
        yield "synchronize", d


PIECE = 4 << 20  # a large tensor is copied in pieces of this many bytes, each reported as it lands


def _copy_reporting(src: torch.Tensor, dst: torch.Tensor, offset: int, report: Callable[[int], None]) -> None:
    """Copy, reporting progress piece by piece, so the bytes are hashed right behind the copy, in cache."""
    nbytes = dst.numel() * dst.element_size()
    if nbytes <= PIECE or not src.is_contiguous():
        dst.copy_(src)
        report(offset + nbytes)
        return
    flat_src, flat_dst = src.reshape(-1), dst.view(-1)
    per_piece = max(PIECE // dst.element_size(), 1)
    for at in range(0, flat_dst.numel(), per_piece):
        end = min(at + per_piece, flat_dst.numel())
        flat_dst[at:end].copy_(flat_src[at:end])
        report(offset + end * dst.element_size())


def _sources(plan: Plan, tensors: Sequence[torch.Tensor]) -> tuple[list[torch.Tensor], list[Any]]:
    """The local tensor (rows) each box of the plan is copied from, and its CUDA device (None on the host)."""
    sources = [local_tensor(tensors[i]) for i in plan.local.index]
    for at, dim0 in enumerate(plan.local.dim0):
        if dim0 is not None:
            sources[at] = sources[at].narrow(0, *dim0)
    return sources, [s.device if s.is_cuda else None for s in sources]


def prepare(plan: Plan, tensors: Sequence[torch.Tensor], gatherer: Gatherer | None,
            early: EarlyCopies | None) -> None:
    """What the first staging of `plan` would make, made ahead (`Engine.reserve`): the gather's GPU scratch,
    and what `early` learns, so the first save already launches its copies during the walk."""
    _, devices = _sources(plan, tensors)
    gathered: set[int] = set()
    if gatherer is not None and any(d is not None for d in devices):
        with gatherer.lock:
            gathered = {i for layout in gatherer.layouts(plan, devices).values() for i in layout.indexes}
    if early is not None:
        early.learn(plan, devices, gathered)


def stage(plan: Plan, tensors: Sequence[torch.Tensor], buf: StagingBuffer,
          events: Mapping[torch.device, Any] | None = None, staged_up_to: Callable[[int], None] | None = None,
          gatherer: Gatherer | None = None, launch: Launch | None = None, early: EarlyCopies | None = None) -> None:
    """Copy this rank's boxes into `buf` at the plan's offsets. Runs in a worker thread (copy_ drops the
    GIL). CUDA tensors are copied on side streams ordered after `events` (see stream_steps), small ones
    gathered on their GPU first where `gatherer` has room (gather.py).
    `staged_up_to(n)`: the first n bytes of the buffer hold their final bytes (called as CPU copies progress,
    so parts can be checksummed while later ones are still being copied; once more at the end). Never called
    when a source is on a GPU or the plan is out of buffer order: nothing is known until the end then.
    `launch`: copies already launched during the walk (early.py), kept where they fit this plan and these
    sources, else waited for and made again. `early` learns from a staging that succeeded."""
    local = plan.local
    report = staged_up_to if local.in_order else None
    sources, devices = _sources(plan, tensors)
    views = buf.views_for(plan)
    gathering = gatherer is not None and any(d is not None for d in devices)
    if launch is not None and not launch.fits(plan, devices):
        launch.synchronize()  # the guess was wrong: its copies land before this staging writes the buffer again
        launch = None
    streams: dict[torch.device, Any] = dict(launch.streams) if launch is not None else {}
    ready = set(streams)  # side streams made, and ordered after the producer, by the launch
    selected: list[Any] = []  # the side stream's context while it is the current stream
    with contextlib.ExitStack() as held, torch.no_grad():
        layouts: dict[Any, Any] = {}
        if gathering:  # one staging at a time uses the gather scratch (two saves in flight may stage at once):
            assert gatherer is not None  # held until the side streams are synchronized, so a second gather
            held.enter_context(gatherer.lock)  # never overwrites a scratch whose copy is still running
            layouts = gatherer.layouts(plan, devices)
            if not layouts:  # nothing to gather in this plan: other stagings need not wait
                held.close()
        gathered = {i for layout in layouts.values() for i in layout.indexes}
        skip = gathered | launch.launched if launch is not None else gathered
        try:  # on any error, the side streams' queued copies finish before the buffer can go back to the pool
            for step in stream_steps(devices, events or {}, layouts.keys(), skip):
                op = step[0]
                if op == "copy":  # first: one per tensor
                    _, index, device = step
                    src, dst = sources[index], views[index]
                    if device is not None:
                        dst.copy_(src, non_blocking=True)  # on the selected side stream
                    elif report is not None and not streams:
                        _copy_reporting(src, dst, local.offset[index], report)
                    else:
                        dst.copy_(src)
                elif op in ("stream", "wait_event", "wait_stream") and step[1] in ready:
                    pass
                elif op == "stream":
                    streams[step[1]] = torch.cuda.Stream(device=step[1])
                elif op == "wait_event":
                    streams[step[1]].wait_event(step[2])
                elif op == "wait_stream":
                    streams[step[1]].wait_stream(torch.cuda.current_stream(step[1]))
                elif op in ("select", "deselect"):
                    if selected:
                        selected.pop().__exit__(None, None, None)
                    if op == "select":
                        context = torch.cuda.stream(streams[step[1]])
                        context.__enter__()
                        selected.append(context)
                elif op == "gather":
                    layouts[step[1]].copy(sources, buf.tensor)  # on the selected side stream
                else:  # synchronize
                    streams[step[1]].synchronize()
        except BaseException:
            for stream in streams.values():
                try:
                    stream.synchronize()
                except Exception:  # a broken device: the error being raised says more
                    pass
            raise
        finally:
            if selected:
                selected.pop().__exit__(None, None, None)
    # hashed behind the copy only where the copy reported its progress; else every part is hashed at once,
    # each in a thread of its own (faster than one stream over the whole buffer)
    if report is not None and not streams:
        report(buf.view.nbytes)
    if early is not None:
        early.learn(plan, devices, gathered)
