"""Where checkpoints are and on which tiers they are complete."""
from __future__ import annotations

from ..config import index_path
from ..errors import ConfigError
from .base import CheckpointStatus, Index


def open_index(url: str) -> Index:
    if url.startswith("file://"):
        from .file import FileIndex

        return FileIndex(index_path(url))
    if url.startswith(("redis://", "rediss://", "unix://")):
        from .redis import RedisIndex

        return RedisIndex(url)
    raise ConfigError(f"index {url!r}: expected file://PATH or redis://HOST:PORT/DB", key="engine.index")


__all__ = ["CheckpointStatus", "Index", "open_index"]
