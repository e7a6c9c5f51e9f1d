"""The engine's own collectives, on a dedicated gloo process group.

Lifecycle: every rank constructs its Engine and opens it at the same point of the program (SPMD); `open`
creates the side group and agrees on a session id. After that the engine issues collectives only from
`save()` (the first one: the fencing epoch; a plan-cache miss: a broadcast, a gather to rank 0 and a
scatter from it), from `load()` (step agreement, need-set gather, broadcasts, final agreement) and from
`should_save()` (one all_reduce, when a time or signal rule is on), always in program order and never from background tasks, so they cannot
interleave with, or deadlock against, the training loop's own collectives on its own groups
(KempnerForge#104). Commit and failure reporting go
through the index, not through collectives. Every collective runs in a thread, so the event loop keeps
serving background saves, and is bounded by the group's timeout.
"""
from __future__ import annotations

import asyncio
import datetime
import logging
import os
import threading
from typing import Any, Awaitable, Callable, TypeVar

from ..errors import RankFailed
from ..layout import new_session

log = logging.getLogger(__name__)
T = TypeVar("T")


class Coordinator:
    def __init__(self, rank: int = 0, world_size: int = 1, group: Any = None):
        self.rank = rank
        self.world_size = world_size
        self.group = group
        self.collectives = 0  # how many collectives this coordinator issued (tests count them)
        # point-to-point messages this rank posted (load/broadcast.py), and their bytes: tests and benches count them
        self.sends = self.receives = self.bytes_sent = self.bytes_received = 0
        self._counting = threading.Lock()  # (sends are posted from several threads at once)
        self.next_tag = 0  # the first tag the next load's point-to-point transfers may use (load/broadcast.py)
        self.timeout = 600.0  # seconds, for the subgroups too
        self.session = new_session()  # names this opening's key folder on the tiers
        self._subgroups: dict[tuple[int, ...], Any] = {}
        self.hosts: list[str] = [""] * world_size  # every rank's machine, filled by node()

    @classmethod
    async def create(cls, timeout: float = 600.0) -> "Coordinator":
        """A coordinator for the current process group, or a single-rank one without one."""
        import torch.distributed as dist  # here, not above: a single-rank Coordinator() needs no torch (the CLI)

        if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
            return cls()
        group = await asyncio.to_thread(
            dist.new_group, backend="gloo", timeout=datetime.timedelta(seconds=timeout))
        coordinator = cls(dist.get_rank(), dist.get_world_size(), group)
        coordinator.timeout = timeout
        coordinator.session = await coordinator.broadcast_object(coordinator.session)
        return coordinator

    @property
    def distributed(self) -> bool:
        return self.group is not None

    async def all_gather_object(self, obj: Any) -> list[Any]:
        if not self.distributed:
            return [obj]
        import torch.distributed as dist

        out: list[Any] = [None] * self.world_size
        self.collectives += 1
        await asyncio.to_thread(dist.all_gather_object, out, obj, group=self.group)
        return out

    async def gather_object(self, obj: Any, dst: int = 0) -> list[Any] | None:
        """Collective: every rank's `obj` on rank `dst` (in rank order); None on the others. What one rank needs of
        all (the plan's descriptors) goes to it alone, not to every rank."""
        if not self.distributed:
            return [obj]
        import torch.distributed as dist

        out: list[Any] | None = [None] * self.world_size if self.rank == dst else None
        self.collectives += 1
        await asyncio.to_thread(dist.gather_object, obj, out, dst=dst, group=self.group)
        return out

    async def scatter_object(self, objs: list[Any] | None, src: int = 0) -> Any:
        """Collective: rank `src` passes one object per rank (`objs`, in rank order; the others pass None) and
        each rank gets its own: the answer to a gather_object, each rank sent only its part."""
        if not self.distributed:
            assert objs is not None
            return objs[0]
        import torch.distributed as dist

        box: list[Any] = [None]
        self.collectives += 1
        await asyncio.to_thread(dist.scatter_object_list, box, objs if self.rank == src else None, src=src,
                                group=self.group)
        return box[0]

    async def broadcast_object(self, obj: Any, src: int = 0) -> Any:
        if not self.distributed:
            return obj
        import torch.distributed as dist

        box = [obj]
        self.collectives += 1
        await asyncio.to_thread(dist.broadcast_object_list, box, src=src, group=self.group)
        return box[0]

    async def all_reduce_max(self, values: list[int]) -> list[int]:
        """Collective: the element-wise maximum of every rank's `values` (small integers; an "any rank" of flags)."""
        if not self.distributed:
            return list(values)
        import torch
        import torch.distributed as dist

        box = torch.tensor(values, dtype=torch.int64)
        self.collectives += 1
        await asyncio.to_thread(dist.all_reduce, box, op=dist.ReduceOp.MAX, group=self.group)
        return [int(v) for v in box.tolist()]

    async def node(self) -> tuple[int, int]:
        """(this process's node, number of nodes), nodes being machines (`machine_name`) in name order; also
        fills `hosts` (every rank's machine). Collective with several ranks. Not torchrun's GROUP_RANK: node ranks
        follow the order in which agents joined, so after a restart they can name other machines."""
        from ..storage.tiers.base import machine_name

        self.hosts = await self.all_gather_object(machine_name())
        order = sorted(set(self.hosts))
        per_machine = os.environ.get("LOCAL_WORLD_SIZE", "")
        crowded = [h for h in order if per_machine.isdigit() and self.hosts.count(h) > int(per_machine)]
        if crowded and self.rank == 0:  # e.g. containers on several machines that share one host name
            log.warning("%d ranks run on machine %r, but torchrun starts %s per node: if they are on several "
                        "machines with one host name, set TIERED_CKPT_HOST to a name of each machine's own (the "
                        "peer ring and node-local tiers go by it)", self.hosts.count(crowded[0]), crowded[0],
                        per_machine)
        return order.index(self.hosts[self.rank]), len(order)

    @property
    def host(self) -> str:
        """This process's machine (valid after node())."""
        return self.hosts[self.rank]

    def lists_for_node(self) -> bool:
        """Whether this rank lists its node's node-local tiers for the others: the lowest rank on its machine."""
        return self.hosts.index(self.host) == self.rank

    async def subgroup(self, members: tuple[int, ...]) -> object:
        """A process group of exactly `members` (cached). Collective: every rank must ask for every
        group, in the same order, members or not."""
        if len(members) == self.world_size:
            return self.group
        if members not in self._subgroups:
            import torch.distributed as dist

            self.collectives += 1
            self._subgroups[members] = await asyncio.to_thread(
                dist.new_group, list(members), backend="gloo", timeout=datetime.timedelta(seconds=self.timeout))
        return self._subgroups[members]

    async def broadcast_tensor(self, tensor: Any, src: int, group: Any) -> None:
        import torch.distributed as dist

        self.collectives += 1
        await asyncio.to_thread(dist.broadcast, tensor, src=src, group=group)

    def post_send(self, tensor: Any, dst: int, tag: int) -> Any:
        """Start sending `tensor` to `dst` (a global rank) on the engine's group; the work to wait on. The
        receiver posts a receive with the same tag. Many may be in flight at once, each pair of ranks matching
        its messages by tag, so transfers that do not depend on each other never wait for each other. (Called
        from threads: the caller counts them in `collectives`.)"""
        import torch.distributed as dist

        with self._counting:
            self.sends += 1
            self.bytes_sent += tensor.numel() * tensor.element_size()
        return dist.isend(tensor, dst, self.group, tag)

    def post_recv(self, tensor: Any, src: int, tag: int) -> Any:
        """Start receiving into `tensor` from `src` (a global rank) the message sent with `tag`; the work."""
        import torch.distributed as dist

        with self._counting:
            self.receives += 1
            self.bytes_received += tensor.numel() * tensor.element_size()
        return dist.irecv(tensor, src, self.group, tag)

    async def on_first(self, fn: Callable[[], Awaitable[T]], doing: str,
                       answers: tuple[type[Exception], ...] = ()) -> T:
        """Collective: run `fn` on rank 0 alone and give every rank its result, or make every rank raise its
        error: rank 0 its own (with its traceback), the others the first of `answers` that it is an instance of
        (errors that are the decision itself, e.g. "no checkpoint to load"), with its message, else RankFailed
        naming rank 0 and what it was `doing`. Without other ranks, just `fn()`."""
        if not self.distributed:
            return await fn()
        outcome: tuple[Any, ...] = ()
        failure: Exception | None = None
        if self.rank == 0:
            try:
                outcome = (True, await fn())
            except Exception as e:  # every rank must leave the broadcast below with the same answer
                answer = next((i for i, cls in enumerate(answers) if isinstance(e, cls)), None)
                failure, outcome = e, (False, type(e).__name__, str(e), answer)
        outcome = await self.broadcast_object(outcome if self.rank == 0 else None)
        if outcome[0]:
            return outcome[1]
        if failure is not None:
            raise failure
        _, name, message, answer = outcome
        if answer is not None:
            raise answers[answer](message)
        raise RankFailed(f"rank 0 failed while {doing}: {name}: {message}")

    async def agree(self, error: BaseException | None) -> None:
        """Collective: raise on every rank if any rank passes an error, naming the first failing rank."""
        reports = await self.all_gather_object(None if error is None else f"{type(error).__name__}: {error}")
        if error is not None:
            raise error  # a failing rank raises its own error; the others name the first that failed
        for rank, report in enumerate(reports):
            if report is not None:
                raise RankFailed(f"rank {rank} failed: {report}")

    async def destroy(self) -> None:
        if self.group is None:
            return
        import torch.distributed as dist

        if dist.is_initialized():
            for group in (*self._subgroups.values(), self.group):
                await asyncio.to_thread(dist.destroy_process_group, group)
            self._subgroups.clear()
            self.group = None
