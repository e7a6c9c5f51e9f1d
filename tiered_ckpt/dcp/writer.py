"""`StorageWriter`: DCP's save (dcp.save, dcp.async_save) through tiered_ckpt's engine and its tiers.

The data goes through the engine's save path: one copy into the engine's reused staging buffers (pinned host
memory for GPU tensors; with the memory tier first, its own files), then every tier in the background, with
its retention. Under `dcp.async_save` the writer is also DCP's AsyncStager (a subclass of it, so async_save
takes it in place of its DefaultStager and makes no copy of its own): `stage()` runs that save at once, in the
training thread, so the training step waits for the copy alone; DCP's planning and `write_data`, in async_save's
thread, then find the data staged. The step of that save is async_save's `checkpoint_id` when given, else the
writer's own (see stage()). DCP's Metadata is not written separately: it is read back from the checkpoint's
manifest (see layout.py), so it becomes visible with the data, at the commit, once every rank's data is
durable on a tier.
`finish()` (DCP's coordinator) waits until the save is durable on the first tier (or every tier with
durable="all"), so `dcp.save` returning, or async_save's future completing, means it can be loaded.
"""
from __future__ import annotations

import logging
import os
from typing import Any

import torch
from torch.futures import Future
from torch.distributed.checkpoint import StorageWriter as _StorageWriter
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex, StorageMeta
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner, WriteItemType
from torch.distributed.checkpoint.staging import AsyncStager
from torch.distributed.checkpoint.storage import WriteResult

from ..sync import SyncSaveHandle
from .engines import ConfigLike, checkpointer, resolve
from .layout import Stored, bytes_path, check_whole, rank_state
from .steps import async_save_call, checkpoint_id, step_of

log = logging.getLogger(__name__)
DURABLE = ("first", "all", "staged")


class StorageWriter(_StorageWriter, AsyncStager):
    """Saves a DCP checkpoint as checkpoint `step` of the job `config` describes (a TOML file or a Config;
    `job` replaces its `[engine] job`). `durable`: what finish() waits for: "first" (the fastest tier the step
    goes to has committed it: loadable), "all" (every tier), "staged" (nothing: the save goes on in the
    background). A writer saves one step; `reset(checkpoint_id)` points it at another."""

    # stage() returns once the copy is done: async_save has nothing to wait for after it (synchronize_staging)
    _synchronize_after_execute: bool = False

    def __init__(self, config: ConfigLike, *, job: str | None = None, step: int | None = None,
                 durable: str = "first"):
        super().__init__()
        if durable not in DURABLE:
            raise ValueError(f"durable={durable!r}: choose one of {', '.join(DURABLE)}")
        self.config = resolve(config, job)
        self.job = self.config.engine.job
        self.durable = durable
        self.step = self._checked(step) if step is not None else None
        self._ckpt = checkpointer(self.config)
        self._handle: SyncSaveHandle | None = None
        self._staged_step: int | None = None
        self.rank = 0
        self.is_coordinator = True

    # -- which checkpoint -----------------------------------------------------------------------
    def _checked(self, step: int) -> int:
        if type(step) is not int or step < 0:
            raise ValueError(f"step must be a non-negative int, got {step!r}")
        tiers = [t.name for t in self.config.tiers if step % t.every == 0]
        if not tiers:
            everies = ", ".join(f"{t.name}: every = {t.every}" for t in self.config.tiers)
            source = self.config.source or "the config"
            raise ValueError(f"job {self.job!r}: no tier takes step {step} ({everies}, in {source}): nothing "
                             f"would be saved")
        return step

    def reset(self, checkpoint_id: str | os.PathLike[str] | int | None = None) -> None:
        """A new save; `checkpoint_id` (an int, or an id ending in the step, as 'step-1000') sets its step.
        Between stage() and write_data (async_save's thread resets the writer to its checkpoint_id before
        saving) the staged save is kept when the id names its step, and refused when it names another."""
        step = self._checked(step_of(checkpoint_id)) if checkpoint_id is not None else None
        if self._staged_step is not None:
            if step is not None and step != self._staged_step:
                staged, self._staged_step = self._staged_step, None  # the writer stays usable; .handle: that save
                raise ValueError(f"job {self.job!r}: stage() saved step {staged} (the writer's step), but the "
                                 f"checkpoint_id {checkpoint_id!r} names step {step}; step {staged} is "
                                 f"saved all the same: give the writer the step the checkpoint_id names "
                                 f"(StorageWriter(config, step={step}))")
            return
        if step is not None:
            self.step = step
        self._handle = None

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        return os.fspath(checkpoint_id).startswith("tiered_ckpt://")

    def storage_meta(self) -> StorageMeta | None:
        return StorageMeta(checkpoint_id=checkpoint_id(self.job, self._step()))

    def _step(self) -> int:
        if self.step is None:
            raise ValueError(f"job {self.job!r}: the writer has no step: StorageWriter(config, step=N), or "
                             f"dcp.save(..., checkpoint_id=N)")
        return self.step

    # -- staging (dcp.async_save) ----------------------------------------------------------------
    def stage(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        """The save itself, up to the copy into the engine's staging buffers (the only copy); DCP's planning
        and write_data, in async_save's background, then find it staged. Returns `state_dict` unchanged: what
        DCP still reads of it there is shapes and placements. async_save hands the checkpoint_id to the writer
        only after staging (its thread's reset()), so the step is read from async_save's call here: the
        checkpoint_id given to it, as dcp.save would take it, else the writer's step."""
        from torch.distributed.checkpoint._nested_dict import flatten_state_dict

        call = async_save_call(self) or {}
        if getattr(call.get("async_checkpointer_type"), "name", None) == "PROCESS":
            raise TypeError(self._process_mode_refused())  # before the save starts: nothing is saved
        given = call.get("checkpoint_id")
        if given is not None:
            self.step = self._checked(step_of(given))
        elif self.step is None:
            raise ValueError(f"job {self.job!r}: the writer has no step to stage: StorageWriter(config, step=N), or "
                             f"dcp.async_save(..., checkpoint_id=N)")
        flat, mappings = flatten_state_dict(state_dict)
        self._save(flat.items(), mappings)
        self._staged_step = self._step()
        return state_dict

    def synchronize_staging(self) -> None:
        """stage() returns once the copy is done: nothing to wait for."""

    def close(self) -> None:
        """The engine stays open for the next save (tiered_ckpt.dcp.close() closes it)."""

    def _save(self, values: Any, mappings: Any) -> None:
        import torch.distributed as dist

        self.rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
        state = rank_state(values, self.rank, mappings)
        self._handle = self._ckpt.save(self._step(), state, metadata={"format": "dcp"})

    # -- DCP's save protocol ---------------------------------------------------------------------
    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        self.is_coordinator = is_coordinator
        self.rank = kwargs.get("rank", self.rank)

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        return plan

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        return plans

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        """Save this rank's items (unless stage() did); the results say where each lies in the checkpoint."""
        if self._staged_step is None:
            values = list(self._values(plan, planner))
            self._save(values, getattr(plan, "planner_data", None))
        self._staged_step = None  # used once: a later save with this writer saves its own data
        results = [self._result(item) for item in plan.items]
        future: Future[list[WriteResult]] = Future()
        future.set_result(results)
        return future

    def _values(self, plan: SavePlan, planner: SavePlanner) -> Any:
        originals = getattr(planner, "state_dict", None) or {}
        for item in plan.items:
            fqn = item.index.fqn
            if item.type == WriteItemType.BYTE_IO:
                yield fqn, planner.resolve_data(item)
            else:  # TENSOR, or SHARD: a DTensor's local shard (a ShardedTensor's is refused by rank_state)
                value = originals.get(fqn)
                if not isinstance(value, torch.Tensor) and type(value).__name__ != "ShardedTensor":
                    value = planner.resolve_data(item)
                td = item.tensor_data
                assert td is not None
                check_whole(fqn, td.chunk.offsets, td.chunk.sizes, td.size, value)
                yield fqn, value

    def _result(self, item: Any) -> WriteResult:
        index: MetadataIndex = item.index
        if item.type == WriteItemType.BYTE_IO:
            return WriteResult(index=index, size_in_bytes=0, storage_data=Stored(bytes_path(self.rank, index.fqn), ()))
        td = item.tensor_data
        nbytes = td.chunk.sizes.numel() * td.properties.dtype.itemsize if td is not None else 0
        return WriteResult(index=index, size_in_bytes=nbytes, storage_data=Stored(index.fqn, tuple(index.offset or ())))

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        """DCP's coordinator, once every rank wrote: wait as `durable` says (the save's error is raised here).
        The other ranks' saves commit with this one: the engine's commit waits for every rank."""
        handle = self._handle
        if handle is None:
            raise RuntimeError(f"job {self.job!r}: finish() without a save on this rank")
        try:
            if self.durable == "first" and handle.tiers:
                handle.wait(handle.tiers[0])
            elif self.durable == "all":
                handle.wait()
        except BaseException:
            handle._handle.observed = True  # raised to DCP's caller here: not again at close()
            raise

    def __getstate__(self) -> dict[str, Any]:
        """async_save's process mode (AsyncCheckpointerType.PROCESS) sends the writer, pickled, to DCP's checkpoint
        process; this writer's save runs on the training process's engine (its staging buffers, its gloo group,
        the job's writer role), which no other process can carry on: refused with what to use instead (by
        stage() already, when it sees the mode)."""
        raise TypeError(self._process_mode_refused())

    def _process_mode_refused(self) -> str:
        return (f"job {self.job!r}: tiered_ckpt's StorageWriter cannot be sent to another process (async_save with "
                f"AsyncCheckpointerType.PROCESS): use the thread mode (the default); the writer's stage() already "
                f"limits the training thread's wait to the copy into the engine's buffers, and the tiers are "
                f"written by the engine's own threads")

    @property
    def handle(self) -> SyncSaveHandle | None:
        """This rank's save of the step (waits, tiers, errors), once write_data or stage() started it."""
        return self._handle
