"""The benchmark behind `tiered-ckpt bench`: tiered_ckpt and its baselines measured in one run."""
