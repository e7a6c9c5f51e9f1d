"""Read once per replica group, broadcast to the others; read each part where it is fastest to read.

On load every rank knows which parts it needs (from the manifest and its own layout) and what its node's
node-local tiers hold (`node_holdings`). One all_gather shares both (a rank that needs exactly what rank 0 needs,
as every rank under DDP, sends none, having compared a digest rank 0 broadcast first). A part's best tier is the fastest tier
any rank can read it from (a shared tier such as S3 or the peer ring: every rank; a node-local tier: the
ranks on a node holding it). It is read by one rank that reaches it there: one that needs it when there is
such a rank (the one with the fewest bytes assigned so far, so readers spread), else a rank on the node that
holds it. It reaches the others whole, broadcast on a subgroup of the ranks that need it and its reader, when
every one of them wants the whole part (replicas); otherwise the reader sends each rank only the byte spans
it wants (a rank whose part holds a replicated 0-d optimizer step beside another rank's shard receives its 4
bytes, not the part), all such transfers at once, each matched by a tag. Small payloads (a few bytes of
optimizer steps, a tiny part) go neither way: they travel together in one buffer along a binary tree of ranks
(load/relay.py), so a rank sends and receives at most three messages for them, whatever the world. Every rank
walks the same global list of broadcasts in the same order, so the collectives cannot cross. Parts only one rank
needs and can read at their best tier are read by it directly.
Bytes read from storage per load: 1x the parts needed, instead of 1x per replica (NeMo#6131), none from a
slower tier while a node's memory holds them; bytes a rank receives: what it wants (and, on the relay's path,
the small payloads of others: at most 1 MiB in all).
"""
from __future__ import annotations

import asyncio
import bisect
import dataclasses
import hashlib
import pickle
from typing import Callable, Sequence

import torch

from ..errors import IntegrityError
from ..buffers import tensor_bytes
from ..storage.tier_io import TierIO
from ..storage.verified_read import PartRead, ReadLog, fill
from ..distributed.coordinator import Coordinator
from .relay import relay_small, small_entries, wait_all

PartId = tuple[int, int]  # (saved rank, part index)


Holdings = dict[str, frozenset[int]]  # node-local tier -> saved ranks whose parts this rank's node holds there


def _holds(ascending: Sequence[int], rank: int) -> bool:
    at = bisect.bisect_left(ascending, rank)
    return at < len(ascending) and ascending[at] == rank


def tiers_for(order: Sequence[str], holdings: Holdings, saved_rank: int) -> list[str]:
    """The tiers of `order` a rank can read `saved_rank`'s parts from: shared tiers, and node-local tiers where
    its node holds them."""
    return [t for t in order if t not in holdings or saved_rank in holdings[t]]


def plan_broadcasts(wanted: Sequence[Sequence[tuple[PartId, int]]], holdings: Sequence[Holdings] = (),
                    order: Sequence[str] = (), partly: Sequence[dict[PartId, int]] = (),
                    ) -> tuple[list[tuple[PartId, tuple[int, ...], int]], dict[PartId, int]]:
    """From every rank's (part, length) wants and holdings: [(part, ranks in its broadcast, the rank that reads
    it)] for parts read by one rank and sent to others, in one global order, and every part's length. Of the
    ranks that reach a part on its fastest tier, the reader is one that wants most of it (`partly`: the bytes a
    rank wants of a part it wants only some of), then the one with the fewest bytes assigned so far.
    Deterministic: each rank computes it."""
    # ranks that sent one list (read_with_broadcast: rank 0's, for every rank that wants what it wants) are taken
    # together: a part every rank wants costs one entry here, not R
    alike: dict[int, tuple[Sequence[tuple[PartId, int]], list[int]]] = {}  # (the list kept: its id stays its own)
    for rank, parts in enumerate(wanted):
        alike.setdefault(id(parts), (parts, []))[1].append(rank)
    wanting: dict[PartId, list[list[int]]] = {}
    lengths: dict[PartId, int] = {}
    for parts, ranks in alike.values():
        for key, length in parts:
            wanting.setdefault(tuple(key), []).append(ranks)  # type: ignore[arg-type]
            lengths[tuple(key)] = length  # type: ignore[index]
    needers: dict[PartId, Sequence[int]] = {key: lists[0] if len(lists) == 1 else sorted(r for rs in lists for r in rs)
                                            for key, lists in wanting.items()}
    as_tuple = {id(ranks): tuple(ranks) for _, ranks in alike.values()}  # (each made once, shared by its parts)
    world = len(wanted)
    load = [0] * world
    plan = []
    nearest: dict[int, list[int]] = {}  # saved rank -> the ranks that read its parts from the fastest tier, ascending
    reach = _Reach(holdings, order, world) if holdings else None
    # (a load where every rank wants every part, DDP's, has R parts of R members: nothing below walks a part's
    # members in Python where a C call can)
    partial = {k for wants in partly for k in wants}  # parts some rank wants only some of
    for key in sorted(needers):
        members = needers[key]  # (ascending: each rank lists a part once)
        if reach is not None:
            if key[0] not in nearest:  # once per saved rank, not per part: a load at scale has many parts
                nearest[key[0]] = sorted(reach.nearest(key[0]))
            best = nearest[key[0]]
            if len(best) == world:
                near = members
            else:
                near = [r for r in best if _holds(members, r)] or best
        else:
            near = members
        if key in partial:
            reader = min(near, key=lambda r: (-partly[r].get(key, lengths[key]), load[r], r))
        else:  # (near is ascending: the first of the least loaded is the lowest rank among them)
            reader = min(near, key=load.__getitem__)
        if not _holds(members, reader):
            members = sorted([*members, reader])
        if len(members) > 1:
            load[reader] += lengths[key]
            plan.append((key, as_tuple.get(id(members)) or tuple(members), reader))
    return plan, lengths


async def _exchange_spans(coordinator: Coordinator, transfers: list[tuple[int, PartId, tuple[int, ...], int]],
                          prefetch: dict[PartId, asyncio.Future[str]], buffers: dict[PartId, torch.Tensor],
                          parts: dict[PartId, PartRead], everyone: list, lengths: dict[PartId, int], io: TierIO,
                          log: ReadLog, first_tag: int) -> list[BaseException]:
    """The parts sent as byte spans that this rank reads or receives, `transfers` = [(plan index, part, members,
    reader)], all at once: each part's reader sends each other member, as soon as its read is done, whether the
    read was intact (8 bytes) and then the spans that member wants (all of the part where it wants it whole);
    a member has posted its receives first, tagged `first_tag` + twice the part's place in the plan (a load's
    tags are its own: a receive left behind by an earlier, abandoned load takes none of its messages), and
    scatters the payloads in the plan's order. No send waits for another (one at a time, in the plan's order, a
    rank waited for every part before its own: 60 ms of a 0.4 s resharding load on 4 ranks): a reader posts a
    part's sends as soon as its read is done, and the works are waited for together at the end. Every posted
    message is sent and every posted work waited for, whatever fails, since a send dropped before it completes
    is cancelled and its receiver would wait out the group's timeout: a reader whose read failed still sends, a
    payload of zeros of the right length with the word that it failed; one whose own share could not be
    written sends the spans as read. The errors: the reader's own, or a member's whose reader found no intact
    copy."""
    me = coordinator.rank
    errors: list[BaseException] = []  # (appended to from threads too)
    intact, failed = torch.ones(1, dtype=torch.int64), torch.zeros(1, dtype=torch.int64)  # never written once sent

    def post_receives() -> list[tuple[PartId, int, torch.Tensor, torch.Tensor, object, object]]:
        posted = []
        for i, key, _, reader in transfers:
            if reader != me:
                part = parts[key]
                status = torch.zeros(1, dtype=torch.int64)
                payload = torch.empty(sum(n for _, n in part.spans) if part.spans else lengths[key], dtype=torch.uint8)
                posted.append((key, reader, status, payload, coordinator.post_recv(status, reader, first_tag + 2 * i),
                               coordinator.post_recv(payload, reader, first_tag + 2 * i + 1)))
        return posted

    def receive_all(posted: list) -> tuple[int, list[tuple[str, ...]]]:
        """Wait for every posted receive (a failed fill does not stop the others from being waited for)."""
        received, written = 0, []
        for key, reader, status, payload, status_work, payload_work in posted:
            status_work.wait()
            payload_work.wait()
            if status[0] != 1:
                errors.append(IntegrityError(f"part {key}: rank {reader}, its reader, found no intact copy"))
                continue
            part = parts[key]
            try:
                fill(part.wanted_views() if part.spans else part.views, [tensor_bytes(payload)])
            except Exception as e:
                errors.append(e)
                continue
            received += payload.numel()
            written.append(part.targets)
        return received, written

    def payload_for(key: PartId, member: int, buffer: torch.Tensor | None) -> torch.Tensor:
        wanted = everyone[member][3].get(key, ((0, lengths[key]),))
        if buffer is None:  # the read failed: the right length, never used
            return torch.zeros(sum(n for _, n in wanted), dtype=torch.uint8)
        if len(wanted) == 1:  # one stretch (or the whole part): a view of the read buffer, no copy
            return buffer[wanted[0][0]:wanted[0][0] + wanted[0][1]]
        return torch.cat([buffer[a:a + n] for a, n in wanted])

    sent: list[object] = []  # the works of every send posted: all waited for at the end, whatever happened

    def post(i: int, key: PartId, members: tuple[int, ...], buffer: torch.Tensor | None) -> None:
        for m in members:
            if m != me:
                try:
                    payload, status = payload_for(key, m, buffer), (intact if buffer is not None else failed)
                except Exception as e:  # (no memory for a copy of the spans): zeros, and the word
                    errors.append(e)
                    payload, status = payload_for(key, m, None), failed
                sent.append(coordinator.post_send(status, m, first_tag + 2 * i))
                sent.append(coordinator.post_send(payload, m, first_tag + 2 * i + 1))

    def wait_sent() -> None:
        wait_all(sent, errors)

    async def send(i: int, key: PartId, members: tuple[int, ...]) -> None:
        await asyncio.wait([prefetch[key]])  # its outcome, whatever it is: this rank sends either way
        read, buffer = prefetch[key], buffers.pop(key, None)
        if read.cancelled():
            errors.append(IntegrityError(f"part {key}: its read was cancelled"))
            buffer = None
        elif read.exception() is not None:
            errors.append(read.exception())  # type: ignore[arg-type]
            buffer = None
        await asyncio.to_thread(post, i, key, members, buffer)
        if buffer is not None and key in parts:  # the reader's own share, while the sends go
            await io.run_blocking(fill, parts[key].views, [tensor_bytes(buffer)])
            log.overwritten.update(parts[key].targets)

    posted = await asyncio.to_thread(post_receives)  # before any send: no send waits for an unposted receive
    coordinator.collectives += 2 * len(posted) + 2 * sum(len(m) - 1 for _, _, m, reader in transfers if reader == me)
    try:
        outcomes = await asyncio.gather(asyncio.to_thread(receive_all, posted),
                                        *(send(i, key, members) for i, key, members, reader in transfers
                                          if reader == me), return_exceptions=True)  # each runs to its end
    finally:  # a send dropped before it completes is cancelled, and its receiver would wait for the timeout
        await asyncio.to_thread(wait_sent)
    if isinstance(outcomes[0], tuple):
        log.bytes_received += outcomes[0][0]
        for targets in outcomes[0][1]:
            log.overwritten.update(targets)
    errors.extend(o for o in outcomes if isinstance(o, BaseException))
    return errors


class _Reach:
    """Which ranks read a saved rank's parts from the fastest tier any rank reads them from: a rank reads them
    from a tier its holdings do not name (a shared tier) or from a node-local tier its node holds them on
    (`tiers_for`). Found from who holds what, per tier, instead of every rank's fastest tier for every saved rank
    (R x R per rank: 24 s at 1,024 ranks with a memory tier, growing as R^3 while the nearest were counted)."""

    def __init__(self, holdings: Sequence[Holdings], order: Sequence[str], world: int):
        self.order = order
        self.everyone = frozenset(range(world))
        # per tier of `order`: the ranks to which it is shared, and per saved rank the ranks whose node holds it
        self.shared = [frozenset(r for r in range(world) if t not in holdings[r]) for t in order]
        self.holders: list[dict[int, set[int]]] = [{} for _ in order]
        for r in range(world):
            for i, t in enumerate(order):
                for saved in holdings[r].get(t, ()):
                    self.holders[i].setdefault(saved, set()).add(r)

    def nearest(self, saved_rank: int) -> frozenset[int]:
        for shared, holders in zip(self.shared, self.holders):
            held = holders.get(saved_rank)
            if held:
                return shared | held if shared else frozenset(held)
            if shared:
                return shared
        return self.everyone  # no rank reaches it: each is as near as any


async def read_with_broadcast(coordinator: Coordinator, io: TierIO, order: Sequence[str],
                              parts: dict[PartId, PartRead], log: ReadLog, *, ready: bool = True,
                              holdings: Holdings | None = None,
                              describe: Callable[[PartId, list[memoryview]], PartRead] | None = None) -> None:
    """Collective: every rank calls it once per load, with the parts it needs (none if it is not `ready`) and
    its node's `holdings`. Reads nothing on any rank when one rank was not ready. Every rank walks the whole
    broadcast plan, failure or not, so no rank leaves a collective early; the first error is raised at the end.
    `describe(part, views)` gives the read of a part this rank reads for others without needing it."""
    mine = holdings or {}
    wanted = sorted((k, p.length) for k, p in parts.items())
    spans = {k: p.spans for k, p in parts.items() if p.spans and sum(n for _, n in p.spans) < p.length}  # parts I
    # want only some bytes of: the spans I want
    # a rank that wants what rank 0 wants (every rank under DDP: the whole model) sends None instead: else every
    # rank received R lists of R parts (R^2 entries a rank: 16M at 4,096 ranks)
    digest = hashlib.blake2b(pickle.dumps(wanted, protocol=pickle.HIGHEST_PROTOCOL), digest_size=16).digest()
    first = await coordinator.broadcast_object(digest if coordinator.rank == 0 else None)
    same = coordinator.rank != 0 and digest == first
    everyone = await coordinator.all_gather_object((ready, None if same else wanted, mine, spans,
                                                    coordinator.next_tag))
    if not all(e[0] for e in everyone):
        return  # a rank failed before reading: no one reads; the load's agreement reports it
    wants = [everyone[0][1] if e[1] is None else e[1] for e in everyone]  # (rank 0's list itself: not copied)
    plan, lengths = plan_broadcasts(wants, [e[2] for e in everyone], order,
                                    [{k: sum(n for _, n in v) for k, v in e[3].items()} for e in everyone])
    first_tag = max(e[4] for e in everyone)  # this load's tags follow every earlier load's, on every rank
    if first_tag + 2 * len(plan) + 2 >= 2**30:
        first_tag = 0
    coordinator.next_tag = first_tag + 2 * len(plan) + 2  # (the last two: the relay's, up and down)
    shared = {key for key, _, _ in plan}
    small = small_entries(plan, lengths, [e[3] for e in everyone])  # relayed in one buffer along a tree of ranks
    relayed = {plan[i][0] for i in small}
    partly: dict[PartId, list[int]] = {}  # the ranks that want only some of a part
    for r, e in enumerate(everyone):
        for key in e[3]:
            partly.setdefault(key, []).append(r)
    partial = {key for key, members, reader in plan  # some rank wants less than the whole part: sent its spans
               if key not in relayed and any(r != reader and r in members for r in partly.get(key, ()))}
    distinct = {id(m): m for key, m, _ in plan if key not in partial and key not in relayed}  # (a tuple of R ranks
    # is hashed in R steps: the same one, shared by the parts every rank wants, compared by value once)
    groups = {}
    for members in sorted(set(distinct.values())):
        groups[members] = await coordinator.subgroup(members)  # every rank creates every group, in order

    def read(key: PartId, part: PartRead) -> asyncio.Task[str]:
        near = tiers_for(order, mine, key[0])
        return asyncio.create_task(io.read_verified(part, near or order, log))

    me = coordinator.rank
    solo = [read(k, p) for k, p in parts.items() if k not in shared]
    buffers: dict[PartId, torch.Tensor] = {}
    prefetch: dict[PartId, asyncio.Future[str]] = {}
    errors: list[BaseException] = []
    tasks: list[asyncio.Task[list[BaseException]]] = []
    try:
        for key, members, reader in plan:
            if reader == me:  # a failure here is reported below as this part's failed read, in step
                try:
                    buffers[key] = torch.empty(lengths[key], dtype=torch.uint8)
                    views = [tensor_bytes(buffers[key])]
                    p = parts[key] if key in parts else describe(key, views) if describe is not None else None
                    if p is None:
                        raise RuntimeError("read_with_broadcast: a part to read for others, and no describe()")
                    prefetch[key] = read(key, dataclasses.replace(p, views=views, targets=(), bounce=True))
                except Exception as e:
                    prefetch[key] = asyncio.get_running_loop().create_future()
                    prefetch[key].set_exception(e)
        transfers = [(i, key, members, reader) for i, (key, members, reader) in enumerate(plan)
                     if key in partial and me in members]
        exchange = asyncio.create_task(_exchange_spans(coordinator, transfers, prefetch, buffers, parts, everyone,
                                                       lengths, io, log, first_tag))
        tasks.append(exchange)
        relay = asyncio.create_task(relay_small(coordinator, plan, small, prefetch, buffers, parts, lengths, io, log,
                                                first_tag + 2 * len(plan)))
        tasks.append(relay)
        member_of: dict[int, bool] = {}  # (per distinct members tuple: DDP's R parts share one of R ranks)
        for key, members, reader in plan:  # whole parts, to every member of a replica group: broadcast, in order
            if key in partial or key in relayed:
                continue
            if id(members) not in member_of:
                member_of[id(members)] = me in members
            if not member_of[id(members)]:
                continue
            status = torch.zeros(1, dtype=torch.int64)
            if reader == me:
                try:
                    await prefetch[key]
                    status[0] = 1
                except Exception as e:
                    errors.append(e)
            if reader != me:
                buffers[key] = torch.empty(lengths[key], dtype=torch.uint8)
            await coordinator.broadcast_tensor(status, reader, groups[members])
            if status[0] != 1:
                if reader != me:
                    errors.append(IntegrityError(f"part {key}: rank {reader}, its reader, found no intact copy"))
                buffers.pop(key, None)
                continue
            await coordinator.broadcast_tensor(buffers[key], reader, groups[members])
            if reader != me:
                log.bytes_received += lengths[key]
            if key in parts:  # verified by its reader
                await io.run_blocking(fill, parts[key].views, [tensor_bytes(buffers.pop(key))])
                log.overwritten.update(parts[key].targets)
            else:
                buffers.pop(key)
        errors.extend(await exchange)
        errors.extend(await relay)
        for outcome in await asyncio.gather(*solo, return_exceptions=True):
            if isinstance(outcome, BaseException):
                errors.append(outcome)
    finally:
        for task in (*solo, *prefetch.values(), *tasks):
            if not task.done():
                task.cancel()
    if errors:
        raise errors[0]
