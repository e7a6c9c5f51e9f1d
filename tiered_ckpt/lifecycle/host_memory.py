"""The RAM a job holds in the memory tier's folder on this machine, and who holds it.

The memory tier's folder (`/dev/shm/tiered_ckpt-<user>` by default) holds two kinds of files, both RAM:
- each job's checkpoints, under `<job>/step-…/ix-<index>/<session>/`;
- each process's free staging buffers, under `.staging/<job>-<session>-r<rank>-<host>-p<pid>/` (save/arena.py),
  whose `.owner` file the process holds an exclusive `flock` on while it lives. The kernel drops the lock when
  the process dies, however it dies (kill -9 too), so a folder whose lock is free is a dead process's: nothing
  will ever use its files again. PIDs are not trusted (they are reused, and differ between PID namespaces
  that share one /dev/shm).

A process that stages in the memory tier writes its checkpoints under its own session's folder, so a live
process's session (its staging folder's lock held) also names the checkpoint folders it holds mapped: those
are its staging buffers too, retained with their checkpoints (docs/architecture.md, *Save path*, 6).

Nothing here imports torch (the CLI's `ls` and `gc` use it), and nothing here changes a file unless its
name says so (`remove_dead`).
"""
from __future__ import annotations

import fcntl
import logging
import sys
import os
import re
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Callable

from ..layout import job_prefix
from ..storage.files import locked_elsewhere
from ..storage.tiers.memory import MemoryTier

if TYPE_CHECKING:
    from ..storage.tier_io import TierIO

log = logging.getLogger(__name__)
_ONEXC = sys.version_info >= (3, 12)  # shutil.rmtree's onerror is deprecated there

STAGING_DIR = ".staging"  # at the memory tier's root, beside the jobs' folders


def owned_by(job: str) -> Callable[[str], bool]:
    """Whether a key of a tier is `job`'s: under its folder, or in a staging folder of one of its processes
    (`.staging/<job>-<session>-r<rank>-…`; another job whose name begins with `<job>-` does not match). What counts
    toward a file tier's capacity (in the trainer and in the node agent alike)."""
    staging = re.compile(rf"{re.escape(STAGING_DIR)}/{re.escape(job)}-[0-9a-f]+-r\d+-")
    return lambda key: key.startswith(job_prefix(job)) or staging.match(key) is not None
LOCK_FILE = ".owner"  # in a process's staging folder, flock-ed while it lives
CLAIM_WINDOW = 60.0  # seconds: a staging folder without its lock file this young may be being claimed
_REST = r"(?P<session>[0-9a-f]{6,})-r(?P<rank>\d+)-(?P<host>.*)-p(?P<pid>\d+)"  # after "<job>-"
_NAME = re.compile(rf"^(?P<job>.+?)-{_REST}$")
_OF_JOB = re.compile(rf"^{_REST}$")


@dataclass(frozen=True)
class StagingFolder:
    """One process's folder of free staging buffers."""

    path: Path
    job: str
    session: str  # the engine's session: its checkpoints' folders are ix-…/<session>
    rank: int
    host: str
    pid: int
    nbytes: int
    alive: bool  # its process holds the lock (or is claiming the folder right now)

    @property
    def name(self) -> str:
        return f"{STAGING_DIR}/{self.path.name}/"

    def who(self) -> str:
        return f"pid {self.pid} on {self.host}, rank {self.rank}"


def parse_staging_name(name: str, job: str | None = None) -> dict[str, str] | None:
    """The parts of a staging folder's name (job, session, rank, host, pid); None for another job's (or no
    staging folder). With `job` given, its name is matched exactly (a job `a` never takes `a-b`'s folders)."""
    if job is not None:
        if not name.startswith(f"{job}-"):
            return None
        m = _OF_JOB.match(name[len(job) + 1:])  # the session right after "<job>-", as Arena.owned_by counts it
        return None if m is None else {**m.groupdict(), "job": job}
    m = _NAME.match(name)
    return None if m is None else m.groupdict()


def folder_bytes(path: Path) -> int:
    """The bytes of every file below `path` (files that vanish meanwhile count 0)."""
    total = 0
    for dirpath, _, files in os.walk(path):
        for f in files:
            try:
                total += os.lstat(os.path.join(dirpath, f)).st_size
            except OSError:
                pass
    return total


def lock_held(folder: Path) -> bool:
    """Whether a live process holds `folder`'s lock: tested with a shared lock taken and dropped at once,
    without creating or changing anything. A folder without its lock file counts as held while it is young (a
    process between making the folder and locking it), as free once it is older than CLAIM_WINDOW."""
    try:
        fd = os.open(folder / LOCK_FILE, os.O_RDONLY)
    except FileNotFoundError:
        try:
            return time.time() - folder.stat().st_mtime < CLAIM_WINDOW
        except FileNotFoundError:
            return False
    try:
        return locked_elsewhere(fd)
    finally:
        os.close(fd)


def staging_folders(root: Path, job: str | None = None) -> list[StagingFolder]:
    """The staging folders under the memory tier's folder `root`: `job`'s, or every job's (None), by name."""
    base = root / STAGING_DIR
    try:
        entries = sorted(os.scandir(base), key=lambda e: e.name)
    except (FileNotFoundError, NotADirectoryError):
        return []
    out = []
    for entry in entries:
        parts = parse_staging_name(entry.name, job)
        if parts is None or not entry.is_dir(follow_symlinks=False):
            continue
        path = Path(entry.path)
        out.append(StagingFolder(path, parts["job"], parts["session"], int(parts["rank"]), parts["host"],
                                 int(parts["pid"]), folder_bytes(path), lock_held(path)))
    return out


def live_sessions(root: Path) -> dict[str, StagingFolder]:
    """session → a live process's staging folder, for every job in `root`: the checkpoint folders
    `ix-…/<session>` of these sessions are held (mapped) by a process that is still running."""
    return {f.session: f for f in staging_folders(root) if f.alive}


def remove_dead(folder: Path) -> int | None:
    """Remove a dead process's staging folder; its bytes, or None when a process holds it after all. The lock is
    taken (exclusive, never waited for) and held while the folder goes, so its owner, were it claiming the folder
    at this very moment, finds its lock file replaced and claims it anew (Arena.claim)."""
    try:
        fd = os.open(folder / LOCK_FILE, os.O_RDWR)
    except FileNotFoundError:
        if lock_held(folder):  # young and without a lock file: being claimed
            return None
        fd = None
    except NotADirectoryError:
        return None
    try:
        if fd is not None:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                return None  # its process is alive
        nbytes = folder_bytes(folder)
        failed: list[str] = []
        if _ONEXC:
            shutil.rmtree(folder, onexc=lambda _, path, e: failed.append(f"{path}: {e}"))
        else:
            shutil.rmtree(folder, onerror=lambda _, path, info: failed.append(f"{path}: {info[1]}"))
        if failed:  # what stays is still RAM: not reported freed (a file system refusing removals, say)
            log.warning("could not remove all of the dead process's staging folder %s (%d error(s), first: %s)",
                        folder, len(failed), failed[0])
            return nbytes - folder_bytes(folder)
        return nbytes
    finally:
        if fd is not None:
            os.close(fd)


@dataclass(frozen=True)
class HostMemory:
    """What one job holds in one memory tier's folder on this machine, in bytes (file sizes: the tier's files are
    preallocated, so their sizes are the RAM they hold)."""

    tier: str
    path: str
    checkpoints: int  # <path>/<job>/: its checkpoints (every index's), temp files included
    staging: int  # its processes' staging buffers, live and dead
    staging_dead: int  # of which dead processes' (gc and free remove them)

    @property
    def nbytes(self) -> int:
        return self.checkpoints + self.staging

    def as_json(self) -> dict[str, object]:
        return {"tier": self.tier, "path": self.path, "nbytes": self.nbytes, "checkpoints": self.checkpoints,
                "staging": self.staging, "staging_dead": self.staging_dead}


def held(tier: str, root: Path, job: str) -> HostMemory:
    """The RAM `job` holds in the memory tier `tier`'s folder `root` (reads only: creates and changes nothing)."""
    folders = staging_folders(root, job)
    job_dir = root / job
    checkpoints = folder_bytes(job_dir) if job_dir.is_dir() and not job_dir.is_symlink() else 0
    return HostMemory(tier, str(root), checkpoints, sum(f.nbytes for f in folders),
                      sum(f.nbytes for f in folders if not f.alive))


def jobs_in(root: Path) -> list[str]:
    """The jobs with a folder (checkpoints) or a staging folder in the memory tier's folder `root`, sorted."""
    try:
        jobs = {e.name for e in os.scandir(root) if e.is_dir(follow_symlinks=False) and not e.name.startswith(".")}
    except (FileNotFoundError, NotADirectoryError):
        jobs = set()
    jobs.update(f.job for f in staging_folders(root))
    return sorted(jobs)


def memory_tiers(io: TierIO) -> list[tuple[str, Path]]:
    """(name, folder) of each memory tier of the stack: the folders of this machine's RAM that `ls` sums and
    `free` and `gc` clean (a `local` tier on a tmpfs is a disk to us: its copies are what the user asked for)."""
    out = []
    for name in io:
        tier = io.file_tier(name)
        if isinstance(tier, MemoryTier):
            out.append((name, tier.root))
    return out


def live_sessions_in(roots: list[Path]) -> dict[str, StagingFolder]:
    """live_sessions of several memory tiers' folders together."""
    out: dict[str, StagingFolder] = {}
    for root in roots:
        out.update(live_sessions(root))
    return out
