"""Lightning's saves through `TieredCheckpointIO`, beside Lightning's own `TorchCheckpointIO` and its
`AsyncCheckpointIO`, in the same run (needs the `lightning` extra).

    python -m tiered_ckpt.bench.lightning_saves [--params-mib 128] [--epochs 8] [--steps 16] [--repeats 2]
                                                [--dir /var/tmp]

A module of `--params-mib` of fp32 weights trained with SGD + momentum (a state twice that), `ModelCheckpoint`
with `save_top_k=-1, save_last=True`: two saves an epoch, back to back (its own path, then `last.ckpt`). Each
`save_checkpoint` call is timed: the time the training loop is blocked. `--steps` training steps an epoch
come between the pairs. tiered_ckpt runs with a memory tier
(`keep_last = 2`, its files the staging buffers) and a disk tier, without and with the `ReserveStaging`
callback; the runs take turns.
"""
from __future__ import annotations

import argparse
import json
import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

SCORES = [3.0, 4.0, 1.0, 5.0, 0.5, 2.0, 0.7, 6.0, 0.9, 0.3]


def _module(width: int, layers: int) -> Any:
    import lightning as L

    class Linears(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(layers)])

        def training_step(self, batch: Any, _: int) -> torch.Tensor:
            return self.net(batch[0]).pow(2).mean()

        def validation_step(self, batch: Any, _: int) -> None:
            pass

        def on_validation_epoch_end(self) -> None:
            self.log("score", SCORES[self.current_epoch % len(SCORES)])

        def configure_optimizers(self) -> Any:
            return torch.optim.SGD(self.parameters(), lr=1e-6, momentum=0.9)

    return Linears()


def _config(work: Path, shm: Path, capacity: int) -> Path:
    path = work / "tiers.toml"
    path.write_text(f"""[engine]
job = "lightning-bench"
index = "file://{work}/index"

[[tiers]]
name = "host"
kind = "memory"
path = "{shm}/host"
capacity = {capacity}
keep_last = 2

[[tiers]]
name = "disk"
kind = "local"
path = "{work}/disk"
""")
    return path


def fit_once(kind: str, params_mib: int, epochs: int, steps: int, base: Path, shm_base: Path) -> dict[str, Any]:
    """One fit; `kind`: tiered, tiered+reserve, torch (TorchCheckpointIO), torch-async (AsyncCheckpointIO)."""
    import lightning as L
    from lightning.pytorch.callbacks import ModelCheckpoint
    from lightning.pytorch.plugins.io import AsyncCheckpointIO, TorchCheckpointIO

    from ..integrations.lightning import ReserveStaging, TieredCheckpointIO

    width = 1024
    layers = max(1, params_mib * 2**20 // (4 * width * (width + 1)))
    work, shm = Path(tempfile.mkdtemp(dir=base)), Path(tempfile.mkdtemp(dir=shm_base))
    try:
        torch.manual_seed(0)
        module = _module(width, layers)
        state_bytes = 2 * sum(p.numel() * p.element_size() for p in module.parameters())
        io: Any
        if kind.startswith("tiered"):
            io = TieredCheckpointIO(_config(work, shm, 6 * state_bytes + (64 << 20)))
        elif kind == "torch":
            io = TorchCheckpointIO()
        else:
            io = AsyncCheckpointIO(TorchCheckpointIO())
        blocked: list[float] = []
        save = io.save_checkpoint

        def timed(*args: Any, **kwargs: Any) -> None:
            started = time.perf_counter()
            save(*args, **kwargs)
            blocked.append(time.perf_counter() - started)

        io.save_checkpoint = timed
        callbacks: list[Any] = [ModelCheckpoint(dirpath=work / "ckpt", monitor="score", mode="min", save_top_k=-1,
                                                save_last=True)]
        if kind == "tiered+reserve":
            callbacks.append(ReserveStaging())
        data = torch.utils.data.TensorDataset(torch.randn(2 * steps, width))
        trainer = L.Trainer(max_epochs=epochs, accelerator="cpu", devices=1, plugins=[io], callbacks=callbacks,
                            logger=False, enable_progress_bar=False, enable_model_summary=False,
                            limit_val_batches=1)
        started = time.perf_counter()
        trainer.fit(module, torch.utils.data.DataLoader(data, batch_size=2),
                    torch.utils.data.DataLoader(data, batch_size=2))
        return {"kind": kind, "state_bytes": state_bytes, "blocked": blocked, "fit_seconds": time.perf_counter() - started}
    finally:
        shutil.rmtree(work, ignore_errors=True)
        shutil.rmtree(shm, ignore_errors=True)


def report(runs: list[dict[str, Any]]) -> str:
    kinds = list(dict.fromkeys(r["kind"] for r in runs))
    size = runs[0]["state_bytes"] / 2**20
    lines = [f"Lightning, a state of {size:.0f} MiB, ModelCheckpoint(save_top_k=-1, save_last=True), "
             f"{len(runs[0]['blocked'])} saves per fit", "",
             "| checkpoint_io | run | saves 1, 2 (s) | median (s) | all saves (s) | fit (s) |",
             "|---|---:|---:|---:|---:|---:|"]
    for i, r in enumerate(runs):
        b = r["blocked"]
        lines.append(f"| {r['kind']} | {i // len(kinds) + 1} | {b[0]:.3f}, {b[1]:.3f} | {statistics.median(b):.3f} | "
                     f"{sum(b):.2f} | {r['fit_seconds']:.1f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tiered_ckpt.bench.lightning_saves", description=__doc__.split("\n\n")[0])
    p.add_argument("--params-mib", type=int, default=128)
    p.add_argument("--epochs", type=int, default=8)
    p.add_argument("--steps", type=int, default=16, help="training steps an epoch")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--kinds", default="tiered,tiered+reserve,torch,torch-async",
                   help="which to run, comma-separated, in this order each repeat")
    p.add_argument("--dir", default=tempfile.gettempdir(), help="where the disk tier and torch.save write")
    p.add_argument("--shm", default="/dev/shm")
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    runs = [fit_once(kind, args.params_mib, args.epochs, args.steps, Path(args.dir), Path(args.shm))
            for _ in range(args.repeats) for kind in args.kinds.split(",")]
    print(json.dumps(runs) if args.json else report(runs))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
