"""TrainState: a model and its optimizers as one stateful object, through torch's own
get_state_dict/set_state_dict (torch.distributed.checkpoint.state_dict).

Those helpers give fully-qualified parameter names as keys (not optimizer-internal ids), keep FSDP/TP
shards as DTensors, and initialize a fresh optimizer's state, so loading works in place and reshards to
whatever parallelism the new job uses. Plain (unsharded) models work too.
"""
from __future__ import annotations

from typing import Any, Iterable

import torch


class TrainState:
    """A model and its optimizers saved through torch's `get_state_dict`/`set_state_dict`, so sharded models
    (FSDP2, DTensor) save each rank's shards and load into any world size or layout."""

    strict_keys = ("model",)  # the model's entries must match exactly, as set_state_dict will demand
    # the optimizers' state as get_state_dict gives it names every parameter this rank's optimizers hold (a
    # fresh optimizer's state is initialised): saved entries of other parameters (another pipeline stage's)
    # are not read; each param group takes its hyper-parameters from the saved group holding its parameters
    own_keys = ("optim",)

    def __init__(self, model: torch.nn.Module, optimizers: torch.optim.Optimizer | Iterable[torch.optim.Optimizer] = (),
                 options: Any = None):
        self.model = model
        self.optimizers = (optimizers,) if isinstance(optimizers, torch.optim.Optimizer) else tuple(optimizers)
        self.options = options

    def state_dict(self) -> dict[str, Any]:
        """{"model": ..., "optim": ...} as get_state_dict gives them (DTensors stay sharded)."""
        from torch.distributed.checkpoint.state_dict import get_state_dict

        model_sd, optim_sd = get_state_dict(self.model, self.optimizers, options=self.options)
        return {"model": model_sd, "optim": optim_sd}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Put a loaded state back into the model and optimizers (set_state_dict)."""
        from torch.distributed.checkpoint.state_dict import set_state_dict

        set_state_dict(self.model, self.optimizers, model_state_dict=state["model"],
                       optim_state_dict=state["optim"], options=self.options)
