"""Giving a job's host memory back: `tiered-ckpt free`.

The memory tier's copies are RAM (tmpfs) that stays taken after the trainer ends, until the job runs again
or the machine reboots; dead processes' staging buffers stay with them (host_memory.py). `free` removes, on
this machine, a job's memory-tier copies and its dead staging folders, with the same rules as everywhere else:
- each checkpoint of this index leaves the memory tier through `Removal.drop_tier`, as retention drops it (the
  index record first, then the data), so the index never lists a copy that is gone and a load afterwards
  reads from the other tiers;
- unless forced, only while the job's newest complete checkpoint is complete on a tier that is not host
  memory (else freeing would lose the newest work): the whole plan is refused, nothing removed, naming every
  checkpoint that freeing would lose (`lost`: complete in host memory alone), which is what `force` loses;
- never what a live process holds, forced or not (live_holders.py): a running trainer's folders, its staging
  buffers, another index's folders whose writer is running. What is kept is said, with why;
- folders the index does not list (another index's, or an orphan of this one) go only with `force`: this
  index cannot say whether they are the last copy of someone's work; `gc` judges this index's orphans.
The plan is made first (a dry run prints it), then run.
"""
from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Awaitable, Callable

from ..errors import TierError
from ..layout import checkpoint_prefix, index_dir, job_prefix, parse_key
from ..storage.index import CheckpointStatus, Index
from ..storage.tier_io import TierIO
from .gc import in_flight_steps
from .host_memory import memory_tiers, remove_dead, staging_folders
from .live_holders import live_holders
from .removal import Removal


@dataclass(frozen=True)
class Freed:
    """One thing free removes (or would remove)."""

    tier: str
    step: int | None  # None: a staging folder
    name: str
    what: str
    nbytes: int


@dataclass
class FreePlan:
    job: str
    refused: str | None = None  # why nothing may be removed without --force
    removed: list[Freed] = field(default_factory=list)
    kept: list[str] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    dropped: set[int] = field(default_factory=set)  # steps of this index whose memory-tier copy goes
    lost: list[int] = field(default_factory=list)  # of those, the ones no other tier holds complete: gone for good
    actions: list[tuple[str, Callable[[], Awaitable[Any]]]] = field(default_factory=list)

    @property
    def nbytes(self) -> int:
        return sum(r.nbytes for r in self.removed)

    def as_json(self) -> dict[str, Any]:
        return {"job": self.job, "refused": self.refused, "lost": self.lost, "nbytes": self.nbytes, "kept": self.kept,
                "errors": self.errors, "removed": [{"tier": r.tier, "step": r.step, "name": r.name, "what": r.what,
                                                    "nbytes": r.nbytes} for r in self.removed]}


async def plan_free(job: str, index: Index, io: TierIO, removal: Removal, *, exclusive: bool,
                    force: bool) -> FreePlan:
    """What freeing `job`'s host memory on this machine removes and keeps (nothing is changed here). With
    `exclusive` (no writer of the job can run meanwhile) no save is in flight; else a save that began within
    gc's grace, or under the live writer's lease, is kept (gc.in_flight_steps)."""
    plan = FreePlan(job)
    tiers = memory_tiers(io)
    memory = {name for name, _ in tiers}
    statuses = {s.step: s for s in await index.list(job)}
    own = index_dir(index.identity)
    mine = own + "/"
    flying, _, _ = await in_flight_steps(index, job, statuses.values(), exclusive=exclusive)
    for name, root in tiers:
        folders = await _folders(io, name, job)
        holders = await live_holders(io, job, [(name, step, f) for step, by in folders.items() for f in by], own)
        for step, by in sorted(folders.items()):
            held = {f: holders.holder(f) for f in by}
            for f, why in held.items():
                if why is not None:
                    plan.kept.append(f"{name} step {step} ({checkpoint_prefix(job, step, f)}): {why}")
            status = statuses.get(step)
            ours = [f for f in by if not f or f.startswith(mine)]
            others = [f for f in by if f and not f.startswith(mine)]
            if status is not None and ours:
                _this_index(plan, removal, name, status, ours, held, by, in_flight=step in flying)
            else:
                others += ours  # unlisted: an orphan of this index, to this plan like another index's
            for f in others:
                if held[f] is not None:
                    continue
                if not force:
                    plan.kept.append(f"{name} step {step} ({checkpoint_prefix(job, step, f)}): not listed by this "
                                     f"index (another index's, or an orphan: --force frees it; gc removes this "
                                     f"index's orphans)")
                    continue
                plan.removed.append(Freed(name, step, checkpoint_prefix(job, step, f), "not listed by this index",
                                          sum(by[f].values())))
                # the folder-less keys of formats 1-2 ("") one by one: their prefix is the whole step folder,
                # other runs' folders (live ones too) included
                for prefix in (sorted(by[f]) if not f else [checkpoint_prefix(job, step, f)]):
                    plan.actions.append((f"{prefix} on {name}", lambda t=name, p=prefix: io.delete(t, p)))
        _staging(plan, io, name, root)
    plan.lost = sorted(s for s in plan.dropped if statuses[s].is_complete and not statuses[s].complete - memory)
    newest = max((s for s in statuses.values() if s.is_complete), key=lambda s: s.step, default=None)
    if newest is not None and newest.step in plan.lost:
        others = [s for s in plan.lost if s != newest.step]
        also = (f", and with it step{'s' if len(others) > 1 else ''} {', '.join(map(str, others))}, also complete "
                f"only there" if others else "")
        plan.refused = (f"job {job!r}: its newest complete checkpoint, step {newest.step}, is complete only in host "
                        f"memory ({', '.join(io.order(newest.complete))}): freeing it would lose it{also}; wait "
                        f"until another tier holds it, or pass --force, which loses {'them' if others else 'it'}")
    return plan


def _this_index(plan: FreePlan, removal: Removal, tier: str, status: CheckpointStatus, ours: list[str],
                held: dict[str, str | None], by: dict[str, dict[str, int]], *, in_flight: bool) -> None:
    """A checkpoint of this index on memory tier `tier`: dropped from the tier through the index, whole, or kept
    whole (a live process holds a folder of it, or its save may be in flight)."""
    step = status.step
    if any(held[f] is not None for f in ours):
        return  # named in kept already
    if in_flight:
        plan.kept.append(f"{tier} step {step}: its save may still be running (a writer holds the job)")
        return
    elsewhere = sorted(status.complete - {tier})
    what = (f"the memory tier's copy ({', '.join(elsewhere)} keeps it)" if elsewhere else
            "the memory tier's copy, the only complete one: the checkpoint is lost" if status.is_complete else
            "the memory tier's copy of an incomplete checkpoint")
    for f in ours:
        plan.removed.append(Freed(tier, step, checkpoint_prefix(removal.job, step, f), what, sum(by[f].values())))
    plan.dropped.add(step)
    plan.actions.append((f"step {step} on {tier}", lambda: removal.drop_tier(status, tier)))


def _staging(plan: FreePlan, io: TierIO, tier: str, root: Path) -> None:
    for folder in staging_folders(root, plan.job):
        if folder.alive:
            plan.kept.append(f"{tier} {folder.name}: staging buffers of a live process ({folder.who()})")
            continue
        plan.removed.append(Freed(tier, None, folder.name, f"staging buffers of a process that died ({folder.who()})",
                                  folder.nbytes))
        plan.actions.append((f"{folder.name} on {tier}", lambda p=folder.path: io.run_blocking(remove_dead, p)))


async def _folders(io: TierIO, tier: str, job: str) -> dict[int, dict[str, dict[str, int]]]:
    """step → incarnation folder ("": the keys of formats 1-2) → key → bytes, of `job` on `tier`."""
    out: dict[int, dict[str, dict[str, int]]] = {}
    for key, nbytes in ((await io.usage(tier, job_prefix(job))) or {}).items():
        parsed = parse_key(key)
        if parsed is not None and parsed.job == job:
            out.setdefault(parsed.step, {}).setdefault(parsed.incarnation, {})[key] = nbytes or 0
    return out


async def run_free(plan: FreePlan) -> None:
    """Run the plan's removals in order; a tier's failure is reported and the next goes on."""
    for what, op in plan.actions:
        try:
            await op()
        except (TierError, OSError) as e:
            plan.errors.append(f"{what}: {type(e).__name__}: {e}")
        except asyncio.CancelledError:
            raise
