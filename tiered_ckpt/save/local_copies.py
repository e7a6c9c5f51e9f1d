"""This rank's boxes of a plan: what its staging copies, and where in its stream."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..manifest.table import ColumnRows


@dataclass(frozen=True)
class LocalCopy:
    """One box this rank stages: rows `dim0` (start, length) of its local tensor `index` (all rows if None)."""

    index: int
    dim0: tuple[int, int] | None
    offset: int
    nbytes: int
    shape: tuple[int, ...]
    dtype: torch.dtype


class LocalCopies(ColumnRows[LocalCopy]):
    """This rank's boxes as columns (lists of ints, tuples and dtypes): a plan is cached for as long as the state
    keeps its structure, so a LocalCopy object per tensor would be 100k more objects for every full collection
    of Python's garbage collector to walk (manifest/table.py says why that matters). A LocalCopy is made when one
    is asked for; staging reads the columns."""

    def __init__(self) -> None:
        self.index: list[int] = []
        self.dim0: list[tuple[int, int] | None] = []
        self.offset: list[int] = []
        self.nbytes: list[int] = []
        self.shape: list[tuple[int, ...]] = []
        self.dtype: list[torch.dtype] = []
        self._in_order: bool | None = None

    def append(self, index: int, dim0: tuple[int, int] | None, offset: int, nbytes: int, shape: tuple[int, ...],
               dtype: torch.dtype) -> None:
        self.index.append(index)
        self.dim0.append(dim0)
        self.offset.append(offset)
        self.nbytes.append(nbytes)
        self.shape.append(shape)
        self.dtype.append(dtype)
        self._in_order = None

    @property
    def in_order(self) -> bool:
        """The boxes lie in the buffer in their order (so a copy in this order can report its progress)."""
        if self._in_order is None:
            self._in_order = all(a <= b for a, b in zip(self.offset, self.offset[1:]))
        return self._in_order

    def __len__(self) -> int:
        return len(self.index)

    def _row(self, i: int) -> LocalCopy:
        return LocalCopy(self.index[i], self.dim0[i], self.offset[i], self.nbytes[i], self.shape[i], self.dtype[i])

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, LocalCopies):
            return NotImplemented
        return all(getattr(self, f) == getattr(other, f) for f in ("index", "dim0", "offset", "nbytes", "shape",
                                                                  "dtype"))

    __hash__ = None  # type: ignore[assignment]
