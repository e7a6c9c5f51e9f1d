from __future__ import annotations

from pathlib import Path
from typing import Any

from tiered_ckpt.config import Config, parse_config


def config(root: str, *, shared_memory_tier: bool = True, **engine: Any) -> Config:
    """Tiers for multi-rank tests: a memory tier and a disk tier under `root` (shared by all ranks, as a
    node's /dev/shm and a shared file system would be), and the file index."""
    root_path = Path(root)
    tiers = [{"name": "disk", "kind": "local", "path": str(root_path / "disk")}]
    if shared_memory_tier:
        tiers.insert(0, {"name": "host", "kind": "memory", "path": str(root_path / "shm"), "capacity": "1GiB",
                         "keep_last": 8})  # keep_last: the memory tier is the staging buffer
    return parse_config({"engine": {"job": "dist", "index": f"file://{root_path}/index", "part_size": "64KiB",
                                    **engine}, "tiers": tiers})
