"""torchtitan (0.3): a checkpoint manager that saves and loads through tiered_ckpt's tiers.

torchtitan builds its checkpoint manager from the trainer config's `checkpoint` field, a
`BaseCheckpointManager.Config` whose owner class `build()` constructs. `TieredCheckpointManager.Config` is
torchtitan's DCP manager's Config plus `tiered_config` (the TOML file of the tiers) and `tiered_job`, so a
torchtitan config selects tiered_ckpt by that field alone:

    checkpoint=TieredCheckpointManager.Config(enable=True, interval=500, async_mode="async",
                                              tiered_config="/etc/tiered.toml")

Everything torchtitan's manager does stays (its states: model, optimizers, lr schedulers, dataloader, train
state; the interval, the last step's model-only save, loads from an initial path or Hugging Face files); only
its own DCP saves and loads go through `tiered_ckpt.dcp`'s StorageWriter and StorageReader. Retention is the
tiers' (`keep_last` of each tier), so torchtitan's `keep_latest_k` purge is off; `async_mode =
"async_with_pinned_mem"` (DCP's staging process) becomes "async": the writer stages into the engine's reused
(pinned, for GPU tensors) buffers itself, in the training thread, and the rest runs in DCP's save thread.
"""
from __future__ import annotations

import dataclasses
import logging
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torchtitan.components.checkpointer.base import MODEL
from torchtitan.components.checkpointer.dcp import AsyncMode, CheckpointManager

from ..dcp import StorageReader, StorageWriter
from ..dcp.engines import resolve
from ..dcp.steps import step_of
from ..errors import ConfigError, IncompleteCheckpoint

log = logging.getLogger(__name__)


class TieredCheckpointManager(CheckpointManager):
    """torchtitan's DCP CheckpointManager with tiered_ckpt's StorageWriter and StorageReader as its storage."""

    @dataclasses.dataclass(kw_only=True, slots=True)
    class Config(CheckpointManager.Config):
        tiered_config: str = ""
        """The tiered_ckpt TOML file: the tiers, the index, the job."""

        tiered_job: str | None = None
        """Replaces the file's `[engine] job` when set (e.g. the run's name)."""

    def __init__(self, config: Config, **kwargs: Any) -> None:
        if config.enable and not config.tiered_config:
            raise ConfigError("checkpoint.tiered_config is empty: name the tiered_ckpt TOML file",
                              key="checkpoint.tiered_config")
        self.tiered = resolve(config.tiered_config, config.tiered_job) if config.enable else None
        own = dataclasses.replace(config, keep_latest_k=0)  # the tiers' keep_last retires old checkpoints
        if own.async_mode == AsyncMode.ASYNC_WITH_PINNED_MEM.value:
            log.info("checkpoint.async_mode async_with_pinned_mem: tiered_ckpt stages into its own reused buffers "
                     "and saves in DCP's thread (async)")
            own = dataclasses.replace(own, async_mode=AsyncMode.ASYNC.value)
        super().__init__(own, **kwargs)

    @torch.no_grad()
    def dcp_save(self, state_dict: dict[str, Any], checkpoint_id: str, async_mode: AsyncMode,
                 enable_garbage_collection: bool = False, to_hf: bool = False) -> Any:
        """torchtitan's save of one step (`checkpoint_id` ends in 'step-N'), through the tiers; a Hugging Face
        export (to_hf) is torchtitan's own, to its folder."""
        if to_hf:
            return super().dcp_save(state_dict, checkpoint_id, async_mode, enable_garbage_collection, to_hf)
        writer = StorageWriter(self.tiered, step=step_of(checkpoint_id))
        if async_mode == AsyncMode.DISABLED:
            dcp.save(state_dict, storage_writer=writer)
            return None
        return dcp.async_save(state_dict, storage_writer=writer, process_group=self.pg)

    def _find_load_step(self, folder: str = "") -> int:
        """The newest checkpoint complete on some tier (agreed on by every rank), or -1 when the job has none."""
        if folder:  # torchtitan's own folder of DCP files (an initial load)
            return super()._find_load_step(folder)
        try:
            return StorageReader(self.tiered).step
        except IncompleteCheckpoint:
            return -1

    @torch.no_grad()
    def _load(self, step: int = -1) -> bool:
        """Load `step` (or the newest) from the tiers; with none there, torchtitan's own fresh start or initial
        load (initial_load_path, Hugging Face files)."""
        load_step = self._find_load_step() if step == -1 else step
        if load_step == -1:
            return super()._load(step)
        states = self._states_to_load(model_only=load_step == 0)
        dcp.load(states, storage_reader=StorageReader(self.tiered, step=load_step))
        if MODEL in self.states:
            self.states[MODEL].load_state_dict(states)
        log.info("loaded checkpoint step %d of job %r through tiered_ckpt", load_step, self.tiered.engine.job)
        return True
