"""Adapters for training frameworks. Each lives in its own module and imports its framework only there:
`tiered_ckpt.integrations.lightning` (needs `pip install "tiered_ckpt[lightning]"`), `tiered_ckpt.integrations.hf`,
the Hugging Face Trainer (needs `pip install "tiered_ckpt[hf]"`), and `tiered_ckpt.integrations.torchtitan`,
torchtitan 0.3's checkpoint manager on `tiered_ckpt.dcp` (needs torchtitan; docs/integrations.md)."""
