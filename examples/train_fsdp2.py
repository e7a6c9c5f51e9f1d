"""The GPT of train_gpt.py sharded with FSDP2 (`fully_shard`, CPU/gloo), checkpointed through `tc.TrainState`;
resume at another world size.

    torchrun --nproc-per-node 2 examples/train_fsdp2.py --steps 200 --save-every 20
    torchrun --nproc-per-node 3 examples/train_fsdp2.py --steps 300 --save-every 20   # resumes, resharded

Each rank holds a shard of every parameter and of AdamW's state (DTensors). `tc.TrainState(model, optim)` saves
them through torch's get_state_dict/set_state_dict: each rank writes its own shards, and a load at another world
size reads, for each rank, the byte ranges of its new shards. The data of step s is a global batch of 12
sequences, a pure function of s, split evenly over the ranks (1, 2, 3, 4, 6 or 12 of them), so a resumed run
follows the uninterrupted one up to floating-point reduction order, which changes with the world size.

The printed lines, Ctrl-C and a finished run behave as in train_gpt_ddp.py: rank 0 reports each save and each
tier's commit, Ctrl-C stops every rank after the same step and names the newest complete checkpoint.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

import tiered_ckpt as tc

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from train_gpt import GPT, SaveReport, batch, nothing_left  # noqa: E402
from train_gpt_ddp import GLOBAL_BATCH, StopOnCtrlC, finish, mean_loss_and_stop  # noqa: E402


def sharded_gpt(world: int, tiny: bool) -> GPT:
    """Each block is its own FSDP unit (gathered for its forward, freed after); the root holds the rest,
    the embedding and the output layer tied to it among them."""
    dim, layers, heads = (32, 1, 2) if tiny else (256, 4, 4)
    model = GPT(256, 64, dim, layers, heads)
    mesh = init_device_mesh("cpu", (world,))
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    return fully_shard(model, mesh=mesh)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default="tiers/local.toml")
    p.add_argument("--job", default="gpt-fsdp2")
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--save-every", type=int, default=20)
    p.add_argument("--tiny", action="store_true", help="a very small model (tests)")
    p.add_argument("--losses", help="rank 0 appends {step, loss, world} JSON lines here")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    if GLOBAL_BATCH % world:
        raise SystemExit(f"world size {world} must divide the global batch of {GLOBAL_BATCH}")
    torch.manual_seed(args.seed)  # the same initial weights on every rank, before sharding
    model = sharded_gpt(world, args.tiny)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)
    progress = {"step": 0}  # the data position
    state = {"train": tc.TrainState(model, optim), "progress": progress}
    per_rank, vocab, ctx = GLOBAL_BATCH // world, 256, 64
    report = SaveReport(enabled=rank == 0)

    with tc.Checkpointer.from_toml(args.config, job=args.job, role="writer") as ckpt:
        try:
            info = ckpt.load(state)  # every rank; each reads the parts of the saved shards its own shards need
            report.say(f"resumed from step {info.step} at world size {world} (tier {info.tier})")
        except tc.IncompleteCheckpoint as e:  # tc.FreshStart too: every checkpoint lost, and on_lost = "fresh"
            report.say(f"starting fresh at world size {world}" + (f" ({e})" if isinstance(e, tc.FreshStart) else ""))
        if progress["step"] >= args.steps:  # every rank loaded the same step: the loop below is empty on all
            report.say(nothing_left(progress["step"], args.steps))
        losses = open(args.losses, "a") if args.losses and rank == 0 else None
        pending: tc.SyncSaveHandle | None = None
        stop, stopping = StopOnCtrlC(), False
        step = progress["step"]  # the last step trained (none yet in this run: the one loaded)
        for step in range(progress["step"] + 1, args.steps + 1):
            x, y = batch(args.seed, step, GLOBAL_BATCH, ctx, vocab)
            x, y = x[rank * per_rank : (rank + 1) * per_rank], y[rank * per_rank : (rank + 1) * per_rank]
            loss = F.cross_entropy(model(x).reshape(-1, vocab), y.reshape(-1))
            loss.backward()
            if pending is not None:
                report.staged(pending)  # the lazy copy of the shards must finish before optim.step() changes them
                pending = None
            optim.step()
            optim.zero_grad(set_to_none=True)
            mean_loss, stopping = mean_loss_and_stop(loss, stop, world)
            if losses:
                losses.write(json.dumps({"step": step, "loss": mean_loss.item(), "world": world}) + "\n")
                losses.flush()
            if step % args.save_every == 0:
                progress["step"] = step
                pending = report.save(ckpt, step, state)  # every rank: its shards, plan gathered once
            if step % 10 == 0 or step == args.steps:
                report.say(f"step {step:5d}  loss {mean_loss.item():.4f}")
            if stopping:
                break
        finish(ckpt, report, pending, step, stopping)
    dist.destroy_process_group()
    return 130 if stopping else 0  # 130: as a shell reports an interrupt


if __name__ == "__main__":
    sys.exit(main())
