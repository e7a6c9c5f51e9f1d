"""A small LightningModule for tests/integration/test_lightning.py, and, run as a script, one DDP fit on CPU:

    python lightning_script.py CONFIG CKPT_DIR OUT_DIR EPOCHS [--resume]

Lightning's DDP launcher runs this same script again for rank 1. Each rank writes OUT_DIR/rank{r}.json: what
it saw at on_train_start (global step, epoch, weights) and at the end (weights, the buffers ReserveStaging
made, and on rank 0 what ModelCheckpoint kept)."""
from __future__ import annotations

import faulthandler
import json
import signal
import sys
from pathlib import Path
from typing import Any

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint

# per epoch. Top-2 (min) and last.ckpt (saved with each top-k save only): epochs 0, 1 saved; 2 replaces 1;
# 3 saves nothing; 4 replaces 0; 5 nothing; 6 replaces 2. So epochs 2 and 4 end with last.ckpt saved.
SCORES = [3.0, 4.0, 1.0, 5.0, 0.5, 2.0, 0.7, 6.0, 0.9, 0.3]


class TinyModule(L.LightningModule):
    def __init__(self, lr: float = 0.1, width: int = 4, **extra: Any):
        super().__init__()
        self.save_hyperparameters()
        self.net = torch.nn.Sequential(torch.nn.Linear(width, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))

    def training_step(self, batch: Any, _: int) -> torch.Tensor:
        x, y = batch
        return torch.nn.functional.mse_loss(self.net(x), y)

    def validation_step(self, batch: Any, _: int) -> None:
        pass

    def on_validation_epoch_end(self) -> None:
        self.log("score", SCORES[self.current_epoch], sync_dist=True)

    def configure_optimizers(self) -> Any:
        optim = torch.optim.SGD(self.parameters(), lr=self.hparams.lr, momentum=0.9)
        return [optim], [torch.optim.lr_scheduler.StepLR(optim, step_size=2, gamma=0.5)]


def loader() -> torch.utils.data.DataLoader:
    g = torch.Generator().manual_seed(1)
    data = torch.utils.data.TensorDataset(torch.randn(24, 4, generator=g), torch.randn(24, 1, generator=g))
    return torch.utils.data.DataLoader(data, batch_size=4)


def weights(module: torch.nn.Module) -> list[list[float]]:
    return [p.detach().flatten().tolist() for p in module.parameters()]


class Record(Callback):
    """What the trainer holds once training starts (after any restore)."""

    def __init__(self) -> None:
        self.at_start: dict[str, Any] = {}

    def on_train_start(self, trainer: L.Trainer, module: L.LightningModule) -> None:
        self.at_start = {"global_step": trainer.global_step, "epoch": trainer.current_epoch,
                         "weights": weights(module)}


def main() -> None:
    config, ckpt_dir, out_dir, epochs = sys.argv[1], Path(sys.argv[2]), Path(sys.argv[3]), int(sys.argv[4])
    resume = "--resume" in sys.argv
    from tiered_ckpt.integrations.lightning import ReserveStaging, TieredCheckpointIO

    torch.set_num_threads(1)
    torch.manual_seed(0)
    record = Record()
    io = TieredCheckpointIO(config)
    mc = ModelCheckpoint(dirpath=ckpt_dir, monitor="score", mode="min", save_top_k=2, save_last=True)
    trainer = L.Trainer(max_epochs=epochs, strategy="ddp", accelerator="cpu", devices=2, plugins=[io],
                        callbacks=[mc, record, ReserveStaging()], logger=False, enable_progress_bar=False,
                        enable_model_summary=False, limit_val_batches=1)
    module = TinyModule()
    trainer.fit(module, loader(), loader(), ckpt_path="last" if resume else None)
    out = {"rank": trainer.global_rank, "at_start": record.at_start, "global_step": trainer.global_step,
           "epoch": trainer.current_epoch, "weights": weights(module),
           "reserved": io.reservation.made if io.reservation is not None else None}
    if trainer.is_global_zero:
        out.update(kept=sorted(mc.best_k_models), last=mc.last_model_path, checkpoints=io.checkpoints())
        io.teardown()
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / f"rank{trainer.global_rank}.json").write_text(json.dumps(out))


if __name__ == "__main__":
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # a hung run's stacks, for the test to print
    main()
