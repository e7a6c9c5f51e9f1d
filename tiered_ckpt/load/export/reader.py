"""Whole tensors out of a checkpoint, a group at a time, through the load path's reads (plan_reads,
parts_to_read, TierIO.read_verified): however the tensors were sharded when saved."""
from __future__ import annotations

import asyncio
import ctypes
from collections.abc import Callable
from typing import Any

import torch

from ...errors import IntegrityError
from ...manifest import Manifest, TensorMeta
from ...storage.tier_io import TierIO
from ...storage.verified_read import ReadLog
from ..reads import Reads, parts_to_read, plan_reads, rank_spans


class TensorReader:
    """Hands out full tensors by manifest index; `uses` lists the indices in the order they will be asked
    for, a tie once per name. A tensor not at hand is read together with the next ones of `uses` still to
    come, up to about one part's worth of bytes (so each part is read about once); those wait in a cache of
    at most that size (the oldest are dropped, and read again if they are asked for after all)."""

    def __init__(self, io: TierIO, manifest: Manifest, tiers: list[str], uses: list[int], log: ReadLog,
                 progress: Callable[[int, int], None] | None):
        self.io = io
        self.manifest = manifest
        self.tiers = tiers
        self.log = log
        self.uses: dict[int, int] = {}
        for i in uses:
            self.uses[i] = self.uses.get(i, 0) + 1
        self.order = list(self.uses)  # unique, in first-use order
        self.position = {i: n for n, i in enumerate(self.order)}
        self.budget = manifest.part_size
        self.cache: dict[int, torch.Tensor] = {}
        self.cached = 0
        self.total = sum(manifest.tensors.nbytes_of(i) * n for i, n in self.uses.items())
        self.done = 0
        self.progress = progress
        self._lock = asyncio.Lock()
        self._spans: dict[int, list[tuple[int, int]]] | None = None
        if progress is not None:
            progress(0, self.total)

    async def get(self, index: int) -> torch.Tensor:
        async with self._lock:
            tensor = self.cache.pop(index, None)
            if tensor is None:
                await asyncio.to_thread(_give_back_freed_memory)
                group = self._group(index)
                tensors = await self._read(group)
                tensor = tensors.pop(index)
                for i, t in tensors.items():
                    self.cache[i] = t
                    self.cached += self.manifest.tensors.nbytes_of(i)
            else:
                self.cached -= self.manifest.tensors.nbytes_of(index)
            self.uses[index] -= 1
            if self.uses[index] > 0:  # a tie: wanted again under another name
                self.cache[index] = tensor
                self.cached += self.manifest.tensors.nbytes_of(index)
            evicted = []
            while self.cached > self.budget and self.cache:
                oldest = next(iter(self.cache))
                self.cached -= self.manifest.tensors.nbytes_of(oldest)
                evicted.append(self.cache.pop(oldest))
            if evicted:
                await asyncio.to_thread(evicted.clear)  # freed in a thread: large frees take milliseconds
            self.done += self.manifest.tensors.nbytes_of(index)
            if self.progress is not None:
                self.progress(self.done, self.total)
            return tensor

    def _group(self, index: int) -> list[int]:
        group, size = [index], self.manifest.tensors.nbytes_of(index)
        for i in self.order[self.position[index] + 1:]:
            if self.uses[i] <= 0 or i in self.cache:
                continue
            n = self.manifest.tensors.nbytes_of(i)
            if size + n > self.budget:
                break
            group.append(i)
            size += n
        return group

    async def _read(self, indices: list[int]) -> dict[int, torch.Tensor]:
        parts, reads, tensors = await asyncio.to_thread(self._plan, indices)
        outcomes = await asyncio.gather(*(self.io.read_verified(p, self.tiers, self.log) for p in parts),
                                        return_exceptions=True)
        failed = [o for o in outcomes if isinstance(o, BaseException)]
        if failed:
            raise failed[0]
        await self.io.run_blocking(reads.finish)
        await self.io.run_blocking(reads.release)
        return tensors

    def _plan(self, indices: list[int]) -> tuple[list[Any], Reads, dict[int, torch.Tensor]]:
        """Full tensors for `indices`, and the reads that fill them: only the parts that hold their chunks."""
        m = self.manifest
        if self._spans is None:
            self._spans = {r.rank: rank_spans(m, r.rank) for r in m.ranks}
        tensors = {}
        for i in indices:
            _check_covered(m.tensors[i])
            tensors[i] = torch.empty(m.tensors[i].shape, dtype=m.tensors[i].torch_dtype)
        reads = plan_reads(m, {i: (m.tensors[i].path, t) for i, t in tensors.items()})
        wanted = {(c.rank, p) for i in indices for c in m.tensors[i].chunks if c.nbytes
                  for p in range(c.byte_offset // m.part_size, (c.byte_offset + c.nbytes - 1) // m.part_size + 1)}
        parts = parts_to_read(m, reads, only=wanted, spans=self._spans)
        return [parts[k] for k in sorted(parts)], reads, tensors


def _give_back_freed_memory() -> None:
    """glibc keeps large freed blocks in its heap (its mmap threshold rises after the first one is freed), so
    without this the RSS of a long export creeps up by whole tensors it no longer holds; elsewhere a no-op."""
    global _malloc_trim
    if _malloc_trim is None:
        try:
            _malloc_trim = ctypes.CDLL(None).malloc_trim
        except (AttributeError, OSError):
            _malloc_trim = False
    if _malloc_trim:
        _malloc_trim(0)


_malloc_trim: Any = None


def _check_covered(meta: TensorMeta) -> None:
    """The manifest's chunks of a tensor hold every one of its elements (each once: replicas are saved once)."""
    covered, total = 0, 1
    for s in meta.shape:
        total *= s
    for chunk in meta.chunks:
        elements = 1
        for s in chunk.sizes:
            elements *= s
        covered += elements
    if covered != total:
        raise IntegrityError(f"tensor {meta.path!r}: the manifest's chunks hold {covered} of its {total} elements")
