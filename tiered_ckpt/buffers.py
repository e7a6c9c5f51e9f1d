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
