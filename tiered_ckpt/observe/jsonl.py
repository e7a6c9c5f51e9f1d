"""`[engine] events_log`: every record appended to a file as one line of JSON, written by a thread of its own
(the event loop only queues the line), flushed per line, so a log shipper tailing the file sees each record
as it happens."""
from __future__ import annotations

import logging
import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import IO

from .events import Event, to_json

log = logging.getLogger(__name__)


def log_path(template: str, rank: int) -> Path:
    """The file for `rank`: `{rank}` in the configured path is replaced by it (several ranks, one pattern)."""
    return Path(template.replace("{rank}", str(rank)))


class JsonLinesFile:
    """A subscriber: `open()` it (in a thread: it creates missing folders), hand it records, `close()` it."""

    def __init__(self, path: str | os.PathLike[str]):
        self.path = Path(path)
        self._file: IO[str] | None = None
        self._writer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tiered_ckpt-events")  # keeps order
        self._failed = False

    def open(self) -> "JsonLinesFile":
        """Open for appending (blocking: call it in a thread); raises OSError when the file cannot be written."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file = open(self.path, "a", encoding="utf-8")
        return self

    def __call__(self, event: Event) -> None:
        if self._file is not None:
            try:
                self._writer.submit(self._write, to_json(event) + "\n")
            except RuntimeError:  # closed meanwhile: the engine is closing, the record has nowhere to go
                pass

    def _write(self, line: str) -> None:
        try:
            assert self._file is not None
            self._file.write(line)
            self._file.flush()
        except (OSError, ValueError) as e:
            if not self._failed:  # once: a full disk must not fill the log with the same warning
                self._failed = True
                log.warning("events_log %s: cannot write a record (%s); records are dropped until it can", self.path, e)
            return
        self._failed = False

    def close(self) -> None:
        """Write what is queued, then close (blocking: call it in a thread). A file that cannot take its last
        bytes (a full disk: close() flushes what a failed write left buffered) is logged, never raised: the
        records are lost either way, and the engine's close must go on to its other sinks."""
        self._writer.shutdown(wait=True)
        file, self._file = self._file, None
        if file is None:
            return
        try:
            file.close()  # closes the descriptor even when the flush before it fails
        except (OSError, ValueError) as e:
            log.warning("events_log %s: records lost at close, cannot write them (%s)", self.path, e)
