from __future__ import annotations

from pathlib import Path
from typing import Any

from tiered_ckpt.config import Config
from tiered_ckpt.testing.configs import stack


def config(root: str, *, shared_memory_tier: bool = True, disk: str = "local", **engine: Any) -> Config:
    """Tiers for multi-rank tests: a memory tier and a disk tier (of kind `disk`: "faulty" to inject faults)
    under `root` (shared by all ranks, as a node's /dev/shm and a shared file system would be), and the file
    index."""
    # keep_last: the memory tier is the staging buffer
    host = {"kind": "memory", "path": str(Path(root) / "shm"), "capacity": "1GiB", "keep_last": 8}
    return stack(root, *([host] if shared_memory_tier else []), disk, job="dist", **engine)
