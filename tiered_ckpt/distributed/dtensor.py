"""DTensor helpers: which box of a global tensor this rank holds. Plain tensors are their own single box."""
from __future__ import annotations

import functools
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
    coordinate = t.device_mesh.get_coordinate()
    sizes, offsets = _box_of(tuple(t.shape), t.device_mesh, placements, None if coordinate is None else tuple(coordinate))
    return tuple(t.shape), offsets, sizes


@functools.lru_cache(maxsize=4096)
def _box_of(shape: tuple[int, ...], mesh: Any, placements: tuple[Any, ...],
            coordinate: tuple[int, ...] | None) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(local sizes, global offsets) of the box that the rank at `coordinate` of `mesh` holds, once per layout: a
    parameter and its optimizer states share one, and DTensor's computation takes 10-100 µs a call (a load of
    a model with AdamW asked for it twice per tensor). Keyed by the rank's place in the mesh too: a process that
    joins another group as another rank gets its own answer."""
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    sizes, offsets = compute_local_shape_and_global_offset(shape, mesh, placements)
    return tuple(sizes), tuple(offsets)


def layout_key(t: torch.Tensor) -> tuple[Any, ...]:
    """How `t` is laid out over ranks, as a tuple that keys can be concatenated from unambiguously: its number
    of dimensions and shape, and for a DTensor (marked by a leading -1) also its placements and device mesh."""
    if not is_dtensor(t):
        return (t.dim(), *t.shape)
    return -1, t.shape, tuple(t.placements), tuple(t.device_mesh.mesh.flatten().tolist()), tuple(t.device_mesh.shape)
