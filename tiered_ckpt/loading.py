"""Reading a checkpoint back into the caller's tensors.

Each part is read with one scatter call straight into the destination tensors' memory (a bounce tensor
only for non-contiguous or non-CPU targets), its crc32c is checked over exactly those bytes, and on a
missing part, a short read or a checksum mismatch the part is read again from the next tier.
"""
from __future__ import annotations

import asyncio
import bisect
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Sequence

import torch

from .checksum import checksum
from .errors import IntegrityError, TierError
from .manifest import Manifest
from .staging import tensor_bytes
from .tiers.base import PartKey, Tier

if TYPE_CHECKING:
    from .engine import Engine


@dataclass(frozen=True)
class Fallback:
    """A part that the preferred tier could not serve intact."""

    part: str
    tier: str
    reason: str


@dataclass
class LoadInfo:
    step: int
    tier: str | None  # the tier that served the most bytes
    bytes_by_tier: dict[str, int] = field(default_factory=dict)
    fallbacks: list[Fallback] = field(default_factory=list)
    seconds: float = 0.0


@dataclass
class _Dest:
    """Where one saved tensor's bytes go: `view` (the target's own memory, or a bounce tensor's)."""

    view: memoryview
    target: torch.Tensor
    bounce: torch.Tensor | None


def destinations(targets: dict[int, tuple[str, torch.Tensor]]) -> dict[int, _Dest]:
    out = {}
    for index, (_, t) in targets.items():
        if t.device.type == "cpu" and t.is_contiguous():
            out[index] = _Dest(tensor_bytes(t), t, None)
        else:
            bounce = torch.empty(t.shape, dtype=t.dtype, pin_memory=t.is_cuda)
            out[index] = _Dest(tensor_bytes(bounce), t, bounce)
    return out


def rank_spans(manifest: Manifest, rank: int) -> list[tuple[int, int, int]]:
    """(byte offset, nbytes, tensor index) of every non-empty chunk in `rank`'s stream, in stream order."""
    return sorted((c.byte_offset, c.nbytes, i) for i, t in enumerate(manifest.tensors)
                  for c in t.chunks if c.rank == rank and c.nbytes)


def part_views(manifest: Manifest, rank: int, part: int, spans: list[tuple[int, int, int]],
               dests: dict[int, _Dest]) -> list[memoryview] | None:
    """The buffers that one part's bytes scatter into, in order; None if no wanted tensor is in it."""
    start = part * manifest.part_size
    end = start + manifest.part_length(rank, part)
    first = max(bisect.bisect_right(spans, (start,)) - 1, 0)
    views: list[memoryview] = []
    pos, wanted = start, False
    for offset, nbytes, i in spans[first:]:
        if offset >= end:
            break
        if offset + nbytes <= start:
            continue
        if offset > pos:
            views.append(memoryview(bytearray(offset - pos)))  # alignment padding
        lo, hi = max(offset, start), min(offset + nbytes, end)
        dest = dests.get(i)
        if dest is None:
            views.append(memoryview(bytearray(hi - lo)))  # a tensor the caller did not ask for
        else:
            views.append(dest.view[lo - offset : hi - offset])
            wanted = True
        pos = hi
    if end > pos:
        views.append(memoryview(bytearray(end - pos)))
    return views if wanted else None


async def read_parts(engine: "Engine", manifest: Manifest, tiers: Sequence[Tier], dests: dict[int, _Dest],
                     info: LoadInfo) -> None:
    jobs = []
    for rank_meta in manifest.ranks:
        spans = rank_spans(manifest, rank_meta.rank)
        for p, expected in enumerate(rank_meta.checksums):
            views = part_views(manifest, rank_meta.rank, p, spans, dests)
            if views is not None:
                key = PartKey(manifest.job, manifest.step, rank_meta.rank, p).path
                jobs.append(_read_one(engine, key, views, manifest.part_length(rank_meta.rank, p), expected,
                                      tiers, info))
    await asyncio.gather(*jobs)


async def _read_one(engine: "Engine", key: str, views: list[memoryview], length: int, expected: int,
                    tiers: Sequence[Tier], info: LoadInfo) -> None:
    for tier in tiers:
        try:
            n = await engine.pipelines[tier.name].submit(
                length, lambda t=tier: t.read_into(key, views), f"read {key}")
        except TierError as e:
            info.fallbacks.append(Fallback(key, tier.name, f"{type(e).__name__}: {e}"))
            continue
        if n != length:
            info.fallbacks.append(Fallback(key, tier.name, f"length {n}, expected {length}"))
            continue
        actual = await engine.run_blocking(checksum, views)
        if actual != expected:
            info.fallbacks.append(Fallback(key, tier.name, f"crc32c {actual:#010x}, expected {expected:#010x}"))
            continue
        info.bytes_by_tier[tier.name] = info.bytes_by_tier.get(tier.name, 0) + length
        return
    reasons = "; ".join(f"{f.tier}: {f.reason}" for f in info.fallbacks if f.part == key)
    raise IntegrityError(f"part {key}: no tier returned it intact ({reasons or 'no tier holds this checkpoint'})")


def finish_copies(dests: dict[int, _Dest]) -> None:
    with torch.no_grad():
        for dest in dests.values():
            if dest.bounce is not None:
                dest.target.copy_(dest.bounce)
