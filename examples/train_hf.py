"""A tiny GPT-2 trained with the Hugging Face Trainer, checkpointed through tiered_ckpt; run it again to resume.

    python examples/train_hf.py --steps 60 --output-dir runs/hf     # trains, saves every --save-steps
    python examples/train_hf.py --steps 90 --output-dir runs/hf     # resumes from the newest complete checkpoint
    torchrun --nproc-per-node 2 examples/train_hf.py --steps 60 --output-dir runs/hf-ddp   # DDP (CPU, gloo)

No downloads: the model is built from a small GPT2Config (dropout on) and the data is a synthetic stream
generated from a seed. Everything a run keeps is keyed by --output-dir (`run_config`): the index and the
disk tier under DIR/tiered_ckpt, the memory tier in <shm-root>/tiered_ckpt-hf-<hash of DIR>, the job
hf-<hash of DIR>; two runs with different DIRs never see each other's checkpoints. The run ends with
`trainer.save_model(DIR/final)`, a folder `from_pretrained` reads.

Exact resume (docs/state.md): the order of the data comes from generators of its own (the sampler's,
seeded by `data_seed` + epoch), the position is the TrainerState's global step (saved, and checked on
resume), and each rank's RNG states (dropout) are saved with `tc.PerRank`. A run killed at any moment and
run again ends with the same DIR/final weights, bit for bit, as a run never interrupted
(tests/e2e/test_hf_example.py).
"""
from __future__ import annotations

import argparse
import os
import sys

import torch
from transformers import GPT2Config, GPT2LMHeadModel, TrainerCallback, TrainingArguments, set_seed

from tiered_ckpt.integrations.hf import TieredTrainer, run_config

VOCAB, CONTEXT = 128, 32


def synthetic_data(seed: int, size: int) -> list[dict[str, torch.Tensor]]:
    """Noisy repeating patterns: learnable, and a pure function of the seed."""
    g = torch.Generator().manual_seed(seed)
    period = torch.randint(2, 9, (size, 1), generator=g)
    base = torch.randint(0, VOCAB, (size, 8), generator=g)
    seq = torch.gather(base, 1, torch.arange(CONTEXT).unsqueeze(0) % period)
    noise = torch.rand(seq.shape, generator=g) < 0.05
    seq = torch.where(noise, torch.randint(0, VOCAB, seq.shape, generator=g), seq)
    return [{"input_ids": s, "labels": s} for s in seq]


class Progress(TrainerCallback):
    """Lines a reader (or a test that kills the run at chosen moments) can follow; rank 0 only."""

    def on_step_end(self, args, state, control, **kwargs):
        if state.is_world_process_zero:
            print(f"step {state.global_step}", flush=True)

    def on_log(self, args, state, control, logs=None, **kwargs):
        if state.is_world_process_zero and logs and "loss" in logs:
            print(f"step {state.global_step} loss {float(logs['loss']):.4f}", flush=True)

    def on_save(self, args, state, control, **kwargs):
        if state.is_world_process_zero:  # staged; the tiers are being written in the background
            print(f"saving step {state.global_step}", flush=True)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--output-dir", required=True)
    p.add_argument("--save-steps", type=int, default=5)
    p.add_argument("--save-total-limit", type=int, default=3, help="caps keep_last on every tier")
    p.add_argument("--batch-size", type=int, default=4, help="per device")
    p.add_argument("--samples", type=int, default=96, help="size of the synthetic data set (an epoch)")
    p.add_argument("--shm-root", default="/dev/shm", help="where the memory tier's folder goes")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    torch.set_num_threads(1)  # bit-for-bit reproducible CPU math

    output_dir = os.path.abspath(args.output_dir)
    training = TrainingArguments(
        output_dir=output_dir, max_steps=args.steps, per_device_train_batch_size=args.batch_size,
        save_strategy="steps", save_steps=args.save_steps, save_total_limit=args.save_total_limit,
        logging_steps=10, learning_rate=1e-3, warmup_steps=5, lr_scheduler_type="linear",
        seed=args.seed, data_seed=args.seed, use_cpu=True, dataloader_num_workers=0,
        report_to=[], disable_tqdm=True)
    set_seed(args.seed)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=VOCAB, n_positions=CONTEXT, n_embd=32, n_layer=2, n_head=2,
                                       bos_token_id=0, eos_token_id=0))  # dropout 0.1: the RNG matters
    trainer = TieredTrainer(model=model, args=training, train_dataset=synthetic_data(args.seed, args.samples),
                            callbacks=[Progress()], tiers=run_config(output_dir, shm_root=args.shm_root))

    resume = trainer.last_checkpoint()  # every rank asks: every rank takes part in the load
    if trainer.is_world_process_zero():
        print(f"resuming from step {resume}" if resume is not None else "starting fresh", flush=True)
    trainer.train(resume_from_checkpoint=resume is not None)  # the newest complete checkpoint
    trainer.save_model(os.path.join(output_dir, "final"))
    if trainer.is_world_process_zero():
        print(f"done: step {trainer.state.global_step}, model in {os.path.join(output_dir, 'final')}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
