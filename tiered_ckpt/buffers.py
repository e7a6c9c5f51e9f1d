"""Byte views of tensor memory: how every layer hands bytes around without copying them."""
from __future__ import annotations

import torch


def tensor_bytes(t: torch.Tensor) -> memoryview:
    """A writable byte view of a contiguous CPU tensor's memory (no copy). The view holds a reference to
    the tensor's storage (through a uint8 view and its numpy array), so memory can never be freed under a
    thread that still reads or writes it, e.g. after a timed-out or cancelled read."""
    if t.device.type != "cpu" or not t.is_contiguous():
        raise ValueError("tensor_bytes needs a contiguous CPU tensor")
    return memoryview(t.detach().reshape(-1).view(torch.uint8).numpy()).cast("B")


def empty_bytes(nbytes: int) -> memoryview:
    """`nbytes` of writable memory, not zero-filled (a bytearray of a part's size writes every page once more
    than needed, and does it on whichever thread asks: on the event loop that is a stall)."""
    return tensor_bytes(torch.empty(max(nbytes, 1), dtype=torch.uint8))[:nbytes]


class DeviceBytes:
    """The bytes of a contiguous tensor in GPU memory, as a load's reads fill them: sliced like a memoryview,
    and written with `sink[a:b] = data` (a host → device copy from wherever `data` lies). A load scatters each
    verified chunk straight from its read buffer into the GPU target this way: no host copy of the whole state
    in between, whose memory (faulted in, or pinned) costs more than the reads themselves
    (docs/benchmarks.md, GPU)."""

    def __init__(self, t: torch.Tensor, start: int = 0, stop: int | None = None):
        if not t.is_contiguous():
            raise ValueError("DeviceBytes needs a contiguous tensor")
        self.tensor = t.detach().reshape(-1).view(torch.uint8)  # shares the target's memory
        self.start = start
        self.stop = self.tensor.numel() if stop is None else stop

    def __len__(self) -> int:
        return self.stop - self.start

    def _range(self, key: slice) -> tuple[int, int]:
        if not isinstance(key, slice):
            raise TypeError(f"DeviceBytes takes slices, not {type(key).__name__}")
        lo, hi, step = key.indices(len(self))
        if step != 1:
            raise ValueError("DeviceBytes slices are contiguous")
        return self.start + lo, self.start + max(hi, lo)

    def __getitem__(self, key: slice) -> "DeviceBytes":
        lo, hi = self._range(key)
        return DeviceBytes(self.tensor, lo, hi)

    def __setitem__(self, key: slice, data: bytes | memoryview) -> None:
        lo, hi = self._range(key)
        view = memoryview(data).cast("B")
        if len(view) != hi - lo:
            raise ValueError(f"{len(view)} bytes for a slice of {hi - lo}")
        if view.readonly:  # torch.frombuffer wants writable memory; a read-only source is copied first
            view = memoryview(bytearray(view))
        if len(view):
            self.tensor[lo:hi].copy_(torch.frombuffer(view, dtype=torch.uint8))

    def as_tensor(self) -> torch.Tensor:
        """The bytes as a uint8 tensor (on the device)."""
        return self.tensor[self.start:self.stop]


def as_byte_tensor(view: memoryview | DeviceBytes) -> torch.Tensor:
    """A uint8 tensor over `view`'s memory, host or device."""
    return view.as_tensor() if isinstance(view, DeviceBytes) else torch.frombuffer(view, dtype=torch.uint8)
