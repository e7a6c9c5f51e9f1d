"""Train a small GPT on CPU, checkpointing asynchronously with tiered_ckpt; run it again to resume.

    python examples/train_gpt.py --steps 200 --save-every 20     # trains, saves every 20 steps
    python examples/train_gpt.py --steps 300 --save-every 20     # resumes from the newest checkpoint

It prints a line per save (how long the training loop paused for it) and a line per tier that commits it (ms
from save() until it was durable there, reported by `handle.on_tier_done` without blocking the loop). Ctrl-C
stops it cleanly: the saves in flight finish, and it names the newest complete checkpoint, which the next run
resumes from; a run that finds its last step already saved says there is nothing left to train.

Saves are lazy (DataStates-style): `save(step, lazy=True)` returns at once, the copy to host memory
overlaps the next forward/backward, and `handle.staged()` is awaited just before optimizer.step()
mutates the weights.

A resumed run reproduces the uninterrupted run's losses exactly (docs/state.md, *Resume that is exact*): the
data of step s comes from a generator of its own seeded by (seed, s), never from the global RNG; the position
(the step) is saved; and the global RNG, which the dropout draws from, is saved with `tc.PerRank` and restored.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import threading
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

import tiered_ckpt as tc


class Block(nn.Module):
    def __init__(self, dim: int, heads: int, dropout: float = 0.0):
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.qkv, self.proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))
        self.drop = nn.Dropout(dropout) if dropout else nn.Identity()  # draws from the global RNG

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, d)
        x = x + self.drop(self.proj(y))
        return x + self.drop(self.mlp(self.ln2(x)))


class GPT(nn.Module):
    def __init__(self, vocab: int, ctx: int, dim: int, layers: int, heads: int, dropout: float = 0.0):
        super().__init__()
        self.tok, self.pos = nn.Embedding(vocab, dim), nn.Embedding(ctx, dim)
        self.blocks = nn.Sequential(*(Block(dim, heads, dropout) for _ in range(layers)))
        self.ln = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)
        self.head.weight = self.tok.weight  # tied embeddings
        nn.init.normal_(self.tok.weight, std=0.02)
        nn.init.normal_(self.pos.weight, std=0.02)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1]))
        return self.head(self.ln(self.blocks(x)))


def batch(seed: int, step: int, size: int, ctx: int, vocab: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A learnable synthetic stream (noisy repeating patterns), a pure function of (seed, step)."""
    g = torch.Generator().manual_seed(seed * 1_000_003 + step)
    period = torch.randint(2, 9, (size, 1), generator=g)
    base = torch.randint(0, vocab, (size, 8), generator=g)
    pos = torch.arange(ctx + 1).unsqueeze(0) % period
    seq = torch.gather(base, 1, pos)
    noise = torch.rand(seq.shape, generator=g) < 0.05
    seq = torch.where(noise, torch.randint(0, vocab, seq.shape, generator=g), seq)
    return seq[:, :-1], seq[:, 1:]


class SaveReport:
    """One line per save and one per tier that commits it. The save line is printed once `staged()` has returned
    (only then is the loop's pause known), the commit lines from the Checkpointer's thread (`on_tier_done`): a
    save's commit lines wait for its save line, and a lock keeps the two threads from cutting each other's lines."""

    def __init__(self, enabled: bool = True):
        self.enabled = enabled  # multi-rank: rank 0 reports, the others stay quiet
        self._lock = threading.Lock()
        self._held: dict[int, list[str]] = {}  # step → its commit lines, until its save line is out
        self._save_s = 0.0  # how long the pending save's save() call took

    def save(self, ckpt: tc.Checkpointer, step: int, state: dict) -> tc.SyncSaveHandle:
        """ckpt.save(step, state, lazy=True), timed and watched: it returns before the copy."""
        t = time.perf_counter()
        handle = ckpt.save(step, state, lazy=True)
        self._save_s = time.perf_counter() - t
        self._watch(handle)
        return handle

    def staged(self, handle: tc.SyncSaveHandle) -> None:
        """handle.staged() (the lazy copy done), then the save line with the loop's whole pause."""
        t = time.perf_counter()
        handle.staged()
        self._saved(handle.step, self._save_s + time.perf_counter() - t)

    def say(self, line: str) -> None:
        if self.enabled:
            with self._lock:
                print(line, flush=True)

    def _watch(self, handle: tc.SyncSaveHandle) -> None:
        if self.enabled:
            with self._lock:
                self._held[handle.step] = []
            handle.on_tier_done(self._tier_done)

    def _saved(self, step: int, paused_s: float) -> None:
        if self.enabled:
            with self._lock:
                print(f"save   step {step:5d}  training paused {paused_s * 1e3:.1f} ms (save() + staged())", flush=True)
                for line in self._held.pop(step, []):
                    print(line, flush=True)

    def flush(self) -> None:
        """Print the commit lines of saves whose save line never came (a stop before their staged())."""
        with self._lock:
            for step in sorted(self._held):
                for line in self._held[step]:
                    print(line, flush=True)
            self._held.clear()

    def _tier_done(self, done: tc.TierDone) -> None:
        if done.committed:
            line = f"commit step {done.step:5d}  on {done.tier}: {(done.seconds or 0) * 1e3:.1f} ms after save()"
        elif done.superseded_by is not None:
            line = f"skip   step {done.step:5d}  on {done.tier}: step {done.superseded_by} took its turn"
        else:
            line = f"FAILED step {done.step:5d}  on {done.tier}: {done.error!r}"
        with self._lock:
            held = self._held.get(done.step)
            if held is not None:
                held.append(line)
            else:
                print(line, flush=True)


def newest_complete(ckpt: tc.Checkpointer) -> int | None:
    return max((c.step for c in ckpt.list() if c.is_complete), default=None)


def stopped_message(ckpt: tc.Checkpointer, trained: int) -> str:
    """After Ctrl-C, once the saves in flight are done: what the next run will resume from."""
    newest = newest_complete(ckpt)
    if newest is None:
        return f"stopped after step {trained}: no checkpoint is complete yet, so a rerun starts fresh"
    return f"stopped after step {trained}: the newest complete checkpoint is step {newest}; run again to resume"


def nothing_left(step: int, steps: int) -> str:
    return f"nothing left to train: step {step} is saved and --steps is {steps} (raise --steps to train on)"


def main(argv: list[str] | None = None) -> int:
    """Ctrl-C anywhere ends without a traceback (exit status 130, as a shell reports an interrupt); so does an
    error of the library (one line naming it, status 1)."""
    try:
        return train(argv)
    except KeyboardInterrupt:  # before training started, or a second Ctrl-C while saves were finishing
        print("\ninterrupted: the next run resumes from the newest complete checkpoint", flush=True)
        return 130
    except tc.TieredCkptError as e:  # e.g. another trainer of this job runs (WriterConflict, at open): one line
        print(f"train_gpt.py: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
        return 1


def train(argv: list[str] | None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default="tiers/local.toml")
    p.add_argument("--job", default="gpt")
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--save-every", type=int, default=20)
    p.add_argument("--stop-after", type=int, default=None, help="simulate a crash: exit hard after this step")
    p.add_argument("--tiny", action="store_true", help="a very small model (tests)")
    p.add_argument("--losses", help="append {step, loss} JSON lines here")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    torch.set_num_threads(1)  # bit-for-bit reproducible CPU math
    vocab, ctx, bsz = 256, 64, 16
    dim, layers, heads = (32, 1, 2) if args.tiny else (256, 4, 4)
    torch.manual_seed(args.seed)
    model = GPT(vocab, ctx, dim, layers, heads, dropout=0.1)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)
    train = {"step": 0}  # the data position: step s trains on batch(seed, s)
    state = {"model": model, "optim": optim, "train": train, "rng": tc.PerRank(torch.get_rng_state())}
    nparams = sum(p.numel() for p in model.parameters())
    report = SaveReport()

    with tc.Checkpointer.from_toml(args.config, job=args.job, role="writer") as ckpt:
        try:
            info = ckpt.load(state)
            torch.set_rng_state(state["rng"].value)  # the dropout masks go on as if never interrupted
            print(f"resumed from step {info.step} (tier {info.tier}, {info.seconds * 1e3:.1f} ms)", flush=True)
        except tc.IncompleteCheckpoint as e:  # tc.FreshStart too: every checkpoint lost, and on_lost = "fresh"
            print(f"starting fresh: {nparams / 1e6:.2f}M parameters" + (f" ({e})" if isinstance(e, tc.FreshStart)
                                                                         else ""), flush=True)
        if train["step"] >= args.steps:
            print(nothing_left(train["step"], args.steps), flush=True)
            return 0
        losses = open(args.losses, "a") if args.losses else None
        pending: tc.SyncSaveHandle | None = None
        trained = train["step"]
        try:
            for step in range(train["step"] + 1, args.steps + 1):
                t0 = time.perf_counter()
                x, y = batch(args.seed, step, bsz, ctx, vocab)
                loss = F.cross_entropy(model(x).reshape(-1, vocab), y.reshape(-1))
                loss.backward()
                if pending is not None:
                    report.staged(pending)  # the lazy copy must finish before the weights change
                    pending = None
                optim.step()
                optim.zero_grad(set_to_none=True)
                trained = step
                if losses:
                    losses.write(json.dumps({"step": step, "loss": loss.item()}) + "\n")
                    losses.flush()
                if step % args.save_every == 0:
                    train["step"], state["rng"] = step, tc.PerRank(torch.get_rng_state())
                    pending = report.save(ckpt, step, state)
                if step % 10 == 0 or step == args.steps:
                    ms = (time.perf_counter() - t0) * 1e3
                    report.say(f"step {step:5d}  loss {loss.item():.4f}  ppl {math.exp(loss.item()):8.2f}  "
                               f"{ms:6.1f} ms")
                if args.stop_after == step:
                    print(f"simulated crash after step {step}", flush=True)
                    sys.stdout.flush()
                    os._exit(1)
            if pending is not None:
                report.staged(pending)
        except KeyboardInterrupt:
            report.say(f"\nCtrl-C: stopping after step {trained}; waiting for the saves in flight")
            ckpt.wait_all()
            report.flush()
            report.say(stopped_message(ckpt, trained))
            return 130
        ckpt.wait_all()
    return 0


if __name__ == "__main__":
    sys.exit(main())
