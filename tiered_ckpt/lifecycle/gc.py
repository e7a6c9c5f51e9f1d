"""Cleaning up what crashed runs left: `tiered-ckpt gc` and `Engine.gc()`.

A save that dies part-way leaves bytes nothing will ever read: an incomplete checkpoint, a tier of a
checkpoint that never completed there, an incarnation folder a fenced zombie or a crashed attempt wrote
beside the committed one, temp files of writes cut short, a removal cut short (a tombstone), empty
folders. Retention and the next writer remove much of it in time; `collect` removes all of it now. On the
memory tier that is RAM given back.

Who may be writing decides what goes (docs/operations.md, "Cleaning up"):
- **no writer can be running** (`exclusive`): this engine is the job's writer, or the file index's writer
  lease was free and gc holds it while it runs. Every incomplete checkpoint is a leftover then.
- **a writer may be running** (the Redis index, which cannot tell; the file index's lease held by a
  trainer): a checkpoint (or one tier of it) that is not complete is removed only once its save began
  more than `grace` seconds ago (default one hour), on the index's clock, and, with the file index, not
  while the lease held now was (Index.began_under_writer: the file system's times, since the trainer
  stamps `created` with its own clock, which may be hours behind gc's). A trainer's save in flight is
  younger than that (a save that takes longer on some tier needs a larger grace). Folders of a step that is still within its grace
  but older than the newest one written for it (a zombie's, a crashed attempt's) go at once.
Either way gc never fences: with Redis it writes with the current epoch (`Index.attach`), so a running
trainer keeps committing; a trainer that starts meanwhile fences gc, whose next index write then fails.

Dead processes' staging folders on the memory tiers go too (host_memory.py: their lock is free).

Always kept: complete checkpoints (their committed folder), steps this process is saving or loading,
folders of other indexes (an unrelated run sharing the tier; removed only with `other_indexes`, and never
those a live process holds: live_holders.py), an
index record that cannot be read while some tier holds data of its step (without any, the record goes: it
promises nothing), and a whole checkpoint of this index that the index does not list (a
lost record: `load(step=N)` can still restore it; `tiered-ckpt delete` cannot see it). The tiers are
listed before the index, so a save that begins during gc is known to the index snapshot or invisible to
the tiers' one, never taken for an orphan; folders are removed by the names seen, never by a wider prefix
than those. `dry_run` does the same reading and reports the same, changing nothing (it only tests the
file index's lease, never takes it).
"""
from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable, Iterable

from ..errors import IncompleteCheckpoint, IntegrityError, TierError
from ..gc_pause import automatic_gc_paused
from ..layout import (checkpoint_prefix, committed_key, index_dir, job_prefix, manifest_key, parse_key, parse_step_dir,
                      step_prefix)
from ..manifest import Manifest
from ..storage.index import CheckpointStatus, Index
from ..storage.tier_io import TierIO
from .busy import BusySteps
from .host_memory import memory_tiers, remove_dead, staging_folders
from .lineage import Copy
from .live_holders import LiveHolders, live_holders
from .removal import remove_checkpoint
from .writer import Writer

log = logging.getLogger(__name__)
YIELD_EVERY = 256  # steps gc judges between two turns of the event loop
GRACE = 3600.0  # seconds: a save that began longer ago is taken for dead when a writer may be running


@dataclass(frozen=True)
class Removed:
    """One thing gc removed (or, in a dry run, would remove)."""

    tier: str | None  # None: an index record only
    step: int | None
    name: str  # the folder (trailing /), key or file, or "index record"
    what: str  # why it is garbage
    nbytes: int | None  # None: the tier cannot tell sizes


@dataclass
class GcReport:
    dry_run: bool
    exclusive: bool  # no writer of the job could run meanwhile
    grace: float
    removed: list[Removed] = field(default_factory=list)
    checkpoints: list[int] = field(default_factory=list)  # steps removed from the index altogether
    kept: list[str] = field(default_factory=list)  # what looked like garbage but stays, and why
    errors: list[str] = field(default_factory=list)

    def freed(self) -> dict[str, tuple[int, int, bool]]:
        """Per tier: (items, bytes, whether some sizes are unknown)."""
        out: dict[str, tuple[int, int, bool]] = {}
        for r in self.removed:
            if r.tier is None:
                continue
            count, nbytes, unknown = out.get(r.tier, (0, 0, False))
            out[r.tier] = (count + 1, nbytes + (r.nbytes or 0), unknown or r.nbytes is None)
        return out


def in_flight(status: CheckpointStatus, *, exclusive: bool, grace: float, now: float,
              under_writer: bool = False) -> bool:
    """Whether a running save may still be writing `status` somewhere: a tier it targets is neither complete
    nor failed, a writer may be running, and its save began less than `grace` seconds ago or while the live
    writer held its lease (`under_writer`: Index.began_under_writer, whatever the clocks). `now` is the
    index's clock (Index.now), the one `created` was stamped on."""
    if exclusive:
        return False
    pending = [t for t in status.tiers if t not in status.settled]
    return bool(pending) and (under_writer or now - status.created < grace)


async def in_flight_steps(index: Index, job: str, statuses: Iterable[CheckpointStatus], *, exclusive: bool,
                          grace: float = GRACE) -> tuple[set[int], set[int], float]:
    """The steps of `statuses` whose save may still be running (in_flight), those of them begun under the live
    writer's lease, and the index's clock they were judged on."""
    now = await index.now()
    if exclusive:
        return set(), set(), now
    pending = [s for s in statuses if any(t not in s.settled for t in s.tiers)]
    under = await index.began_under_writer(job, [s.step for s in pending]) if pending else set()
    return ({s.step for s in pending if in_flight(s, exclusive=False, grace=grace, now=now,
                                                  under_writer=s.step in under)}, under, now)


@dataclass(frozen=True)
class GcScope:
    """What gc works on: one job's index records and tiers, this process's busy steps, and its writer role
    (gc attaches as a cleaner)."""

    job: str
    index: Index
    io: TierIO
    busy: BusySteps
    writer: Writer


@dataclass
class _Tier:
    """One tier's snapshot of the job: step → folder ("" for the folder-less keys of formats 1-2) → key → size."""

    name: str
    steps: dict[int, dict[str, dict[str, int | None]]] = field(default_factory=dict)


class _Plan:
    """What gc will do, in order. A tier's removal that fails is reported and the next goes on; any other
    error (the index refused or is down) stops gc there."""

    def __init__(self, scope: GcScope, report: GcReport):
        self.scope = scope
        self.job = scope.job
        self.report = report
        self.actions: list[tuple[str, Callable[[], Awaitable[Any]]]] = []
        self._group: list[tuple[str, Callable[[], Awaitable[Any]]]] | None = None

    def add(self, what: str, op: Callable[[], Awaitable[Any]]) -> None:
        (self.actions if self._group is None else self._group).append((what, op))

    def checkpoint(self, step: int, *, bury: bool, forget: bool) -> "_Group":
        return _Group(self, step, bury, forget)


class _Group:
    """The removal of a whole checkpoint, one action: bury it, drop its index record, remove its folders,
    and unbury it only when every removal succeeded (else the tombstone stays for the next gc or writer)."""

    def __init__(self, plan: _Plan, step: int, bury: bool, forget: bool):
        self.plan, self.step, self.bury, self.forget = plan, step, bury, forget

    def __enter__(self) -> None:
        self.plan._group = []

    def __exit__(self, *exc: Any) -> None:
        removals, self.plan._group = self.plan._group or [], None
        scope, step, report = self.plan.scope, self.step, self.plan.report

        async def run() -> None:
            failed = await remove_checkpoint(scope.index, scope.job, step, removals, bury=self.bury, forget=self.forget)
            report.errors.extend(f"{f}; the checkpoint stays buried until a later gc removes it" for f in failed)

        self.plan.add(f"removal of checkpoint {step}", run)


async def collect(scope: GcScope, dry_run: bool = False, *, grace: float = GRACE, other_indexes: bool = False,
                  progress: Callable[[int, int], None] | None = None) -> GcReport:
    """Remove (with dry_run, only report) what crashed runs left for the job on every configured tier
    and in the index; see the module docstring for what goes and what stays. Runs in this process only (no
    collectives): run it once per node for node-local tiers. `progress(done, total)` counts removals."""
    if not grace >= 0:  # (nan too)
        raise ValueError(f"grace must be a number of seconds >= 0, got {grace}")
    exclusive = await scope.writer.attach(hold=not dry_run)
    report = GcReport(dry_run, exclusive, grace)
    plan = _Plan(scope, report)
    tiers = await _snapshot(scope, report)  # before the index: see the module docstring
    statuses = {s.step: s for s in await scope.index.list(scope.job)}
    buried = await scope.index.buried(scope.job)
    busy = scope.busy.steps()
    flying, under, now = await in_flight_steps(scope.index, scope.job, statuses.values(), exclusive=exclusive,
                                               grace=grace)
    mine = index_dir(scope.index.identity) + "/"
    steps = sorted(set(statuses) | buried | {s for t in tiers for s in t.steps})
    holders = await _foreign_holders(scope, tiers, mine) if other_indexes else None
    held: dict[tuple[str, str, str], list[int]] = {}  # (tier, index folder, why) → steps kept
    for n, step in enumerate(steps):
        if n % YIELD_EVERY == YIELD_EVERY - 1:
            await asyncio.sleep(0)  # ten thousand steps are judged here: other tasks (a trainer's) run between
        status = statuses.get(step)
        if step in busy:
            report.kept.append(f"step {step}: being saved or loaded by this process")
        elif step in buried:
            _remove_checkpoint(plan, tiers, step, mine, "its removal was cut short", in_index=status is not None,
                               buried=True)
        elif status is None:
            await _orphan(plan, tiers, step, mine, other_indexes)
        elif not status.tiers and "index" in status.failed:
            _unreadable(plan, tiers, step, mine, status.failed["index"])
        else:
            await _known(plan, tiers, status, mine, _Flight(status.step in flying, status.step in under, grace, now))
        if holders is not None:
            for t in tiers:
                foreign = [f for f in t.steps.get(step, {}) if f and not f.startswith(mine)]
                for f in foreign:
                    why = holders.holder(f)
                    if why is not None:  # never offered for removal: a live run's
                        held.setdefault((t.name, f.split("/")[0], why), []).append(step)
                _remove_folders(plan, t, step, [f for f in foreign if holders.holder(f) is None],
                                "another index's folder")
    for (tier, ix, why), kept_steps in held.items():
        report.kept.append(f"tier {tier}: another index's folders ({ix}) of step(s) {', '.join(map(str, kept_steps))}: "
                           f"{why}")
    _note_foreign(report, tiers, mine, other_indexes)
    io = scope.io
    for name in io:  # temp files and empty folders: removed after everything above
        try:
            debris = await io.debris(name, job_prefix(scope.job), grace)
        except (TierError, OSError) as e:
            report.errors.append(f"tier {name}: cannot look for temp files: {e}")
            continue
        for item, nbytes in debris:
            what = "empty folder" if item.endswith("/") else "temp file of a write cut short"
            report.removed.append(Removed(name, _step_of(item), item, what, nbytes))
        if debris:
            names = [item for item, _ in debris]
            plan.add(f"debris on {name}", lambda t=name, n=names: io.remove_debris(t, n, grace))
    _dead_staging(plan)
    if not dry_run:
        await _run(plan, progress)
    return report


async def _foreign_holders(scope: GcScope, tiers: list[_Tier], mine: str) -> LiveHolders:
    """Who holds the other indexes' folders (live_holders.py): those gc --other-indexes must keep."""
    folders = [(t.name, step, f) for t in tiers for step, by in sorted(t.steps.items()) for f in by
               if f and not f.startswith(mine)]
    return await live_holders(scope.io, scope.job, folders, mine.rstrip("/"))


def _dead_staging(plan: _Plan) -> None:
    """The staging folders (`.staging/<job>-…`, outside the job's folder) of the job's processes that died, on
    every memory tier: RAM nothing will use again (host_memory.py). A live process's are never touched."""
    for name, root in memory_tiers(plan.scope.io):
        for folder in staging_folders(root, plan.job):
            if folder.alive:
                continue
            plan.report.removed.append(Removed(name, None, folder.name, f"staging buffers of a process that died "
                                                                        f"({folder.who()})", folder.nbytes))
            plan.add(f"staging folder {folder.name} on {name}",
                     lambda f=folder: plan.scope.io.run_blocking(remove_dead, f.path))


async def _snapshot(scope: GcScope, report: GcReport) -> list[_Tier]:
    out = []
    for name in scope.io:
        snap = _Tier(name)
        try:
            sizes = await scope.io.usage(name, job_prefix(scope.job))
            if sizes is None:
                sizes = dict.fromkeys(await scope.io.list(name, job_prefix(scope.job)))
        except (TierError, OSError) as e:
            report.errors.append(f"tier {name} cannot be listed: {e}")
            continue
        snap.steps = await scope.io.run_blocking(_by_step, sizes, scope.job)  # (tens of thousands of keys)
        out.append(snap)
    return out


def _by_step(sizes: dict[str, int | None], job: str) -> dict[int, dict[str, dict[str, int | None]]]:
    """A tier's keys of `job` with their sizes, by step and folder; keys that are not a checkpoint's are left out
    (temp files are debris, looked for apart). Run in a thread with automatic collection off: a collection set
    off by tens of thousands of keys would hold the GIL, and the event loop with it (gc_pause.py)."""
    steps: dict[int, dict[str, dict[str, int | None]]] = {}
    with automatic_gc_paused():
        for key, nbytes in sizes.items():
            parsed = parse_key(key)
            if parsed is not None and parsed.job == job:
                steps.setdefault(parsed.step, {}).setdefault(parsed.incarnation, {})[key] = nbytes
    return steps


@dataclass(frozen=True)
class _Flight:
    """Whether a step's save may still be running, and why (for what gc says it kept)."""

    running: bool
    under_writer: bool  # begun while the live writer held the job's lease
    grace: float
    now: float

    def began(self, status: CheckpointStatus) -> str:
        if self.under_writer:
            return "its save began while the running writer held the job's lease"
        return f"its save began {_age(self.now - status.created)} ago"


async def _known(plan: _Plan, tiers: list[_Tier], status: CheckpointStatus, mine: str, flying: _Flight) -> None:
    """A step the index lists: incomplete ones whose save is over go whole; of complete ones, every folder
    of this index but the committed one, and the tiers where they did not complete."""
    report, step = plan.report, status.step
    flight = flying.running
    if not status.is_complete:
        if not flight:
            _remove_checkpoint(plan, tiers, step, mine, "incomplete: no save is writing it")
            return
        report.kept.append(f"step {step}: incomplete, {flying.began(status)} and may still be running (grace "
                           f"{_age(flying.grace)})")
        newest = max((f for t in tiers for f in _mine(t, step, mine)), default=None)
        for t in tiers:
            _remove_folders(plan, t, step, [f for f in _mine(t, step, mine) if f != newest],
                            "an earlier attempt's folder (a crashed run's or a zombie's)")
        return
    committed = _recorded_folder(plan, tiers, status, mine)
    if committed is None:  # not recorded (an earlier release's save), or the tiers do not bear it out: the manifest
        try:
            committed = (await _manifest(plan, await plan.scope.index.get_manifest(plan.job, step),
                                         f"index manifest of step {step}")).incarnation
        except (IncompleteCheckpoint, IntegrityError) as e:
            report.kept.append(f"step {step}: complete, but its manifest in the index cannot be read ({e}); "
                               f"nothing of it removed")
            return
    unconfigured = sorted(set(status.tiers) - set(plan.scope.io))  # tiers the record names that this config lacks
    for t in tiers:
        folders = _mine(t, step, mine)
        if t.name in status.complete:
            _remove_folders(plan, t, step, [f for f in folders if f != committed],
                            "not the committed folder (a zombie's or a crashed attempt's)")
        elif t.name in status.tiers and t.name not in status.settled:  # targeted, never completed
            if flight:
                report.kept.append(f"step {step} on {t.name}: {flying.began(status)} and may still be writing "
                                   f"there")
                _remove_folders(plan, t, step, [f for f in folders if f != committed],
                                "not the committed folder (a zombie's or a crashed attempt's)")
                continue
            _unmark(plan, step, t.name)  # its record first: a crash part-way never leaves it looking whole
            _remove_folders(plan, t, step, folders, "a tier this checkpoint never completed on")
        elif folders and t.name not in status.tiers and unconfigured:  # perhaps this tier, renamed
            report.kept.append(f"step {step} on {t.name}: its index record names tier(s) {', '.join(unconfigured)}, "
                               f"which this config does not have (renamed?); nothing of it removed")
        else:  # failed or skipped there, or no longer targeted (retention cut short): nothing will read it
            _remove_folders(plan, t, step, folders, "a tier this checkpoint failed on or left")


def _recorded_folder(plan: _Plan, tiers: list[_Tier], status: CheckpointStatus, mine: str) -> str | None:
    """The committed folder of a complete checkpoint without reading its manifest: the folder its last save
    recorded at begin, when every tier where it is complete and that gc listed holds that folder with the marker
    rank 0 leaves once the index committed it. None when the index recorded no folder (an earlier release), or
    a tier lacks the folder or its marker (a later attempt that began and never committed, a marker not written):
    then the index's manifest decides, as before."""
    folder = status.folder
    if folder is None or not folder.startswith(mine):
        return None
    marker = committed_key(plan.job, status.step, folder)
    listed = [t for t in tiers if t.name in status.complete]
    if not listed or any(marker not in t.steps.get(status.step, {}).get(folder, {}) for t in listed):
        return None
    return folder


async def _orphan(plan: _Plan, tiers: list[_Tier], step: int, mine: str, other_indexes: bool) -> None:
    """A step the index does not list. Folders of this index go unless they hold a whole checkpoint: the
    index may have lost its record (a flushed Redis), and then the tiers' copy is all there is."""
    for t in tiers:
        folders = t.steps.get(step, {})
        for folder in sorted(folders):
            if folder and not folder.startswith(mine):
                continue  # another index's: see _note_foreign
            manifest = None
            key = manifest_key(plan.job, step, folder)
            if key in folders[folder]:
                try:
                    manifest = await _manifest(plan, await plan.scope.io.read(t.name, key), f"{key} on tier {t.name}")
                except TierError:
                    manifest = None
            if not folder and (manifest is None or manifest.index != plan.scope.index.identity):
                if not other_indexes:
                    plan.report.kept.append(f"step {step} on {t.name}: keys of an earlier release's format that "
                                            f"the index does not list and no manifest of this index names")
                    continue
            if manifest is not None and manifest.index == plan.scope.index.identity and \
                    Copy(plan.job, step, folder, set(folders[folder])).whole(manifest):
                plan.report.kept.append(f"step {step} on {t.name}: a whole checkpoint of this index that the index "
                                        f"does not list (a lost record?); load(step={step}) can restore it")
                continue
            _remove_folders(plan, t, step, [folder], "a step the index does not list (a lost record, a zombie's "
                                                     "write after a deletion)")


def _unreadable(plan: _Plan, tiers: list[_Tier], step: int, mine: str, why: str) -> None:
    """A step whose index record cannot be read (a torn or garbled record). While a tier holds data of it (a
    folder of this index, or keys of formats 1-2), the tiers' copy may be all there is: kept. Once no tier does
    (retention removed it, the record outlived its data), the record promises nothing: it goes, or it would be
    listed as incomplete, and warned about, for ever."""
    holding = [t.name for t in tiers if _mine(t, step, mine)]
    unlisted = [name for name in plan.scope.io if name not in {t.name for t in tiers}]
    if holding or unlisted:
        where = (f"tier(s) {', '.join(holding)} still hold data of it" if holding else
                 f"tier(s) {', '.join(unlisted)} could not be listed")
        plan.report.kept.append(f"step {step}: its index record cannot be read ({why}); {where}: load(step={step}) "
                                f"may still restore it from the tiers")
        return
    _remove_checkpoint(plan, tiers, step, mine, "an index record that cannot be read, of a step no tier holds "
                                                "any data of")


def _remove_checkpoint(plan: _Plan, tiers: list[_Tier], step: int, mine: str, what: str, *, in_index: bool = True,
                       buried: bool = False) -> None:
    """The whole checkpoint: a tombstone first (so a crash part-way leaves it for the next writer or gc to
    finish), the index record, every folder of this index on every tier, then the tombstone."""
    plan.report.checkpoints.append(step)
    if in_index:
        plan.report.removed.append(Removed(None, step, "index record", what, None))
    with plan.checkpoint(step, bury=not buried, forget=in_index):
        for t in tiers:
            _remove_folders(plan, t, step, _mine(t, step, mine), what)


def _unmark(plan: _Plan, step: int, tier: str) -> None:
    index, job = plan.scope.index, plan.job
    plan.report.removed.append(Removed(None, step, f"index record of tier {tier}", "never completed there", None))
    plan.add(f"unmark {step} on {tier}", lambda: index.unmark(job, step, tier))


def _remove_folders(plan: _Plan, t: _Tier, step: int, folders: list[str], what: str) -> None:
    """Remove `folders` of `step` on tier `t` as listed: the step folder in one call when they are all it
    holds, else an index's folder when all its sessions go, else each session's folder (the folder-less keys
    of formats 1-2 one by one), so no empty folder is left behind."""
    present = t.steps.get(step, {})
    folders = [f for f in folders if f in present]
    if not folders:
        return
    for f in folders:
        keys = present[f]
        sizes = list(keys.values())
        nbytes = None if any(n is None for n in sizes) else sum(n or 0 for n in sizes)
        name = checkpoint_prefix(plan.job, step, f) if f else f"{step_prefix(plan.job, step)} ({len(keys)} keys)"
        plan.report.removed.append(Removed(t.name, step, name, what, nbytes))
    io = plan.scope.io

    def delete(prefix: str) -> None:
        plan.add(f"delete {prefix} on {t.name}", lambda: io.delete(t.name, prefix))

    if set(folders) == set(present):
        delete(step_prefix(plan.job, step))
    else:
        for ix in sorted({f.split("/")[0] for f in folders if f}):  # an index's folder, when all of it goes
            sessions = {f for f in present if f.split("/")[0] == ix}
            if sessions <= set(folders):
                delete(f"{step_prefix(plan.job, step)}{ix}/")
            else:
                for f in sorted(sessions & set(folders)):
                    delete(checkpoint_prefix(plan.job, step, f))
        for key in present[""] if "" in folders else []:  # formats 1-2: keys right in the step folder
            delete(key)
    for f in folders:
        del present[f]  # removed: a later pass over this step (other_indexes) must not count it again


def _mine(t: _Tier, step: int, mine: str) -> list[str]:
    """This index's folders of `step` on `t`, oldest session first; the folder-less keys (formats 1-2) count
    as this index's, as retention treats them, and as the oldest."""
    return sorted(f for f in t.steps.get(step, {}) if not f or f.startswith(mine))


def _note_foreign(report: GcReport, tiers: list[_Tier], mine: str, removed: bool) -> None:
    if removed:
        return
    for t in tiers:
        folders = [(s, f) for s, by in t.steps.items() for f in by if f and not f.startswith(mine)]
        if folders:
            indexes = sorted({f.split("/")[0] for _, f in folders})
            report.kept.append(f"tier {t.name}: {len(folders)} folder(s) of {len(indexes)} other index(es) "
                               f"({', '.join(indexes)}): another run's (other_indexes / --other-indexes removes "
                               f"them)")


async def _run(plan: _Plan, progress: Callable[[int, int], None] | None) -> None:
    """Run the actions in order; the first index error stops (a newer incarnation fenced this process, or the
    index is down): what is left stays for the next gc, tombstones included."""
    total = len(plan.actions)
    for done, (what, op) in enumerate(plan.actions, 1):
        try:
            await op()
        except TierError as e:  # one tier's removal failed: the others go on
            plan.report.errors.append(f"{what}: {e}")
        except Exception as e:
            plan.report.errors.append(f"{what}: {type(e).__name__}: {e}; stopped")
            log.warning("gc stopped at %s: %s", what, e)
            break
        finally:
            if progress is not None:
                progress(done, total)


async def _manifest(plan: _Plan, data: bytes, source: str) -> Manifest:
    """Decode a manifest off the event loop (IntegrityError, a TierError, when it is damaged)."""
    return await plan.scope.io.run_blocking(lambda: Manifest.from_bytes(data, source=source))


def _step_of(name: str) -> int | None:
    """The step of `<job>/step-…/…` (layout.py reads the folder name), else None."""
    parts = name.split("/")
    return parse_step_dir(parts[1]) if len(parts) > 1 else None


def _age(seconds: float) -> str:
    seconds = max(0.0, seconds)
    if seconds < 120:
        return f"{seconds:.0f}s"
    if seconds < 7200:
        return f"{seconds / 60:.0f}min"
    return f"{seconds / 3600:.1f}h"
