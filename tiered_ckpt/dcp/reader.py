"""`StorageReader`: DCP's load (dcp.load) from a tiered_ckpt checkpoint, resharded by DCP's own planner.

The step (given, or the newest complete one, agreed on by every rank) is read from the fastest tier that holds
it complete, part by part through the engine's verified reads: every part's checksum is checked, and a
missing, short or corrupt part is read again from the next tier. DCP's Metadata comes from the manifest
(layout.py), so any checkpoint whose state is DCP-shaped (flat or nested dicts of tensors and DTensors, e.g.
one saved by tc.Checkpointer) loads too. Reads are held from retention while they run, as a load is.
"""
from __future__ import annotations

import asyncio
import contextlib
import io
import os
from typing import Any, AsyncIterator, Sequence

import torch
from torch.futures import Future
from torch.distributed.checkpoint import StorageReader as _StorageReader
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner

from ..errors import IncompleteCheckpoint, IntegrityError
from ..load.export.reader import TensorReader
from ..load.reads import Boxed, Reads, parts_to_read, plan_reads, rank_spans
from ..manifest import Manifest
from ..storage.index import CheckpointStatus
from ..storage.verified_read import ReadLog
from .engines import ConfigLike, checkpointer, resolve
from .layout import Stored, merged_mappings, metadata_of, planner_paths
from .steps import checkpoint_id, step_of


class StorageReader(_StorageReader):
    """Loads checkpoint `step` (None: the newest complete one) of the job `config` describes (a TOML file or
    a Config; `job` replaces its `[engine] job`), from `tiers` alone when given (names, e.g. ["disk"]). Every
    rank makes it at the same point (with step=None the ranks agree on the step then: one small collective).
    `reads` says which tiers served how many bytes, and which reads fell back."""

    def __init__(self, config: ConfigLike, *, job: str | None = None, step: int | None = None,
                 tiers: Sequence[str] | None = None):
        super().__init__()
        if isinstance(tiers, str):
            raise TypeError(f"tiers takes a list of tier names, not the string {tiers!r}: tiers=[{tiers!r}]")
        self.config = resolve(config, job)
        self.job = self.config.engine.job
        self._ckpt = checkpointer(self.config)
        names = self._ckpt.engine.store.io.names
        unknown = [t for t in tiers or () if t not in names]
        if unknown:
            raise ValueError(f"job {self.job!r}: no tier {unknown[0]!r} in {self.config.source or 'the config'} "
                             f"(tiers: {', '.join(names)})")
        self.tiers = list(tiers) if tiers is not None else list(names)  # which may serve, fastest first
        self.step = self._agreed(step)
        self.reads = ReadLog()
        self._manifest: Manifest | None = None
        self._status: CheckpointStatus | None = None
        self._metadata: Metadata | None = None

    def _run(self, coro: Any) -> Any:
        return self._ckpt._run(coro)

    def _agreed(self, step: int | None) -> int:
        """The step to read, the same on every rank: `step`, checked to be complete, or rank 0's newest (rank 0's
        error, when it has none, is raised on every rank: none waits for a step that will not come)."""
        engine = self._ckpt.engine
        if step is not None:
            return self._run(self._pick(step)).step
        picked: tuple[int | None, str | None] = (None, None)
        if engine.rank == 0:
            try:
                picked = (self._run(self._pick(None)).step, None)
            except IncompleteCheckpoint as e:
                picked = (None, str(e))
        if engine.world_size > 1:
            picked = self._run(engine.coordinator.broadcast_object(picked))
        if picked[1] is not None:
            raise IncompleteCheckpoint(picked[1])
        assert picked[0] is not None
        return picked[0]

    async def _pick(self, step: int | None) -> CheckpointStatus:
        store = self._ckpt.engine.store
        try:
            return await store.catalog.pick(step, self.tiers)
        except IncompleteCheckpoint as e:
            complete = [s.step for s in await store.catalog.statuses() if s.complete]
            source = self.config.source or "the config"
            raise IncompleteCheckpoint(f"job {self.job!r} ({source}): {e}; complete checkpoints: "
                                       f"{complete or 'none'}") from None

    def reset(self, checkpoint_id: str | os.PathLike[str] | int | None = None) -> None:
        """Another checkpoint: `checkpoint_id` an int step, or an id ending in the step ('step-1000')."""
        if checkpoint_id is not None:
            self.step = step_of(checkpoint_id)
        self._manifest = self._status = self._metadata = None

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        return os.fspath(checkpoint_id).startswith("tiered_ckpt://")

    # -- DCP's load protocol ---------------------------------------------------------------------
    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        if self._metadata is None:
            self._metadata = self._run(self._read_metadata())
        return self._metadata

    async def _read_metadata(self) -> Metadata:
        store = self._ckpt.engine.store
        status = await self._pick(self.step)
        order = store.io.order(status.complete & set(self.tiers))
        manifest = await store.catalog.read_manifest(status.step, order, status.incarnation)
        self._status, self._manifest = status, manifest
        paths = planner_paths(manifest)
        blobs = [bytes(t.numpy()) for t in await self._tensors(paths)] if paths else []
        return metadata_of(manifest, merged_mappings(blobs), checkpoint_id(self.job, status.step))

    async def _tensors(self, paths: list[str]) -> list[torch.Tensor]:
        """Whole saved tensors by path, through the verified reads, the step held from retention meanwhile."""
        store, manifest, status = self._ckpt.engine.store, self._manifest, self._status
        assert manifest is not None and status is not None
        index = {t.path: i for i, t in enumerate(manifest.tensors)}
        missing = [p for p in paths if p not in index]
        if missing:
            raise IntegrityError(f"job {self.job!r} step {status.step}: the manifest has no tensor {missing[0]!r}")
        async with self._held() as order:
            uses = [index[p] for p in paths]
            reader = TensorReader(store.io, manifest, order, uses, self.reads, None)
            out = [await reader.get(i) for i in uses]
            await store.io.run_blocking(store.io.bounce.clear)
            return out

    @contextlib.asynccontextmanager
    async def _held(self) -> AsyncIterator[list[str]]:
        """The tiers to read the step from, fastest first, with the step held from retention meanwhile."""
        store, status = self._ckpt.engine.store, self._status
        assert status is not None
        held, removing = await store.busy.pick_and_hold(lambda: store.catalog.pick(status.step, self.tiers),
                                                        lambda s: s.step)
        try:
            order = [t for t in store.io.order(held.complete & set(self.tiers)) if t not in removing]
            if not order:
                raise IncompleteCheckpoint(f"job {self.job!r}: step {status.step} is being removed from every tier "
                                           f"that holds it (retention)")
            yield order
        finally:
            store.busy.end_load(status.step)

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        self._metadata = metadata

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        return plans

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        """The items' bytes, read through the verified reads. With DCP's DefaultLoadPlanner (which only narrows
        its tensors to each item's box) every destination tensor is filled in place by the engine's own read
        plan, straight from the parts where the boxes match; with another planner each saved tensor this rank
        needs is read whole, then each item's box is copied out of it through the planner's calls."""
        storage = self.read_metadata().storage_data
        if self._manifest is None:
            self._run(self._read_metadata())
        wanted = [(item, storage[item.storage_index]) for item in plan.items]
        byte_items = [(i, s) for i, s in wanted if i.type == LoadItemType.BYTE_IO]
        tensor_items = [(i, s) for i, s in wanted if i.type != LoadItemType.BYTE_IO]
        if tensor_items and _narrows_only(planner):
            self._run(self._read_into(_destinations(tensor_items, planner)))
            tensor_items = []
        copied = byte_items + tensor_items
        paths = list(dict.fromkeys(stored.path for _, stored in copied))
        tensors = dict(zip(paths, self._run(self._tensors(paths)))) if paths else {}
        for item, stored in copied:
            source = tensors[stored.path]
            if item.type == LoadItemType.BYTE_IO:
                planner.load_bytes(item, io.BytesIO(bytes(source.numpy())))
                continue
            target = planner.resolve_tensor(item).detach()  # the planner narrowed it to the item's box already
            box = _box(source, [o + s for o, s in zip(stored.offsets, item.storage_offsets)], item.lengths)
            if target.shape != box.shape:
                raise IntegrityError(f"job {self.job!r} step {self.step}: {item.dest_index.fqn!r} wants a box of "
                                     f"shape {tuple(target.shape)}, the checkpoint's is {tuple(box.shape)}")
            target.copy_(box)
            planner.commit_tensor(item, target)
        future: Future[None] = Future()
        future.set_result(None)
        return future

    async def _read_into(self, targets: dict[str, Boxed]) -> None:
        """Fill `targets` (saved path -> its destination box) in place: the load path's read plan and verified
        part reads, the step held from retention meanwhile."""
        store, manifest, status = self._ckpt.engine.store, self._manifest, self._status
        assert manifest is not None and status is not None
        index = {t.path: i for i, t in enumerate(manifest.tensors)}
        async with self._held() as order:
            def plan() -> tuple[Reads, dict[Any, Any]]:
                reads = plan_reads(manifest, {index[path]: (path, box) for path, box in targets.items()})
                spans = {r.rank: rank_spans(manifest, r.rank) for r in manifest.ranks}
                return reads, parts_to_read(manifest, reads, spans=spans)

            reads, parts = await asyncio.to_thread(plan)
            reading = (store.io.read_verified(parts[k], order, self.reads) for k in sorted(parts))
            outcomes = await asyncio.gather(*reading, return_exceptions=True)
            failed = [o for o in outcomes if isinstance(o, BaseException)]
            if failed:
                raise failed[0]
            await store.io.run_blocking(reads.finish)
            await store.io.run_blocking(reads.release)


def _narrows_only(planner: LoadPlanner) -> bool:
    """The planner's tensor calls are DCP's DefaultLoadPlanner's: a destination is its state's tensor, each item
    a box of it, and committing does nothing."""
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

    return isinstance(planner, DefaultLoadPlanner) and all(
        getattr(type(planner), name) is getattr(DefaultLoadPlanner, name)
        for name in ("resolve_tensor", "lookup_tensor", "transform_tensor", "commit_tensor"))


def _destinations(items: list[tuple[Any, Stored]], planner: Any) -> dict[str, Boxed]:
    """Each saved tensor the items read from -> the destination they fill: the state's (local) tensor, placed
    at its offsets in the global tensor."""
    out: dict[str, Boxed] = {}
    for item, stored in items:
        dest = item.dest_index
        if stored.path in out:
            continue
        tensor = planner.lookup_tensor(dest).detach()
        offsets = tuple(dest.offset) if dest.offset is not None else (0,) * tensor.dim()
        out[stored.path] = Boxed(tensor, offsets)
    return out


def _box(t: torch.Tensor, offsets: Any, lengths: Any) -> torch.Tensor:
    for dim, (start, length) in enumerate(zip(offsets, lengths)):
        t = t.narrow(dim, start, length)
    return t


__all__ = ["StorageReader"]
