"""Small payloads of a load's broadcast plan, batched and relayed along a binary tree of the ranks.

Sent from each part's reader to each rank that wants some of it, a small payload cost its reader one status and
one payload message per rank: an FSDP2 load, where each rank's part holds a replicated 0-d optimizer step, had
every rank send 2 (R - 1) messages for a few bytes each, and receive as many. Here every payload of a plan entry
that is small (at most `SMALL_ENTRY` bytes: the union of the byte spans its members want), up to `SMALL_TOTAL`
bytes in all, travels in one buffer that all ranks assemble together along the tree of ranks r -> 2r+1, 2r+2:
each rank writes the entries it read (a status byte, then the bytes), receives its children's subtrees into
place, sends its own subtree to its parent; then the whole buffer comes down the tree. A rank sends at most three
messages and receives at most three, whatever the world; one whose subtree holds nothing and wants nothing sends
and receives none. Each part is still read once, by its reader. The price: a rank on the tree's paths takes in
the others' small payloads too (at most SMALL_TOTAL); a load's `bytes_received` counts what it wanted of them,
the coordinator's `bytes_received` every byte that came in.
"""
from __future__ import annotations

import asyncio
import dataclasses
from typing import Any, Sequence

import torch

from ..buffers import tensor_bytes
from ..distributed.coordinator import Coordinator
from ..errors import IntegrityError
from ..storage.tier_io import TierIO
from ..storage.verified_read import PartRead, ReadLog, fill

PartId = tuple[int, int]  # (saved rank, part index)
Spans = tuple[tuple[int, int], ...]  # (offset in the part, length)
Entry = tuple[PartId, tuple[int, ...], int]  # (part, ranks in its broadcast, the rank that reads it)

SMALL_ENTRY = 64 * 1024  # bytes of one entry that may go by the tree (optimizer steps, biases, small parts)
SMALL_TOTAL = 1 << 20  # bytes of all of them: each rank on the tree's path receives the whole buffer


def merged(spans: Sequence[tuple[int, int]]) -> Spans:
    """Sorted, overlapping or touching spans joined."""
    out: list[list[int]] = []
    for start, length in sorted(spans):
        if out and start <= out[-1][0] + out[-1][1]:
            out[-1][1] = max(out[-1][1], start + length - out[-1][0])
        else:
            out.append([start, length])
    return tuple((a, n) for a, n in out)


def small_entries(plan: Sequence[Entry], lengths: dict[PartId, int],
                  wants: Sequence[dict[PartId, Spans]]) -> dict[int, Spans]:
    """{plan index: the spans of the part its members other than the reader want, joined} for the entries that go
    by the tree: those of at most SMALL_ENTRY bytes, smallest first, up to SMALL_TOTAL in all (a status byte
    each). `wants[r]`: the spans rank r wants of the parts it wants only some of. Deterministic: each rank
    computes it."""
    candidates = []
    for i, (key, members, reader) in enumerate(plan):
        whole = ((0, lengths[key]),)
        spans = []
        for m in members:  # (a member that wants it whole makes the union whole: no need to look further)
            if m != reader:
                wanted = wants[m].get(key)
                if wanted is None:
                    spans = list(whole)
                    break
                spans.extend(wanted)
        union = merged(spans)
        size = sum(n for _, n in union)
        if size <= SMALL_ENTRY:
            candidates.append((size, i, union))
    chosen: dict[int, Spans] = {}
    total = 0
    for size, i, union in sorted(candidates, key=lambda c: (c[0], c[1])):
        if total + size + 1 > SMALL_TOTAL:
            break
        chosen[i] = union
        total += size + 1
    return chosen


@dataclasses.dataclass
class Tree:
    """Where each entry lies in the relayed buffer: rank r's own entries, then its children's subtrees (pre-order),
    so a subtree is one stretch of the buffer that a child sends up and its parent receives in place."""

    world: int
    start: list[int]  # where rank r's subtree begins
    size: list[int]  # bytes of rank r's subtree
    wants: list[bool]  # whether some rank of r's subtree wants some entry
    offsets: dict[int, int]  # plan index -> where its status byte is

    @classmethod
    def of(cls, plan: Sequence[Entry], chosen: dict[int, Spans], world: int) -> "Tree":
        own_size, wanting = [0] * world, [False] * world
        own: list[list[int]] = [[] for _ in range(world)]
        for i in sorted(chosen):
            _, members, reader = plan[i]
            own[reader].append(i)
            own_size[reader] += 1 + sum(n for _, n in chosen[i])
            for m in members:
                wanting[m] = wanting[m] or m != reader
        size, wants = own_size[:], wanting[:]
        for r in reversed(range(1, world)):
            size[(r - 1) // 2] += size[r]
            wants[(r - 1) // 2] = wants[(r - 1) // 2] or wants[r]
        start, offsets = [0] * world, {}
        for r in range(world):
            at = start[r]
            for i in own[r]:
                offsets[i] = at
                at += 1 + sum(n for _, n in chosen[i])
            for c in cls.children(r, world):
                start[c] = at
                at += size[c]
        return cls(world, start, size, wants, offsets)

    @staticmethod
    def children(rank: int, world: int) -> list[int]:
        return [c for c in (2 * rank + 1, 2 * rank + 2) if c < world]

    @property
    def total(self) -> int:
        return self.size[0] if self.world else 0


def wait_all(works: Sequence[Any], errors: list[BaseException]) -> None:
    """Wait for every posted point-to-point work, each error recorded: a broken group's, and the others are
    still waited for (a work left unwaited leaves its peer waiting until the group's timeout)."""
    for work in works:
        try:
            work.wait()
        except Exception as e:
            errors.append(e)


async def relay_small(coordinator: Coordinator, plan: Sequence[Entry], chosen: dict[int, Spans],
                      prefetch: dict[PartId, asyncio.Future[str]], buffers: dict[PartId, torch.Tensor],
                      parts: dict[PartId, PartRead], lengths: dict[PartId, int], io: TierIO, log: ReadLog,
                      tag: int) -> list[BaseException]:
    """Collective over the ranks on the tree's paths: deliver the `chosen` entries of `plan` (small_entries) to
    every member that wants them. This rank writes the entries it reads once their reads are done (a read that
    failed: a status byte of 0 and zeros), fills its own share of them, relays its subtree up (tag `tag`) and the
    whole buffer down (`tag` + 1), then fills what it wants of the others' entries. Every message posted is sent
    and waited for, whatever fails; the errors: its own reads', and a reader's that found no intact copy."""
    me, world = coordinator.rank, coordinator.world_size
    tree = Tree.of(plan, chosen, world)
    if not chosen or (tree.size[me] == 0 and not tree.wants[me]):
        return []
    errors: list[BaseException] = []
    blob = torch.zeros(tree.total, dtype=torch.uint8)
    parent = (me - 1) // 2 if me else None
    children = Tree.children(me, world)

    def section(r: int) -> torch.Tensor:
        return blob[tree.start[r]:tree.start[r] + tree.size[r]]

    ups = [coordinator.post_recv(section(c), c, tag) for c in children if tree.size[c]]
    cancelled = False  # once the load gives up (it cancels this task), the entries left go up as failed reads:
    # the receives are posted, and the parent and its subtree wait for this rank's message, so it is still sent
    for i in sorted(chosen):
        key, _, reader = plan[i]
        if reader != me:
            continue
        if not cancelled:
            try:
                await asyncio.wait([prefetch[key]])  # its outcome, whatever it is: the entry goes up either way
            except asyncio.CancelledError:
                cancelled = True
        read, buffer = prefetch[key], buffers.pop(key, None)
        if not read.done() or read.cancelled():
            errors.append(IntegrityError(f"part {key}: its read was cancelled"))
        elif read.exception() is not None:
            errors.append(read.exception())  # type: ignore[arg-type]
        elif buffer is not None:
            at = tree.offsets[i] + 1
            for start, n in chosen[i]:
                blob[at:at + n] = buffer[start:start + n]
                at += n
            blob[tree.offsets[i]] = 1
            if key in parts and not cancelled:  # the reader's own share
                try:
                    await io.run_blocking(fill, parts[key].views, [tensor_bytes(buffer)])
                    log.overwritten.update(parts[key].targets)
                except asyncio.CancelledError:
                    cancelled = True
                except Exception as e:  # its own targets only: the others still get the entry
                    errors.append(e)

    def relay() -> None:
        """Up, then down; every posted work waited for."""
        pending = list(ups)

        def settle() -> None:
            wait_all(pending, errors)
            pending.clear()

        settle()
        if parent is not None and tree.size[me]:
            pending.append(coordinator.post_send(section(me), parent, tag))
            settle()
        if parent is not None and tree.wants[me]:
            pending.append(coordinator.post_recv(blob, parent, tag + 1))
            settle()
        pending.extend(coordinator.post_send(blob, c, tag + 1) for c in children if tree.wants[c])
        settle()

    coordinator.collectives += (len(ups) + (parent is not None and tree.size[me] > 0)
                                + (parent is not None and tree.wants[me]) + sum(tree.wants[c] for c in children))
    relaying = asyncio.ensure_future(asyncio.to_thread(relay))
    if cancelled:  # the messages go out in the thread whatever happens to this task
        raise asyncio.CancelledError
    await relaying
    for i in sorted(chosen):
        key, members, reader = plan[i]
        if reader == me or me not in members:
            continue
        if blob[tree.offsets[i]] != 1:
            errors.append(IntegrityError(f"part {key}: rank {reader}, its reader, found no intact copy"))
            continue
        part = parts[key]
        payload = _extract(blob, tree.offsets[i] + 1, chosen[i], part.spans or ((0, lengths[key]),))
        try:
            await io.run_blocking(fill, part.wanted_views() if part.spans else part.views, [tensor_bytes(payload)])
        except Exception as e:
            errors.append(e)
            continue
        log.bytes_received += payload.numel()  # what it wanted (the relayed bytes: the coordinator's counters)
        log.overwritten.update(part.targets)
    return errors


def _extract(blob: torch.Tensor, at: int, union: Spans, wanted: Spans) -> torch.Tensor:
    """This rank's `wanted` spans of a part, out of the entry at `at` that holds the part's `union` spans."""
    pieces, base = [], []
    pos = at
    for start, n in union:
        base.append((start, n, pos))
        pos += n
    for start, n in wanted:
        for u_start, u_n, u_at in base:
            if u_start <= start and start + n <= u_start + u_n:
                pieces.append(blob[u_at + start - u_start:u_at + start - u_start + n])
                break
        else:
            raise IntegrityError(f"span ({start}, {n}) is not among the relayed spans {union}")
    return pieces[0] if len(pieces) == 1 else torch.cat(pieces)
