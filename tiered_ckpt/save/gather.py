"""Small GPU tensors gathered on the GPU before they cross to the host.

A device → host copy costs about 10 µs of launch and DMA set-up whatever its size, so a state with many small
tensors (biases, norms: 1,638 of 64 KiB in the benchmark's 1 GiB) spends more on launching copies than on
moving bytes. Small CUDA sources are therefore copied, with one multi-tensor kernel (`torch._foreach_copy_`),
into a scratch buffer on their GPU laid out exactly like their stretch of the staging buffer, and each run of
them that sits side by side in the staging buffer then crosses in one copy. The scratch and its views are made
once per plan and device and kept for the next saves (at most `gpu_gather` bytes per device: what does not fit
is copied tensor by tensor, as before).
"""
from __future__ import annotations

import logging
import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Sequence

import torch

from ..sizes import format_size
from .plan import ALIGN

if TYPE_CHECKING:
    from .plan import LocalCopy, Plan

log = logging.getLogger(__name__)
SMALL = 1 << 20  # a source up to this many bytes is gathered; a larger one's own copy runs at full bandwidth


@dataclass(frozen=True)
class Run:
    """Sources that lie side by side in the staging buffer (apart from the alignment padding between them):
    scratch[start:start + nbytes] crosses to buffer[offset:offset + nbytes] in one copy. The padding in the
    scratch is zeros, as in a buffer that was never written there."""

    start: int
    offset: int
    nbytes: int
    indexes: tuple[int, ...]  # the sources, into plan.local, in buffer order


def gather_runs(local: Sequence[LocalCopy], devices: Sequence[Any], limit: int,
                small: int = SMALL) -> dict[Any, list[Run]]:
    """Per CUDA device (`devices[i]`: the device of source i, None for a host source), the runs of small
    sources to gather, within `limit` bytes of scratch each. A run has two sources or more (a lone small source
    gains nothing); empty sources are never gathered."""
    chosen: dict[Any, list[int]] = {}
    for i, c in enumerate(local):
        if devices[i] is not None and 0 < c.nbytes <= small:
            chosen.setdefault(devices[i], []).append(i)
    out: dict[Any, list[Run]] = {}
    for d, indexes in chosen.items():
        indexes.sort(key=lambda i: local[i].offset)
        groups: list[list[int]] = []  # side by side (apart from alignment padding)
        for i in indexes:
            if groups and 0 <= local[i].offset - _end(local[groups[-1][-1]]) < ALIGN:
                groups[-1].append(i)
            else:
                groups.append([i])
        runs: list[Run] = []
        start = 0
        for g in (g for g in groups if len(g) > 1):  # lone sources take no scratch
            start = -(-start // ALIGN) * ALIGN  # each run starts aligned: its views may be of any dtype
            kept = [i for i in g if start + _end(local[i]) - local[g[0]].offset <= limit]  # a long one is cut
            if len(kept) < 2:
                break  # the scratch is full
            nbytes = _end(local[kept[-1]]) - local[kept[0]].offset
            runs.append(Run(start, local[kept[0]].offset, nbytes, tuple(kept)))
            start += nbytes
        if runs:
            out[d] = runs
    return out


def _end(c: LocalCopy) -> int:
    return c.offset + c.nbytes


class Layout:
    """One device's scratch for one plan: the typed views the gathered sources are copied into, and the runs."""

    def __init__(self, local: Sequence[LocalCopy], runs: list[Run], device: Any):
        self.runs = runs
        self.scratch = torch.zeros(max(r.start + r.nbytes for r in runs), dtype=torch.uint8, device=device)
        # the zeros are written on this thread's current stream; the gathers run on a side stream, which waits
        # for this event before the first of them (else a queued zero-fill could land between gather and copy)
        self.made = torch.cuda.current_stream(self.scratch.device).record_event() if self.scratch.is_cuda else None
        self.indexes = [i for r in runs for i in r.indexes]
        self.views = []
        for r in runs:
            for i in r.indexes:
                c = local[i]
                at = r.start + c.offset - r.offset
                self.views.append(self.scratch[at:at + c.nbytes].view(c.dtype).view(c.shape))

    def copy(self, sources: Sequence[torch.Tensor], buffer: torch.Tensor) -> None:
        """Gather on the current stream of the scratch's device, then one copy per run to `buffer` (a flat
        uint8 tensor: the staging buffer). Asynchronous on a GPU: the caller synchronizes the stream."""
        if self.made is not None:  # once: the first staging synchronizes its stream, so later ones find it done
            torch.cuda.current_stream(self.scratch.device).wait_event(self.made)
            self.made = None
        torch._foreach_copy_(self.views, [sources[i] for i in self.indexes])
        for r in self.runs:
            buffer[r.offset:r.offset + r.nbytes].copy_(self.scratch[r.start:r.start + r.nbytes], non_blocking=True)


class Gatherer:
    """The layouts of the current plan, per device, kept between saves (the engine holds one, in its staging
    pool). `limit` bytes of scratch per device at most; 0 gathers nothing."""

    def __init__(self, limit: int):
        self.limit = limit
        self.lock = threading.Lock()  # held by a staging for as long as its gathers may run (copy.stage)
        self._plan: Plan | None = None  # the plan the layouts are for (the planner hands out one object per plan)
        self._devices: list[Any] = []  # and its sources' devices
        self._layouts: dict[Any, Layout] = {}

    def layouts(self, plan: Plan, devices: Sequence[Any]) -> dict[Any, Layout]:
        """The layout of every device that has runs to gather in `plan` (made at the first save of a plan)."""
        if not self.limit:
            return {}
        if self._plan is not plan or self._devices != devices:  # (the plan's key holds no device: a tensor
            self.clear()  # moved to another GPU keeps the plan) the old scratch goes before the new is made
            layouts = {}
            for d, runs in gather_runs(plan.local, devices, self.limit).items():
                try:
                    layouts[d] = Layout(plan.local, runs, d)
                except torch.cuda.OutOfMemoryError:  # training holds the GPU's memory: copy tensor by tensor
                    log.warning("no room on %s for %s of scratch to gather small tensors in; they are copied one "
                                "by one (lower [engine] gpu_gather, or 0 to stop trying)", d,
                                format_size(max(r.start + r.nbytes for r in runs)))
            self._plan, self._devices, self._layouts = plan, list(devices), layouts
        return self._layouts

    @property
    def nbytes(self) -> int:
        """GPU memory the kept scratch buffers hold."""
        return sum(layout.scratch.numel() for layout in self._layouts.values())

    def clear(self) -> None:
        self._plan, self._devices, self._layouts = None, [], {}
