"""Helper process for test_save_policy: a training loop with a tc.Checkpointer and `save_on_sigterm = true` that
asks `should_save(step)` at every step and prints `step N` before it asks (and `returned N` should a save
return), until the test sends it SIGTERM. `own-handler`: the program installs a SIGTERM handler of its own
first (exit status 3), which must get the signal once the last save is done."""
import signal
import sys

import torch

import tiered_ckpt as tc

config, mode = sys.argv[1], sys.argv[2]
if mode == "own-handler":
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(3))
state = {"w": torch.zeros(100_000), "progress": {"step": 0}}
with tc.Checkpointer.from_toml(config) as ckpt:
    for step in range(1, 1_000_000):
        state["w"] += 1.0  # the training step
        state["progress"]["step"] = step
        print(f"step {step}", flush=True)
        if ckpt.should_save(step):
            ckpt.save(step, state)
            print(f"returned {step}", flush=True)
print("the loop ended without a signal", flush=True)
