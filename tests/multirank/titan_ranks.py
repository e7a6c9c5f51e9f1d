"""Rank bodies for test_torchtitan.py: a torchtitan training loop in small (FSDP2 at 2 ranks on gloo, torchtitan's
OptimizersContainer and LRSchedulersContainer, a stateful data loader, a train-state object) whose checkpoints
go through TieredCheckpointManager, built from its Config as torchtitan's trainer builds its manager."""
from __future__ import annotations

import os
import signal
from typing import Any

import torch


class Loader:
    """A data loader that resumes where it stopped (torchtitan's are Stateful the same way)."""

    def __init__(self) -> None:
        self.position = 0

    def next(self) -> torch.Tensor:
        self.position += 1
        return torch.randn(4, 12, generator=torch.Generator().manual_seed(self.position))

    def state_dict(self) -> dict[str, Any]:
        return {"position": self.position}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.position = state["position"]


class TrainState:
    def __init__(self) -> None:
        self.step = 0

    def state_dict(self) -> dict[str, Any]:
        return {"step": torch.tensor(self.step)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.step = int(state["step"])


def train(rank: int, world: int, toml: str, job: str, steps: int, kill_after: int | None,
          folder: str) -> dict[str, Any]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torchtitan.components.optimizer import OptimizersContainer
    from torchtitan.components.optimizer.optimizer import default_adamw
    from torchtitan.components.optimizer.lr_scheduler import LRSchedulersContainer

    from tiered_ckpt.dcp import close
    from tiered_ckpt.integrations.torchtitan import TieredCheckpointManager

    from .dcp_ranks import Net

    torch.manual_seed(0)
    model = Net()
    fully_shard(model, mesh=init_device_mesh("cpu", (world,)))
    optimizers = OptimizersContainer(default_adamw(lr=0.01), model_parts=[model])
    schedulers = LRSchedulersContainer(optimizers, lambda step: 1.0 / (1 + step))
    loader, state = Loader(), TrainState()
    config = TieredCheckpointManager.Config(enable=True, interval=2, async_mode="async", tiered_config=toml,
                                            tiered_job=job, last_save_model_only=False, folder="ckpt")
    manager = config.build(dataloader=loader, model_parts=[model], optimizers=optimizers, lr_schedulers=schedulers,
                           states={"train_state": state}, sd_adapter=None, base_folder=folder)
    resumed = manager.load()
    start = state.step
    while state.step < steps:
        state.step += 1
        model(loader.next()).sum().backward()
        optimizers.step()
        schedulers.step()
        optimizers.zero_grad()
        manager.save(state.step, last_step=state.step == steps)
        if state.step == kill_after:
            manager.maybe_wait_for_saving()
            os.kill(os.getpid(), signal.SIGKILL)  # no close, no atexit: as a node failure would
    manager.maybe_wait_for_saving()
    manager.close()
    full = {k: (v.full_tensor() if hasattr(v, "full_tensor") else v).clone() for k, v in model.state_dict().items()}
    optim = optimizers.state_dict()
    moments = {k: (v.full_tensor() if hasattr(v, "full_tensor") else v).clone() for k, v in optim.items()
               if isinstance(v, torch.Tensor)}
    close()
    return {"resumed": resumed, "start": start, "model": full, "optim": moments, "position": loader.position,
            "lr": schedulers.schedulers[0].get_last_lr()}
