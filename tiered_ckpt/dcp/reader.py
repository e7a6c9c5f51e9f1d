"""`StorageReader`: DCP's load (dcp.load) from a tiered_ckpt checkpoint, resharded by DCP's own planner.

The step (given, or the newest complete one, agreed on by every rank) is read from the fastest tier that holds
it complete, part by part through the engine's verified reads: every part's checksum is checked, and a
missing, short or corrupt part is read again from the next tier. DCP's Metadata comes from the manifest
(layout.py), so any checkpoint whose state is DCP-shaped (flat or nested dicts of tensors and DTensors, e.g.
one saved by tc.Checkpointer) loads too. Reads are held from retention while they run, as a load is.
"""
from __future__ import annotations

import io
import os
from typing import Any

import torch
from torch.futures import Future
from torch.distributed.checkpoint import StorageReader as _StorageReader
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner

from ..errors import IncompleteCheckpoint, IntegrityError
from ..load.export.reader import TensorReader
from ..manifest import Manifest
from ..storage.index import CheckpointStatus
from ..storage.verified_read import ReadLog
from .engines import ConfigLike, checkpointer, resolve
from .layout import Stored, merged_mappings, metadata_of, planner_paths
from .steps import checkpoint_id, step_of


class StorageReader(_StorageReader):
    """Loads checkpoint `step` (None: the newest complete one) of the job `config` describes (a TOML file or
    a Config; `job` replaces its `[engine] job`). Every rank makes it at the same point (with step=None the
    ranks agree on the step then: one small collective). `reads` says which tiers served how many bytes."""

    def __init__(self, config: ConfigLike, *, job: str | None = None, step: int | None = None):
        super().__init__()
        self.config = resolve(config, job)
        self.job = self.config.engine.job
        self._ckpt = checkpointer(self.config)
        self.step = self._agreed(step)
        self.reads = ReadLog()
        self._manifest: Manifest | None = None
        self._status: CheckpointStatus | None = None
        self._metadata: Metadata | None = None

    def _run(self, coro: Any) -> Any:
        return self._ckpt._run(coro)

    def _agreed(self, step: int | None) -> int:
        """The step to read, the same on every rank: `step`, checked to be complete, or rank 0's newest."""
        engine = self._ckpt.engine
        picked = self._run(self._pick(step)).step if step is not None or engine.rank == 0 else None
        return self._run(engine.coordinator.broadcast_object(picked)) if step is None else picked

    async def _pick(self, step: int | None) -> CheckpointStatus:
        store = self._ckpt.engine.store
        try:
            return await store.catalog.pick(step, store.io.names)
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
        order = store.io.order(status.complete)
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
        held, removing = await store.busy.pick_and_hold(lambda: store.catalog.pick(status.step, store.io.names),
                                                        lambda s: s.step)
        try:
            order = [t for t in store.io.order(held.complete) if t not in removing]
            if not order:
                raise IncompleteCheckpoint(f"job {self.job!r}: step {status.step} is being removed from every tier "
                                           f"that holds it (retention)")
            uses = [index[p] for p in paths]
            reader = TensorReader(store.io, manifest, order, uses, self.reads, None)
            out = [await reader.get(i) for i in uses]
            await store.io.run_blocking(store.io.bounce.clear)
            return out
        finally:
            store.busy.end_load(status.step)

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        self._metadata = metadata

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        return plans

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        """Each saved tensor this rank's items need is read whole once, then each item's box is copied from it
        into the planner's tensor (DCP reshards by choosing the boxes)."""
        if self._manifest is None:
            self.read_metadata()
        storage = self.read_metadata().storage_data
        wanted = [(item, storage[item.storage_index]) for item in plan.items]
        paths = list(dict.fromkeys(stored.path for _, stored in wanted))
        tensors = dict(zip(paths, self._run(self._tensors(paths)))) if paths else {}
        for item, stored in wanted:
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


def _box(t: torch.Tensor, offsets: Any, lengths: Any) -> torch.Tensor:
    for dim, (start, length) in enumerate(zip(offsets, lengths)):
        t = t.narrow(dim, start, length)
    return t


__all__ = ["StorageReader"]
