"""DTensor helpers: which box of a global tensor this rank holds. Plain tensors are their own single box."""
from __future__ import annotations

from typing import Any

import torch

from ..errors import StateError


def is_dtensor(t: torch.Tensor) -> bool:
    return type(t).__name__ == "DTensor"


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if is_dtensor(t) else t


def local_box(t: torch.Tensor) -> tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]:
    """(global shape, global offsets, local sizes) of the part of `t` this rank holds."""
    if not is_dtensor(t):
        return tuple(t.shape), (0,) * t.dim(), tuple(t.shape)
    placements = tuple(t.placements)
    if any(p.is_partial() for p in placements):
        raise StateError("a DTensor with a Partial placement must be reduced (redistribute) before saving")
    shape, coordinate = tuple(t.shape), t.device_mesh.get_coordinate()
    key = (shape, tuple(t.device_mesh.shape), None if coordinate is None else tuple(coordinate), placements)
    try:
        box = _boxes.get(key)
    except TypeError:  # a placement that cannot be hashed (a user's own): not remembered
        key, box = None, None
    if box is None:
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

        sizes, offsets = compute_local_shape_and_global_offset(shape, t.device_mesh, placements)
        box = tuple(sizes), tuple(offsets)
        if key is not None:
            if len(_boxes) >= 4096:
                _boxes.clear()
            _boxes[key] = box
    return shape, box[1], box[0]


# (global shape, mesh shape, this rank's place in the mesh, placements) -> (local sizes, global offsets): all
# that DTensor's computation reads of the mesh, which takes 10-100 µs a call; a parameter and its optimizer
# states share one layout, and a load asked for it twice per tensor. No mesh is held: groups are not kept alive.
_boxes: dict[tuple[Any, ...], tuple[tuple[int, ...], tuple[int, ...]]] = {}


def layout_key(t: torch.Tensor) -> tuple[Any, ...]:
    """How `t` is laid out over ranks, as a tuple that keys can be concatenated from unambiguously: its number
    of dimensions and shape, and for a DTensor (marked by a leading -1) also its placements and device mesh."""
    if not is_dtensor(t):
        return (t.dim(), *t.shape)
    return -1, t.shape, tuple(t.placements), tuple(t.device_mesh.mesh.flatten().tolist()), tuple(t.device_mesh.shape)
