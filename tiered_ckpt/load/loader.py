"""`Engine.load`: agree on a step, pair the given state with what was saved, read every needed part (once per
replica group), and only then move the bytes into the caller's tensors.

Order, on every rank: rank 0 picks the checkpoint, reads its manifest and every rank's checksum record (once per
world: load/shared.py), and every rank takes its pick and that manifest (or raises the same error); each rank
matches its state and plans its reads (local work: a failure here does not
make a rank skip the collectives that follow); every rank takes part in the reads (broadcast groups); all
ranks agree that everyone succeeded; then scratch buffers are copied into the targets and plain values set.
A load changes nothing in the index: it is a reader's act, whatever the engine is.
"""
from __future__ import annotations

import asyncio
import copy
import logging
import time
from typing import Any, Iterator, Mapping, Sequence

from ..distributed.coordinator import Coordinator
from ..errors import CheckpointLost, FreshStart, IncompleteCheckpoint, TierError
from ..layout import job_prefix, parse_key
from ..lifecycle.busy import BusySteps
from ..lifecycle.rules import Best
from ..manifest import Manifest, dtype_from_str
from ..release import release_off_loop
from ..state.gc_pause import automatic_gc_paused
from ..state import LoadTarget, SavedTensor, decode_skeleton, match
from ..storage.index import CheckpointStatus
from ..manifest.table import TensorTable
from ..storage.tier_io import TierIO
from ..storage.verified_read import Fallback
from .catalog import Catalog
from .shared import SharedManifest
from .heal import HealReport, heal
from .reads import LoadInfo, Reads, node_holdings, plan_reads, read_parts, target_devices, wait_for_devices

log = logging.getLogger(__name__)


class Loader:
    def __init__(self, io: TierIO, catalog: Catalog, coordinator: Coordinator, busy: BusySteps, *,
                 allow_pickle: bool, heal: bool = True, lost: set[int] | None = None):
        self.io = io
        self.lost = lost if lost is not None else set()  # checkpoints found lost: the next save removes them
        self.catalog = catalog
        self.coordinator = coordinator
        self.busy = busy
        self.allow_pickle = allow_pickle
        self._moved_said: set[int] = set()
        self.heal = heal
        self.heals: dict[asyncio.Task[HealReport], int] = {}  # heals still running, and their steps
        self.reports: list[HealReport] = []  # heals done, not yet handed out by wait_healed()
        # the fallbacks already said of the step loaded last: (tier, part), and (tier, "") for an empty tier
        self._fallbacks_said: tuple[int | None, set[tuple[str, str]]] = (None, set())

    async def load(self, state: Any, *, step: int | None, tiers: Sequence[str] | None,
                   best: Best | None = None) -> LoadInfo:
        """`best`: load the best checkpoint by that metric instead of the newest (Engine.load refuses it with
        `step`)."""
        started = time.perf_counter()
        allowed = self.io.names if tiers is None else list(tiers)
        unknown = [t for t in allowed if t not in self.io]
        if unknown:
            raise ValueError(f"unknown tier(s) {unknown}; configured: {self.io.names}")
        # retention removes nothing until this load holds the step it picks (ended below, once the reads are done)
        (status, held, shared), removing = await self.busy.pick_and_hold(
            lambda: self._agree_on_step(step, allowed, best), lambda picked: picked[0].step)
        info = LoadInfo(status.step, None)
        # tiers a removal of the step runs on: read it elsewhere. With several ranks each rank's retention runs
        # at its own pace, and `order` must be the same on every rank (it plans the broadcasts): there a removed
        # tier is a fallback, as any missing part is
        if self.coordinator.distributed:
            removing = set()
        order = [n for n in self.io.order(status.complete) if n in allowed and n not in removing]
        error: BaseException | None = None
        manifest: Manifest | None = None
        reads: Reads | None = None
        holdings: dict[str, frozenset[int]] = {}
        target: LoadTarget | None = None
        with automatic_gc_paused():  # its per-tensor Python would set off full collections (state/gc_pause.py)
            try:  # the step stays busy until the end of this block
                try:  # local work: a failure here must not make this rank skip the collectives below
                    if not order:
                        raise IncompleteCheckpoint(f"step {status.step} is being removed from {sorted(removing)} "
                                                   f"(retention: it is older than what those tiers keep), and no "
                                                   f"other tier allowed holds it")
                    manifest = (await shared.manifest(self.catalog.job, status.step, self.io) if shared is not None
                                else await self.catalog.read_manifest(status.step, order, status.incarnation))
                    # in threads: pairing 100k entries with the saved ones is seconds of Python
                    target = await asyncio.to_thread(self._match, state, manifest)
                    reads = await asyncio.to_thread(plan_reads, manifest, target.tensors)
                    await asyncio.to_thread(lambda: wait_for_devices(target_devices(target.tensors)))  # (100k: a thread)
                    # each part is read where it is fastest: what this node holds, and what the shared tiers hold
                    holdings = {**{t: r for t, r in held.items() if self.io.file_tier(t) is None},
                                **await node_holdings(self.io, manifest, order)}
                    if self.coordinator.distributed:
                        self._warn_if_moved(manifest)
                except Exception as e:
                    error = error or e
                try:  # every rank enters the same collectives, whatever happened above
                    refused = await self._unexpected(target if error is None else None)
                    error = error or refused
                except Exception as e:
                    error = error or e
                try:
                    await read_parts(self.io, self.coordinator, manifest if error is None else None, order, reads,
                                     info.reads, holdings)
                except Exception as e:
                    error = error or e
                finally:  # loads are rare: do not hold part-sized buffers between them (freed in a thread: munmap)
                    await self.io.run_blocking(self.io.bounce.clear)
                try:
                    await self.coordinator.agree(error)  # every rank succeeds, or every rank raises
                except Exception as e:
                    raise _partly_overwritten(e, info.reads.overwritten) if info.reads.overwritten else e
                assert reads is not None and target is not None
                await self.io.run_blocking(reads.finish)  # scratch → targets, only once every rank read everything
                await self.io.run_blocking(target.copy_ties)
                # what the load made per tensor (the scratch too) goes in a thread, a batch at a time, before
                # collection resumes: else the first collection after the pause walks it all at once, on whichever
                # thread, the loop's too, and the last reference dropped on the loop frees it there
                await release_off_loop([info.reads.overwritten, reads, target.tensors])
            finally:
                self.busy.end_load(status.step)
            await asyncio.to_thread(target.apply)  # load_state_dict() of modules and optimizers: seconds for large ones
        await release_off_loop([target])  # (the rest of what it made: not freed by the return, on the loop)
        if self.heal and manifest is not None:
            running = next((t for t, s in self.heals.items() if s == manifest.step), None)  # one heal a step
            damaged = [(f.tier, f.part) for f in info.fallbacks  # this node's copy was to hold the part
                       if self.io.file_tier(f.tier) and (k := parse_key(f.part)) is not None
                       and k.rank in holdings.get(f.tier, ())]
            if running is None:  # the heal takes the manifest over (and frees it: _heal)
                info.heal = asyncio.create_task(self._heal(manifest, order, holdings, held, damaged))
                self.heals[info.heal] = manifest.step
                info.heal.add_done_callback(self._healed)
                manifest = None
            else:
                info.heal = running
        if manifest is not None:  # its paths (one str per tensor) freed in a thread, not by this frame's end
            await release_off_loop([manifest.tensors])
            manifest = None
        info.tier = max(info.bytes_by_tier, key=info.bytes_by_tier.__getitem__, default=order[0] if order else None)
        info.seconds = time.perf_counter() - started
        self._say_fallbacks(info.step, info.fallbacks, holdings)
        return info

    def _say_fallbacks(self, step: int, fallbacks: Sequence[Fallback], holdings: dict[str, frozenset[int]]) -> None:
        """Say each fallback once per process, however many loads of the step read the part (a resume often
        loads a state in pieces: the model, then the optimizer). A node-local tier that holds nothing of the
        step on this node (a memory tier emptied by a reboot) is what a restart leaves, not damage: one info
        line per tier, not a warning per part."""
        if self._fallbacks_said[0] != step:
            self._fallbacks_said = (step, set())
        said = self._fallbacks_said[1]
        empty: set[str] = set()
        new: dict[tuple[str, str], Fallback] = {}
        for f in fallbacks:
            if self.io.file_tier(f.tier) is not None and holdings.get(f.tier) == frozenset():
                empty.add(f.tier)
            elif (f.tier, f.part) not in said:
                new.setdefault((f.tier, f.part), f)
        for tier in sorted(empty - {t for t, part in said if not part}):
            said.add((tier, ""))
            log.info("step %d: tier %s holds none of it on this node (emptied since the save, e.g. by a restart); "
                     "read from the next tier", step, tier)
        if new:
            said.update(new)
            shown = list(new.values())
            log.warning("step %d: %d part read(s) fell back to a slower tier: %s", step, len(shown),
                        "; ".join(f"{f.part} on {f.tier}: {f.reason}" for f in shown[:5]))

    def _healed(self, task: asyncio.Task[HealReport]) -> None:
        self.heals.pop(task, None)
        if not task.cancelled() and task.exception() is None:
            self.reports.append(task.result())
        elif not task.cancelled():
            log.warning("healing after the load failed: %s", task.exception())

    async def wait_healed(self, timeout: float | None = None) -> list[HealReport]:
        """Wait for the heals running now (past `timeout` seconds, cancel them: a heal cut short leaves no copy
        that looks whole); return the reports of every heal finished since the last call."""
        if self.heals:
            _, late = await asyncio.wait(list(self.heals), timeout=timeout)
            for task in late:
                log.warning("healing step %d did not finish in %.0f s: cancelled", self.heals[task], timeout)
                task.cancel()
            if late:
                await asyncio.wait(late)
        reports, self.reports = self.reports, []
        return reports

    async def _heal(self, manifest: Manifest, order: list[str], holdings: dict[str, frozenset[int]],
                    held: dict[str, frozenset[int]], damaged: list[tuple[str, str]]) -> HealReport:
        """In the background: the missing cache copies this rank heals, and the parts its node's copies returned
        damaged (load/heal.py)."""
        try:
            with self.busy.loading(manifest.step):
                return await heal(self.io, self.catalog.index, manifest, order, holdings, self.coordinator.rank,
                                  held, self.coordinator.hosts, damaged)
        finally:  # the manifest's last user (the load handed it over): its paths freed in a thread, not on the loop
            await release_off_loop([manifest.tensors])

    async def _unexpected(self, target: LoadTarget | None) -> BaseException | None:
        """Entries of the checkpoint that a module of this rank's state lacks are an error unless another rank's
        module takes them (pipeline stages split or merged: each stage holds some of the layers the saved stage
        held). Collective with several ranks: one small all_gather, and a second only when some rank has such
        entries. `target` None: this rank failed before; it still takes part."""
        if not self.coordinator.distributed:
            return target.unexpected_error() if target is not None else None
        mine = [f"{m}.{e}" for m, e in target.unexpected] if target is not None else []
        union = set().union(*map(set, await self.coordinator.all_gather_object(mine)))
        if not union:
            return None
        covered = await self.coordinator.all_gather_object(sorted(union & target.asked) if target is not None else [])
        return target.unexpected_error(set().union(*map(set, covered))) if target is not None else None

    def _warn_if_moved(self, manifest: Manifest) -> None:
        """Say once (rank 0) when ranks now run on other machines than the ones that saved: placement on the
        peer ring is recomputed from the machines at open, and reads follow where the parts are."""
        saved = [r.host for r in manifest.ranks]
        now = self.coordinator.hosts
        moved = [r for r in range(min(len(saved), len(now))) if saved[r] and saved[r] != now[r]]
        if moved and self.coordinator.rank == 0 and manifest.step not in self._moved_said:
            self._moved_said.add(manifest.step)
            log.warning("step %d was saved with rank(s) %s on other machines (%s); the peer ring follows the machines "
                        "of this run, and each part is read on a node that holds it", manifest.step, moved[:8],
                        ", ".join(f"rank {r}: {saved[r]} -> {now[r]}" for r in moved[:4]))

    def _match(self, state: Any, manifest: Manifest) -> LoadTarget:
        """Pair `state` with this rank's saved skeleton (rank 0's for a rank the saved world lacked); keys it
        lacks are looked up in the other ranks' skeletons."""
        rank = self.coordinator.rank
        source = rank if rank < manifest.world_size else 0
        decoded: dict[int, Any] = {}

        def skeleton_of(r: int) -> Any:  # decoded on demand, once
            if r not in decoded:
                decoded[r] = decode_skeleton(manifest.skeleton_of(r))
            return decoded[r]

        others = [lambda r=r: skeleton_of(r) for r in range(len(manifest.ranks)) if r != source]
        return match(state, skeleton_of(source), tensors=SavedByPath(manifest.tensors), others=others,
                     allow_pickle=self.allow_pickle, rank=rank, saved_world=manifest.world_size,
                     skeleton_of=skeleton_of)

    async def _agree_on_step(self, step: int | None, allowed: list[str], best: Best | None,
                             ) -> tuple[CheckpointStatus, dict[str, frozenset[int]], SharedManifest | None]:
        """Rank 0 picks the checkpoint and every rank loads that one (or raises the same error); with it, what
        rank 0 found each tier to hold of it (saved ranks per tier). Rank 0 judges node-local tiers from every
        node's listing (one rank per machine lists them), never from its own alone. With several ranks, rank 0
        also reads the manifest and every rank's checksum record and hands them on in the same broadcast: the
        index is read once per world, not once per rank (before: every rank read all R records, ~10^8 index
        reads for a resume of 10,240 ranks)."""
        asked = (step, tuple(self.io.order(allowed)), None if best is None else (best.metric, best.mode))
        listings = await self._node_listings(allowed, asked) if self.coordinator.distributed else None

        async def pick() -> tuple[CheckpointStatus | None, dict[str, frozenset[int]], list[int], str,
                                  SharedManifest | None]:
            try:
                status = await self.catalog.pick(step, allowed, best, listings)
            except FreshStart as e:  # an answer, not a failure: every rank learns which steps were lost
                return None, {}, [s.step for s in self.catalog.lost], str(e), None
            shared = None if not self.coordinator.distributed else await SharedManifest.read(self.catalog, status,
                                                                                               allowed)
            return status, self._held(status), [s.step for s in self.catalog.lost], "", shared

        status, held, lost, fresh, shared = await self.coordinator.on_first(
            pick, "picking the checkpoint to load", answers=(IncompleteCheckpoint, CheckpointLost))
        if lost:  # the same on every rank: each forgets them, and the next save removes them (rank 0)
            self.lost.update(lost)
        if status is None:
            log.warning("%s", fresh)
            raise FreshStart(fresh)
        return status, held, shared

    def _held(self, status: CheckpointStatus) -> dict[str, frozenset[int]]:
        held = self.catalog.held
        return held[1] if held is not None and held[0] == status.step else {}

    async def _node_listings(self, allowed: list[str], asked: tuple[Any, ...]) -> dict[str, list[str] | None]:
        """Collective: every node's records (manifests, markers, checksum records: no parts) on the node-local
        tiers among `allowed`, put together per tier; None for a tier some node could not list (what it holds is
        unknown, so the pick does not count its ranks as lost). One rank per machine lists. With them, what
        each rank asked for (`asked`: step, tiers, best): ranks that asked for different loads all raise."""
        mine: dict[str, list[str] | None] = {}
        if self.coordinator.lists_for_node():
            for name in self.io.order(allowed):
                if self.io.file_tier(name) is None:
                    continue
                try:
                    keys = await self.io.list(name, job_prefix(self.catalog.job))
                except TierError as e:
                    log.warning("tier %s cannot be listed on %s: %s", name, self.coordinator.host, e)
                    mine[name] = None
                    continue
                mine[name] = [k for k in keys if (p := parse_key(k)) is not None and p.kind != "part"]
        merged: dict[str, set[str] | None] = {}
        gathered = await self.coordinator.all_gather_object((asked, mine))
        if any(a != gathered[0][0] for a, _ in gathered):
            by_request: dict[tuple[Any, ...], list[int]] = {}
            for r, (a, _) in enumerate(gathered):
                by_request.setdefault(a, []).append(r)
            raise ValueError("the ranks asked for different loads (every rank must pass the same step, tiers and "
                             "best): " + "; ".join(f"{_ranks(ranks)}: step={a[0]}, tiers={list(a[1])}, best={a[2]}"
                                                   for a, ranks in by_request.items()))
        for _, listing in gathered:
            for name, keys in listing.items():
                if keys is None or merged.get(name, set()) is None:
                    merged[name] = None
                else:
                    merged.setdefault(name, set()).update(keys)  # type: ignore[union-attr]
        return {name: None if keys is None else sorted(keys) for name, keys in merged.items()}


class SavedByPath(Mapping[str, SavedTensor]):
    """The manifest's tensors by path for `match`: a SavedTensor is made for the paths the state asks for, when
    it asks (no object per saved tensor kept: see manifest/table.py)."""

    def __init__(self, table: TensorTable):
        self.table = table
        self.index = table.index_by_path()
        self._dtypes: list[Any] = [None] * len(table.dtype_names)  # by the table's dtype index, made on first use
        # (a dtype this torch lacks fails only the load of a tensor that has it)

    def __getitem__(self, path: str) -> SavedTensor:
        i = self.index[path]
        d = self.table.dtype[i]
        dtype = self._dtypes[d]
        if dtype is None:
            dtype = self._dtypes[d] = dtype_from_str(self.table.dtype_names[d])
        return SavedTensor(i, dtype, self.table.shape_of(i))

    def get(self, path: str, default: Any = None) -> Any:  # (Mapping's own goes through a KeyError per miss)
        return self[path] if path in self.index else default

    def __iter__(self) -> Iterator[str]:
        return iter(self.table.paths)

    def __len__(self) -> int:
        return len(self.table)


def _partly_overwritten(error: BaseException, keys: set[str]) -> BaseException:
    """A load that failed after some verified parts reached the given state: the same error, saying which
    entries changed."""
    shown = sorted(keys)
    more = f" and {len(shown) - 10} more" if len(shown) > 10 else ""
    wrapped = copy.copy(error)
    wrapped.args = (f"{error} (entries of the given state already overwritten with checkpoint data: "
                    f"{shown[:10]}{more}; the others are untouched)",)
    wrapped.__cause__ = error
    return wrapped


def _ranks(ranks: list[int]) -> str:
    """"rank 3", or "ranks 0-2, 5" (thousands of ranks in one line)."""
    runs: list[str] = []
    start = prev = ranks[0]
    for r in [*ranks[1:], None]:
        if r is not None and r == prev + 1:
            prev = r
            continue
        runs.append(str(start) if start == prev else f"{start}-{prev}")
        if r is not None:
            start = prev = r
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(runs)
