"""Where checkpoints are and on which tiers they are complete."""
from __future__ import annotations

from ...config import REDIS_SCHEMES, index_path
from ...errors import ConfigError
from .base import (CheckpointStatus, CommitState, Index, listing_range, rank_metas, read_note, status_of, step_numbers,
                   write_note)


def open_index(url: str, *, timeout: float = 10.0) -> Index:
    """The index at `url`; `timeout`: how long one call to a Redis index may go unanswered ([engine] index_timeout).
    A file index is local files: its calls are not bounded."""
    if url.startswith("file://"):
        from .file import FileIndex

        return FileIndex(index_path(url))
    if url.startswith(REDIS_SCHEMES):
        from .redis import RedisIndex

        return RedisIndex(url, timeout=timeout)
    raise ConfigError(f"index {url.split('://')[0]}://…: expected file://PATH, redis://HOST:PORT/DB, "
                      f"redis+cluster://HOST:PORT[,HOST:PORT...] or redis+sentinel://HOST:PORT[,...]/MASTER/DB",
                      key="engine.index")


__all__ = ["CheckpointStatus", "CommitState", "Index", "listing_range", "open_index", "rank_metas", "read_note",
           "status_of", "step_numbers", "write_note"]
