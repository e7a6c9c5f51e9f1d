"""One saved tensor and its chunks, as objects: what a TensorTable (table.py) hands out when a single
tensor is asked for, and what older (format 1 and 2) manifests are decoded from. Light to import: no numpy."""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ..errors import IntegrityError

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class ChunkMeta:
    """A box of a tensor in global coordinates, and where its bytes sit in one rank's packed stream."""

    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    rank: int
    byte_offset: int
    nbytes: int


@dataclass(frozen=True)
class TensorMeta:
    path: str
    dtype: str
    shape: tuple[int, ...]
    chunks: tuple[ChunkMeta, ...]

    @property
    def torch_dtype(self) -> torch.dtype:
        return dtype_from_str(self.dtype)


@functools.lru_cache(maxsize=None)
def dtype_from_str(name: str) -> torch.dtype:
    import torch

    dtype = getattr(torch, name.removeprefix("torch."), None)
    if not isinstance(dtype, torch.dtype):
        raise IntegrityError(f"unknown dtype {name!r} in the manifest (saved by a newer torch?)")
    return dtype
