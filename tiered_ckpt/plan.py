"""Structure → layout. A Plan says where each tensor's bytes go in this rank's packed stream, and how
that stream is cut into parts. Plans hold layout only, never data, so a cached plan cannot make a later
checkpoint repeat an earlier one's values. They are cached by a key of names, shapes, dtypes and the
world layout; any change misses the cache.
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import torch

from .manifest import ChunkMeta, TensorMeta

ALIGN = 64  # every tensor starts 64-byte aligned, so byte views can be re-viewed as any dtype


@dataclass(frozen=True)
class Plan:
    key: tuple
    rank: int
    world_size: int
    part_size: int
    tensors: tuple[TensorMeta, ...]
    local: tuple[tuple[int, int, int], ...]  # (tensor index, byte offset, nbytes) this rank stages
    nbytes: int  # this rank's packed stream

    @property
    def num_parts(self) -> int:
        return -(-self.nbytes // self.part_size)

    def part_range(self, index: int) -> tuple[int, int]:
        start = index * self.part_size
        return start, min(start + self.part_size, self.nbytes)


def structure_key(paths: list[str], tensors: list[torch.Tensor], world_size: int, part_size: int) -> tuple:
    """Names, dtypes, shapes and layout as one hashable tuple (hashing it is ~10x cheaper than
    formatting and digesting strings, which matters on the save() path of states with many tensors)."""
    return (world_size, part_size, tuple(paths), tuple([t.dtype for t in tensors]),
            tuple([t.shape for t in tensors]))


class Planner:
    """Builds plans and keeps the last few. Single-rank here; the distributed coordinator extends
    `_build` with a gather of every rank's chunks and the replica load balancing."""

    def __init__(self, part_size: int, *, rank: int = 0, world_size: int = 1, cache_size: int = 8):
        self.part_size = part_size
        self.rank = rank
        self.world_size = world_size
        self.cache_size = cache_size
        self._cache: OrderedDict[tuple, Plan] = OrderedDict()
        self.misses = 0

    def plan(self, paths: list[str], tensors: list[torch.Tensor]) -> Plan:
        key = structure_key(paths, tensors, self.world_size, self.part_size)
        plan = self._cache.get(key)
        if plan is not None:
            self._cache.move_to_end(key)
            return plan
        self.misses += 1
        plan = self._build(key, paths, tensors)
        self._cache[key] = plan
        if len(self._cache) > self.cache_size:
            self._cache.popitem(last=False)
        return plan

    def _build(self, key: tuple, paths: list[str], tensors: list[torch.Tensor]) -> Plan:
        metas, local, offset = [], [], 0
        for i, (path, t) in enumerate(zip(paths, tensors)):
            nbytes = t.numel() * t.element_size()
            offset = -(-offset // ALIGN) * ALIGN
            shape = tuple(t.shape)
            chunk = ChunkMeta((0,) * len(shape), shape, self.rank, offset, nbytes)
            metas.append(TensorMeta(path, str(t.dtype), shape, (chunk,)))
            local.append((i, offset, nbytes))
            offset += nbytes
        return Plan(key, self.rank, self.world_size, self.part_size, tuple(metas), tuple(local), offset)
