"""What checkpointing takes from the training loop: the same small GPT trained for the same steps with no
checkpoint, with tiered_ckpt saving lazily every few steps (memory + disk tiers), and with DCP saving
synchronously, interleaved A B C A B C, in one process; the slowdown of each against no checkpoint."""
from __future__ import annotations

import shutil
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

import torch
import torch.nn.functional as F

from ..config import parse_config
from ..sync import Checkpointer


class _Block(torch.nn.Module):
    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.ln1, self.ln2 = torch.nn.LayerNorm(dim), torch.nn.LayerNorm(dim)
        self.attn = torch.nn.MultiheadAttention(dim, heads, batch_first=True)
        self.mlp = torch.nn.Sequential(torch.nn.Linear(dim, 4 * dim), torch.nn.GELU(), torch.nn.Linear(4 * dim, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.ln1(x)
        mask = torch.triu(torch.ones(x.shape[1], x.shape[1], dtype=torch.bool), 1)
        x = x + self.attn(h, h, h, attn_mask=mask, need_weights=False)[0]
        return x + self.mlp(self.ln2(x))


def gpt(vocab: int = 256, ctx: int = 64, dim: int = 208, layers: int = 4, heads: int = 4) -> torch.nn.Module:
    """A GPT-2-shaped model of about 2.2M parameters (the README's example is of this kind)."""
    model = torch.nn.Sequential(torch.nn.Embedding(vocab, dim), *[_Block(dim, heads) for _ in range(layers)],
                                torch.nn.LayerNorm(dim), torch.nn.Linear(dim, vocab))
    return model


def _train(steps: int, every: int, save: Callable[[int, dict[str, Any]], Any] | None) -> float:
    """Seconds for `steps` training steps, saving every `every` steps through `save` (None: never)."""
    torch.manual_seed(0)
    model = gpt()
    optim = torch.optim.AdamW(model.parameters(), lr=1e-3)
    state = {"model": model, "optim": optim}
    g = torch.Generator().manual_seed(0)
    pending = None
    start = time.perf_counter()
    for step in range(1, steps + 1):
        x = torch.randint(0, 256, (16, 65), generator=g)
        loss = F.cross_entropy(model(x[:, :-1]).reshape(-1, 256), x[:, 1:].reshape(-1))
        loss.backward()
        if pending is not None and hasattr(pending, "staged"):
            pending.staged()  # the lazy copy is done before the weights change
        pending = None
        optim.step()
        optim.zero_grad(set_to_none=True)
        if save is not None and step % every == 0:
            pending = save(step, state)
    seconds = time.perf_counter() - start
    return seconds


def measure(steps: int = 60, every: int = 3, repeats: int = 3, base: Path | None = None, shm: str = "/dev/shm",
            dcp: bool = True) -> dict[str, Any]:
    work = Path(tempfile.mkdtemp(prefix="loop-", dir=base))
    shm_dir = Path(tempfile.mkdtemp(prefix="tiered_ckpt-loop-", dir=shm))
    nbytes = sum(p.numel() * p.element_size() for p in gpt().parameters()) * 3  # weights and two AdamW moments
    config = parse_config({"engine": {"job": "loop", "index": f"file://{work}/index"},
                           "tiers": [{"name": "host", "kind": "memory", "path": str(shm_dir), "keep_last": 2},
                                     {"name": "disk", "kind": "local", "path": str(work / "disk"), "keep_last": 2}]})
    times: dict[str, list[float]] = {"none": [], "tiered_ckpt": [], "dcp": []}
    try:
        _train(5, every, None)  # warm up the allocator and the kernels
        for r in range(repeats):
            times["none"].append(_train(steps, every, None))
            with Checkpointer(config.replace_engine(job=f"loop{r}")) as ckpt:
                times["tiered_ckpt"].append(_train(steps, every, lambda s, st: ckpt.save(s, st, lazy=True)))
            if dcp:
                import torch.distributed.checkpoint as dcp_

                def dcp_save(step: int, state: dict[str, Any], r: int = r) -> None:
                    dcp_.save({"model": state["model"].state_dict(), "optim": state["optim"].state_dict()},
                              checkpoint_id=str(work / f"dcp{r}-{step}"), no_dist=True)

                times["dcp"].append(_train(steps, every, dcp_save))
    finally:
        shutil.rmtree(work, ignore_errors=True)
        shutil.rmtree(shm_dir, ignore_errors=True)
    none = statistics.median(times["none"])
    return {"steps": steps, "every": every, "state_bytes": nbytes, "seconds": {k: statistics.median(v) for k, v in
                                                                                 times.items() if v},
            "slowdown": {k: statistics.median(v) / none - 1 for k, v in times.items() if v and k != "none"},
            "runs": times}


def report(r: dict[str, Any]) -> str:
    lines = [f"training loop: {r['steps']} steps of a ~2.2M-parameter GPT (a {r['state_bytes'] / 2**20:.0f} MiB "
             f"state with AdamW), a save every {r['every']} steps; medians of interleaved runs", "",
             "| run | seconds | slowdown |", "|---|---:|---:|", f"| no checkpoint | {r['seconds']['none']:.2f} | |"]
    for name, label in (("tiered_ckpt", "tiered_ckpt, lazy saves (memory + disk)"), ("dcp", "DCP save, synchronous")):
        if name in r["slowdown"]:
            lines.append(f"| {label} | {r['seconds'][name]:.2f} | {100 * r['slowdown'][name]:.1f}% |")
    return "\n".join(lines)


if __name__ == "__main__":
    import warnings
    warnings.filterwarnings("ignore")
    print(report(measure()))
