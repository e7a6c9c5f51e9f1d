"""One host staging buffer: a flat uint8 tensor (pinned when CUDA is present, so device-to-host copies are DMA
on a side stream), or the memory tier's own part files mapped side by side (mapped.py). The pool (pool.py)
hands buffers out and takes them back; the arena (arena.py) makes those that are the memory tier's files and
flips `published`. Both import this module; the arena does not import the pool."""
from __future__ import annotations

import functools
from typing import TYPE_CHECKING

import torch

from ..buffers import tensor_bytes
from ..gc_pause import automatic_gc_paused
from ..release import empty

if TYPE_CHECKING:
    from .mapped import MappedParts
    from .plan import Plan


@functools.lru_cache(maxsize=4096)
def _strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    """Row-major strides of a contiguous tensor of `shape` (in elements)."""
    out, stride = [], 1
    for n in reversed(shape):
        out.append(stride)
        stride *= max(n, 1)
    return tuple(reversed(out))


class StagingBuffer:
    def __init__(self, nbytes: int, pin: bool, *, files: MappedParts | None = None):
        self.files = files  # the memory tier's files behind this buffer (None: anonymous memory)
        if files is None:
            self.tensor = torch.empty(max(nbytes, 1), dtype=torch.uint8, pin_memory=pin)
            self.tensor.zero_()  # touch every page now, not during a save
        else:
            self.tensor = files.tensor  # preallocated and populated by MappedParts
        self.view = tensor_bytes(self.tensor)
        self.pinned = files.pinned if files is not None else pin
        self.step: int | None = None  # the memory tier's checkpoint these files hold (retained buffers)
        self.published = False  # the files sit under the memory tier's keys
        self.in_use = False  # a save is reading or writing it (between acquire and release)
        self._views: tuple[tuple, list[torch.Tensor]] | None = None  # (plan key, typed views) of the last plan

    def views_for(self, plan: Plan) -> list[torch.Tensor]:
        """Typed, shaped views of this buffer at the plan's offsets; built once per plan, not per save."""
        if self._views is None or self._views[0] is not plan.key:
            # as_strided on one typed view per dtype: one op and one object per tensor (a slice, then two
            # .view()s, kept two Python objects alive per tensor and took 3x as long); chunks are 64-byte aligned
            typed: dict[torch.dtype, tuple[torch.Tensor, int]] = {}
            views = []
            local = plan.local
            with automatic_gc_paused():  # a view per tensor: 100k objects (gc_pause.py)
                for dtype, shape, offset in zip(local.dtype, local.shape, local.offset):
                    if dtype not in typed:
                        size = dtype.itemsize
                        whole = self.tensor[: self.tensor.numel() // size * size].view(dtype)
                        typed[dtype] = (whole, size)
                    whole, size = typed[dtype]
                    views.append(whole.as_strided(shape, _strides(shape), whole.storage_offset() + offset // size))
            self._views = (plan.key, views)
        return self._views[1]

    @property
    def capacity(self) -> int:
        return self.tensor.numel()

    def drop(self) -> None:
        """Its files (if not the tier's) go, and its memory is unmapped (hundreds of ms for a large state: run
        it in a thread)."""
        if self.files is not None and not self.published:
            self.files.unlink()
        self.unmap()

    def unmap(self) -> None:
        """Let its memory go, and its views with it, a batch at a time; its files stay (run it in a thread: a
        view per tensor is 1M objects at 1M tensors, and freeing them in one go would hold the GIL, so the event
        loop, for a tenth of a second and more; then the unmapping itself)."""
        views, self._views = self._views, None
        if views is not None:
            empty(views[1])
        del views
        self.files = None
        self.tensor = self.view = None  # type: ignore[assignment]  # the last references: unmapped here
