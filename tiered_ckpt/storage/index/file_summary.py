"""The file index's summary of settled checkpoints: a listing of ten thousand checkpoints reads two stats per
step instead of two listings and two records.

A checkpoint is *settled* when it is complete on every tier its record targets and its folder holds no `failed/`
or `skipped/` folder (file.py checks the folders): nothing but a change of the index's own records changes how
it is listed then, and each such change renames or removes a name in the step's folder (`begun` rewritten by
`unmark` or a new `begin`, `info`, a `failed/` or `skipped/` folder made) or in its `complete/` folder (a tier's
marker made or removed), which changes that folder's modification time; a step removed and made again is a new
folder (a new inode). So a
settled status is kept with both folders' (modification time, inode) and is good while both are the same, as git
trusts its index: only when it was read more than a tick of the file system's clock after the last change of
either folder (`racy_ns`), since a change within the same tick keeps the time.

The summary lives in memory (a writer lists its job at every first pass, open and gc) and in one file per job,
`<root>/<job>/status-summary`, sealed with a checksum and replaced atomically, so a fresh process (`tiered-ckpt
ls`) starts from it. The file is a cache: written where the process may write (never an error when it cannot),
read only when its seal checks out, and each entry still checked against the folders before use; a stale or lost
file costs a full read, never a wrong listing.
"""
from __future__ import annotations

import logging
import os
import threading
import uuid
from typing import Any

import msgpack

from ...checksum import seal, unseal
from ...errors import IntegrityError
from ...layout import parse_step_dir
from ..tiers.base import racy_ns
from .base import CheckpointStatus

log = logging.getLogger(__name__)

SUMMARY = "status-summary"  # <root>/<job>/status-summary
FORMAT = 1
LISTED_FROM = 256  # steps in a job folder from which a listing keeps a summary (below, reading them is cheap)
REWRITE_AFTER = 64  # fresh reads of settled steps in one listing before the file is written again
Stamp = tuple[int, int, int, int]  # the step folder's (mtime ns, inode) and its complete/ folder's (0, 0: none)


def stamp_of(step_folder: str) -> Stamp | None:
    """What says a settled status is unchanged: its step folder's and complete/ folder's (mtime, inode); None when
    the step folder is gone."""
    try:
        st = os.stat(step_folder)
    except (FileNotFoundError, NotADirectoryError):
        return None
    try:
        done = os.stat(step_folder + "/complete")
        return st.st_mtime_ns, st.st_ino, done.st_mtime_ns, done.st_ino
    except (FileNotFoundError, NotADirectoryError):
        return st.st_mtime_ns, st.st_ino, 0, 0


def trusted(stamp: Stamp, read_at_ns: int) -> bool:
    """Whether a status read at `read_at_ns` (taken before the stat) holds every change that keeps `stamp`."""
    newest = max(stamp[0], stamp[2])
    return read_at_ns - newest > racy_ns(newest)


def settled(status: CheckpointStatus) -> bool:
    """Complete on every tier it targets, nothing failed or skipped: no write but a record's changes it."""
    return set(status.tiers) <= status.complete and not status.failed and not status.skipped


class StatusSummary:
    """Per job: step folder name → (stamp, settled status), as read (`get`, `put`), kept in memory and in the
    job's summary file (`load`, `save`)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._jobs: dict[str, dict[str, tuple[Stamp, CheckpointStatus]]] = {}
        self._fresh: dict[str, int] = {}  # per job: settled statuses read fresh since the file was last written

    def entries(self, base: str) -> dict[str, tuple[Stamp, CheckpointStatus]]:
        """The job folder `base`'s entries: read from its file at the first look of this process."""
        with self._lock:
            found = self._jobs.get(base)
        if found is None:
            found = _read_file(base)
            with self._lock:
                found = self._jobs.setdefault(base, found)
        return found

    def put(self, base: str, name: str, stamp: Stamp, status: CheckpointStatus) -> None:
        with self._lock:
            self._jobs.setdefault(base, {})[name] = (stamp, status)
            self._fresh[base] = self._fresh.get(base, 0) + 1

    def drop(self, base: str, name: str) -> None:
        with self._lock:
            self._jobs.get(base, {}).pop(name, None)

    def save_if_stale(self, base: str, names: set[str]) -> None:
        """Write the job's summary file when enough statuses were read fresh since it was last written (entries of
        steps no longer listed are left out). Best effort: a reader that may not write there reads fresh again."""
        with self._lock:
            if self._fresh.get(base, 0) < REWRITE_AFTER:
                return
            self._fresh[base] = 0
            entries = {n: e for n, e in self._jobs.get(base, {}).items() if n in names}
            self._jobs[base] = entries
        try:
            _write_file(base, entries)
        except OSError as e:
            log.debug("index summary %s/%s not written: %s", base, SUMMARY, e)


def _pack(entries: dict[str, tuple[Stamp, CheckpointStatus]]) -> bytes:
    rows = {name: [list(stamp), list(s.tiers), sorted(s.complete), s.created, s.nbytes, s.metadata, s.folder]
            for name, (stamp, s) in entries.items()}
    return seal(msgpack.packb({"format": FORMAT, "steps": rows}))


def _write_file(base: str, entries: dict[str, tuple[Stamp, CheckpointStatus]]) -> None:
    if not os.path.isdir(base):
        return  # never creates the job's folder
    data = _pack(entries)
    tmp = f"{base}/.tmp-{SUMMARY}.{uuid.uuid4().hex[:8]}"
    try:
        with open(tmp, "xb") as f:  # not fsynced: a cache, and a torn one fails its seal
            f.write(data)
        os.replace(tmp, f"{base}/{SUMMARY}")
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def _read_file(base: str) -> dict[str, tuple[Stamp, CheckpointStatus]]:
    """The summary file's entries, or none when it is missing, torn or of another format."""
    path = f"{base}/{SUMMARY}"
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError:
        return {}
    try:
        body = unseal(data, f"index summary {path}")
        if body is None:
            return {}
        record: Any = msgpack.unpackb(body, strict_map_key=False)
        if not isinstance(record, dict) or record.get("format") != FORMAT:
            return {}
        out = {}
        for name, (stamp, tiers, complete, created, nbytes, metadata, folder) in record["steps"].items():
            step = parse_step_dir(name)
            if step is None:
                continue
            out[name] = ((stamp[0], stamp[1], stamp[2], stamp[3]),
                         CheckpointStatus(step, tuple(tiers), frozenset(complete), {}, created, nbytes=nbytes,
                                          metadata=metadata or {}, folder=folder))
        return out
    except (IntegrityError, ValueError, TypeError, KeyError, IndexError, msgpack.UnpackException) as e:
        log.debug("index summary %s not used: %s", path, e)
        return {}
