"""The GPT of train_gpt.py under DDP (CPU, gloo), checkpointed with tiered_ckpt; resume at any world size.

    torchrun --nproc-per-node 2 examples/train_gpt_ddp.py --steps 200 --save-every 20
    torchrun --nproc-per-node 3 examples/train_gpt_ddp.py --steps 300 --save-every 20   # resumes, resharded

Each step uses one global batch of 12 sequences (a pure function of the step, from a generator of its own),
split evenly over the ranks, so 1, 2, 3, 4, 6 or 12 ranks compute the same gradients up to floating-point
reduction order. The replicated DDP state is written once across the ranks (load-balanced), and on resume each
part is read once and broadcast to the ranks that need it.

Exact resume (docs/state.md): own generator, saved position (the step), and each rank's global RNG state saved
with `tc.PerRank`. A rank's RNG state exists only for ranks that existed at save time, so it is restored when
the world size is the same and left as seeded otherwise. (The model has no dropout here, so that the losses
agree across world sizes; with dropout, the same code resumes bit for bit at the same world size.) Bit for bit
needs DDP's gradient buckets to stay as first built, hence `find_unused_parameters=True` below: by default DDP
rebuilds them after each process's first step, and a resumed run then differs from an uninterrupted one in
the last bits from its first step on.

Rank 0 prints the lines of train_gpt.py: one per save, one per tier that commits it. Ctrl-C stops every rank
after the same step (StopOnCtrlC), the saves in flight finish, and rank 0 names the newest complete checkpoint;
torchrun then reports the signal with a traceback of its own (the launcher's; no worker raises). A run whose
last step is saved has nothing left to train.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel

import tiered_ckpt as tc

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from train_gpt import GPT, SaveReport, batch, nothing_left, stopped_message  # noqa: E402

GLOBAL_BATCH = 12


class StopOnCtrlC:
    """Ctrl-C under torchrun: SIGINT only raises a flag, and the ranks agree on it in each step's all_reduce, so
    all stop after the same step. A KeyboardInterrupt would strike each rank at a different point and leave the
    others blocked in a collective; and a worker may get the signal twice (the terminal's, and torchrun's)."""

    def __init__(self) -> None:
        self.requested = False
        signal.signal(signal.SIGINT, self._request)

    def _request(self, signum: int, frame: object) -> None:
        self.requested = True

    def flag(self) -> torch.Tensor:
        return torch.tensor(1.0 if self.requested else 0.0)


def mean_loss_and_stop(loss: torch.Tensor, stop: StopOnCtrlC, world: int) -> tuple[torch.Tensor, bool]:
    """One all_reduce: the loss averaged over the ranks, and whether any rank was asked to stop."""
    both = torch.stack([loss.detach(), stop.flag()])
    dist.all_reduce(both)
    return both[0] / world, bool(both[1] > 0)


def finish(ckpt: tc.Checkpointer, report: SaveReport, pending: tc.SyncSaveHandle | None, step: int,
           stopping: bool) -> None:
    """The end of a run, on every rank: the last lazy copy done, the saves in flight done on every tier, and
    after Ctrl-C, the step a rerun resumes from."""
    if pending is not None:
        report.staged(pending)
    if stopping:
        report.say(f"Ctrl-C: every rank stopped after step {step}; waiting for the saves in flight")
    ckpt.wait_all()
    report.flush()
    if stopping:
        report.say(stopped_message(ckpt, step))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default="tiers/local.toml")
    p.add_argument("--job", default="gpt-ddp")
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--save-every", type=int, default=20)
    p.add_argument("--stop-after", type=int, default=None, help="simulate a crash: every rank exits after this step")
    p.add_argument("--tiny", action="store_true")
    p.add_argument("--losses", help="rank 0 appends {step, loss, world} JSON lines here")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    if GLOBAL_BATCH % world:
        raise SystemExit(f"world size {world} must divide the global batch of {GLOBAL_BATCH}")
    vocab, ctx = 256, 64
    dim, layers, heads = (32, 1, 2) if args.tiny else (256, 4, 4)
    torch.manual_seed(args.seed)
    # find_unused_parameters=True: DDP then keeps its gradient buckets as built. Without it, DDP rebuilds them
    # after the first step of every process, so a resumed run reduces its first steps in other buckets than the
    # uninterrupted run did and the two differ in the last bits from the first step after the resume.
    model = DistributedDataParallel(GPT(vocab, ctx, dim, layers, heads), find_unused_parameters=True)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)
    progress = {"step": 0, "world": world}  # the data position, and the world size that saved it
    state = {"train": tc.TrainState(model, optim), "progress": progress, "rng": tc.PerRank(torch.get_rng_state())}
    per_rank = GLOBAL_BATCH // world
    report = SaveReport(enabled=rank == 0)

    with tc.Checkpointer.from_toml(args.config, job=args.job, role="writer") as ckpt:
        try:
            info = ckpt.load({"train": state["train"], "progress": progress})
            if progress.get("world") == world:  # each rank's own RNG state, saved by the rank of the same number
                ckpt.load({"rng": state["rng"]}, step=info.step)
                torch.set_rng_state(state["rng"].value)
            elif rank == 0:
                print(f"saved at world size {progress.get('world')}: the ranks' RNG states stay as seeded", flush=True)
            progress["world"] = world
            if rank == 0:
                print(f"resumed from step {info.step} at world size {world} (tier {info.tier})", flush=True)
        except tc.IncompleteCheckpoint as e:  # tc.FreshStart too: every checkpoint lost, and on_lost = "fresh"
            if rank == 0:
                print(f"starting fresh at world size {world}" + (f" ({e})" if isinstance(e, tc.FreshStart) else ""),
                      flush=True)
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
                report.staged(pending)
                pending = None
            optim.step()
            optim.zero_grad(set_to_none=True)
            mean_loss, stopping = mean_loss_and_stop(loss, stop, world)
            if losses:
                losses.write(json.dumps({"step": step, "loss": mean_loss.item(), "world": world}) + "\n")
                losses.flush()
            if step % args.save_every == 0:
                progress["step"], state["rng"] = step, tc.PerRank(torch.get_rng_state())
                pending = report.save(ckpt, step, state)
            if step % 10 == 0 or step == args.steps:
                report.say(f"step {step:5d}  loss {mean_loss.item():.4f}")
            if args.stop_after == step:
                if rank == 0:
                    print(f"simulated crash after step {step}", flush=True)
                os._exit(1)
            if stopping:
                break
        finish(ckpt, report, pending, step, stopping)
    dist.destroy_process_group()
    return 130 if stopping else 0  # 130: as a shell reports an interrupt


if __name__ == "__main__":
    sys.exit(main())
