"""Read once per replica group, broadcast to the others.

On load every rank knows which parts it needs (from the manifest and its own layout). One all_gather
shares those sets; a part needed by several ranks is read by exactly one of them (the one with the fewest
bytes assigned so far, so readers spread over the group) and broadcast to the others on a subgroup of
exactly the ranks that need it. Every rank walks the same global list of broadcasts in the same order,
so the collectives cannot cross. Parts only one rank needs are read by it directly. Bytes read from
storage per load: 1x the parts needed, instead of 1x per replica (NeMo#6131).
"""
from __future__ import annotations

import asyncio
import dataclasses
from typing import Sequence

import torch

from ..errors import IntegrityError
from ..buffers import tensor_bytes
from ..storage.tier_io import PartRead, ReadLog, TierIO
from ..storage.tiers.base import scatter
from ..distributed.coordinator import Coordinator

PartId = tuple[int, int]  # (saved rank, part index)


def plan_broadcasts(wanted: Sequence[Sequence[tuple[PartId, int]]]) -> tuple[list[tuple[PartId, tuple[int, ...], int]],
                                                                             dict[PartId, int]]:
    """From every rank's (part, length) wants: [(part, ranks that need it, the rank that reads it)] for parts
    several ranks need, in one global order, and every part's length. Deterministic: each rank computes it."""
    needers: dict[PartId, list[int]] = {}
    lengths: dict[PartId, int] = {}
    for rank, parts in enumerate(wanted):
        for key, length in parts:
            needers.setdefault(tuple(key), []).append(rank)  # type: ignore[arg-type]
            lengths[tuple(key)] = length  # type: ignore[index]
    load = [0] * len(wanted)
    plan = []
    for key in sorted(needers):
        members = tuple(needers[key])
        if len(members) > 1:
            reader = min(members, key=lambda r: (load[r], r))
            load[reader] += lengths[key]
            plan.append((key, members, reader))
    return plan, lengths


async def read_with_broadcast(coordinator: Coordinator, io: TierIO, order: Sequence[str],
                              parts: dict[PartId, PartRead], log: ReadLog, *, ready: bool = True) -> None:
    """Collective: every rank calls it once per load, with the parts it needs (none if it is not `ready`).
    Reads nothing on any rank when one rank was not ready. Every rank walks the whole broadcast
    plan, failure or not, so no rank leaves a collective early; the first error is raised at the end."""
    wanted = sorted((k, p.length) for k, p in parts.items())
    everyone = await coordinator.all_gather_object((ready, wanted))
    if not all(ok for ok, _ in everyone):
        return  # a rank failed before reading: no one reads; the load's agreement reports it
    plan, lengths = plan_broadcasts([w for _, w in everyone])
    shared = {key for key, _, _ in plan}
    groups = {}
    for members in sorted({m for _, m, _ in plan}):
        groups[members] = await coordinator.subgroup(members)  # every rank creates every group, in order

    def read(part: PartRead) -> asyncio.Task[str]:
        return asyncio.create_task(io.read_verified(part, order, log))

    me = coordinator.rank
    solo = [read(p) for k, p in parts.items() if k not in shared]
    buffers: dict[PartId, torch.Tensor] = {}
    prefetch: dict[PartId, asyncio.Task[str]] = {}
    for key, members, reader in plan:
        if reader == me:
            buffers[key] = torch.empty(lengths[key], dtype=torch.uint8)
            p = parts[key]
            prefetch[key] = read(dataclasses.replace(p, views=[tensor_bytes(buffers[key])], targets=(), bounce=True))
    errors: list[BaseException] = []
    try:
        for key, members, reader in plan:
            if me not in members:
                continue
            status = torch.zeros(1, dtype=torch.int64)
            if reader == me:
                try:
                    await prefetch[key]
                    status[0] = 1
                except Exception as e:
                    errors.append(e)
            else:
                buffers[key] = torch.empty(lengths[key], dtype=torch.uint8)
            await coordinator.broadcast_tensor(status, reader, groups[members])
            if status[0] != 1:
                if reader != me:
                    errors.append(IntegrityError(f"part {parts[key].key}: rank {reader}, its reader, found no "
                                                 f"intact copy"))
                buffers.pop(key, None)
                continue
            await coordinator.broadcast_tensor(buffers[key], reader, groups[members])
            if reader != me:
                log.bytes_received += lengths[key]
            await io.run_blocking(scatter, [tensor_bytes(buffers.pop(key))], parts[key].views)  # verified by its reader
            log.overwritten.update(parts[key].targets)
        for outcome in await asyncio.gather(*solo, return_exceptions=True):
            if isinstance(outcome, BaseException):
                errors.append(outcome)
    finally:
        for task in (*solo, *prefetch.values()):
            if not task.done():
                task.cancel()
    if errors:
        raise errors[0]
