"""Byte views of tensor memory: how every layer hands bytes around without copying them."""
from __future__ import annotations

import bisect
import ctypes
from typing import Any, Iterable, Sequence, Union

import numpy as np
import torch

from .release import empty


def byte_tensor(t: torch.Tensor) -> torch.Tensor:
    """A contiguous tensor's memory as a flat uint8 tensor (no copy; autograd detached)."""
    return t.detach().reshape(-1).view(torch.uint8)


def tensor_bytes(t: torch.Tensor) -> memoryview:
    """A writable byte view of a contiguous CPU tensor's memory (no copy). The view holds a reference to
    the tensor's storage (through a uint8 view and its numpy array), so memory can never be freed under a
    thread that still reads or writes it, e.g. after a timed-out or cancelled read."""
    if t.device.type != "cpu" or not t.is_contiguous():
        raise ValueError("tensor_bytes needs a contiguous CPU tensor")
    return memoryview(byte_tensor(t).numpy()).cast("B")


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
        self.tensor = byte_tensor(t)  # shares the target's memory
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


def as_byte_tensor(view: memoryview | DeviceBytes | torch.Tensor) -> torch.Tensor:
    """A uint8 tensor over `view`'s memory, host or device (a contiguous tensor's own bytes)."""
    if isinstance(view, torch.Tensor):
        return byte_tensor(view)
    return view.as_tensor() if isinstance(view, DeviceBytes) else torch.frombuffer(view, dtype=torch.uint8)


Sink = Union[memoryview, DeviceBytes, torch.Tensor]  # a contiguous CPU tensor: its own bytes
_SKIPPED = None  # a stretch of bytes nobody wants (Sinks.skip): not kept, not copied


class Sinks(Sequence[Any]):
    """The buffers that one part's bytes fill, in order, each kept as what it is with the byte range it takes:
    a CPU tensor's byte view (tensor_bytes: three objects) is made only when the scatter reaches it and is
    dropped after. A load of 100k tensors so holds no view per tensor while it reads; as many views would be
    more for every full collection of Python's garbage collector to walk, and enough to set one off
    (docs/benchmarks.md, many small tensors). Bytes that this rank does not want (other ranks' chunks in a part
    it reads, alignment padding) are skipped: the scatter makes no memory for them and copies nothing there. So
    only verified reads may fill Sinks (they check the bytes before they scatter them; a read that checks
    what landed in its buffers would find nothing kept there). Indexing gives the view of one buffer."""

    def __init__(self) -> None:
        self._items: list[Sink] = []
        self._pointers: list[int] = []  # a tensor's data pointer when it was given (0 for other buffers)
        self._starts: list[int] = []  # where in the item its range begins (bytes)
        self._ends: list[int] = []  # where each buffer ends in the value the buffers fill together

    def append(self, item: Sink, start: int = 0, stop: int | None = None) -> None:
        if isinstance(item, torch.Tensor) and not (item.device.type == "cpu" and item.is_contiguous()
                                                   and not item.is_conj() and not item.is_neg()):
            raise ValueError("a tensor sink must be a contiguous CPU tensor whose bytes are its values (a GPU one "
                             "goes as DeviceBytes; a conjugate or negative view through scratch)")
        end = _nbytes(item) if stop is None else stop
        if not 0 <= start <= end <= _nbytes(item):
            raise ValueError(f"bytes {start}:{end} of a buffer of {_nbytes(item)}")
        self._items.append(item)
        self._pointers.append(item.data_ptr() if isinstance(item, torch.Tensor) else 0)
        self._starts.append(start)
        self._ends.append((self._ends[-1] if self._ends else 0) + end - start)

    def skip(self, nbytes: int) -> None:
        """`nbytes` that the scatter steps over (a stretch of the value no one wants)."""
        if nbytes < 0:
            raise ValueError(f"skip {nbytes} bytes")
        self._items.append(_SKIPPED)
        self._pointers.append(0)
        self._starts.append(0)
        self._ends.append((self._ends[-1] if self._ends else 0) + nbytes)

    def length(self, i: int) -> int:
        return self._ends[i] - (self._ends[i - 1] if i else 0)

    @property
    def nbytes(self) -> int:
        return self._ends[-1] if self._ends else 0

    def __len__(self) -> int:
        return len(self._items)

    def __getitem__(self, i: int) -> Any:  # (Sequence's slice form is not needed: no caller slices)
        item, start = self._items[i], self._starts[i]
        stop = start + self.length(i)
        if item is _SKIPPED:  # memory for the bytes to land in, dropped with the view
            return memoryview(bytearray(self.length(i)))
        if isinstance(item, torch.Tensor):
            return tensor_bytes(item)[start:stop]
        return item[start:stop]

    def release(self) -> None:
        """Drop every buffer, a batch at a time (call it in a thread: at 1M tensors the lists are 4M entries)."""
        for column in (self._items, self._pointers, self._starts, self._ends):
            empty(column)

    def select(self, spans: Iterable[tuple[int, int]]) -> "Sinks":
        """The buffers that begin at these (offset, length) in the value, in order."""
        wanted, out = set(spans), Sinks()
        for i in range(len(self)):
            at = self._ends[i] - self.length(i)
            if self._items[i] is not _SKIPPED and (at, self.length(i)) in wanted:
                out.append(self._items[i], self._starts[i], self._starts[i] + self.length(i))
                out._pointers[-1] = self._pointers[i]  # (as given here: a swap since is still refused)
        return out

    def scatter(self, pieces: Iterable[bytes | memoryview], start: int = 0) -> None:
        """Copy `pieces`, consecutive bytes of the value from byte `start` on, into the buffers (the first one is
        found by bisection, not by walking the ones before it); bytes past the last buffer are dropped. A CPU
        tensor is written at its data pointer (memmove, the GIL released; making its byte view would cost more
        than copying a small tensor's bytes): its storage is held through each copy, so memory is never freed
        under it, and a tensor whose memory was swapped since it was given (`t.data = ...` while an abandoned
        read still runs) is refused, never written at the new place."""
        items, pointers, starts, ends = self._items, self._pointers, self._starts, self._ends
        i, pos = bisect.bisect_right(ends, start), start
        for piece in pieces:
            src, taken = memoryview(piece).cast("B"), 0
            size, address = len(src), 0
            while taken < size and i < len(items):
                begin = ends[i - 1] if i else 0
                n = min(ends[i] - pos, size - taken)
                if n > 0:
                    item, at = items[i], starts[i] + pos - begin
                    if item is _SKIPPED:
                        pass
                    elif isinstance(item, torch.Tensor):
                        storage = item.untyped_storage()  # held through the copy: a swap meanwhile frees nothing
                        if item.data_ptr() != pointers[i]:
                            raise RuntimeError("a tensor being loaded into was given other memory during the load")
                        address = address or _address(src)
                        ctypes.memmove(pointers[i] + at, address + taken, n)
                        del storage
                    else:
                        item[at:at + n] = src[taken:taken + n]
                    pos, taken = pos + n, taken + n
                if pos >= ends[i]:
                    i += 1


def _address(view: memoryview) -> int:
    """Where a (contiguous, non-empty) buffer's bytes are: numpy reads it for read-only buffers too."""
    return int(np.frombuffer(view, dtype=np.uint8).ctypes.data)


def _nbytes(item: Sink) -> int:
    return item.numel() * item.element_size() if isinstance(item, torch.Tensor) else len(item)
