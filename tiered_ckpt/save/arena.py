"""The memory tier as the staging buffer: buffers whose memory is the memory tier's own part files.

With a memory tier first in the stack, a buffer is that tier's files, mapped side by side (mapped.py): the
staging copy is the tier's copy, committing there is a rename per part, and the buffer stays with the
checkpoint while the tier keeps it. When retention retires that checkpoint, its files (pages already
allocated) come back as the next free buffer. The arena reaches the tier only through the `FileTier`
contract (path_of, account, capacity).
"""
from __future__ import annotations

import fcntl
import itertools
import logging
import os
import shutil
import socket
import time
from pathlib import Path

from ..errors import ConfigError
from ..lifecycle.host_memory import LOCK_FILE, STAGING_DIR, owned_by, remove_dead, staging_folders
from ..storage.tiers.base import FileTier
from .mapped import MappedParts
from .staging_buffer import StagingBuffer

log = logging.getLogger(__name__)

CLAIM_TRIES = 100  # a cleaner (gc, free, another process's clean_stale) holds an unclaimed folder's lock briefly
TAKE_BACK_WAIT = 10.0  # seconds retention waits for a reader of a retired part file before giving the file up


class Arena:
    """Where mapped buffers live on the memory tier (`tier`): free ones in a folder of this process (`home`,
    locked while the process lives), retained ones under the checkpoint's keys."""

    def __init__(self, name: str, tier: FileTier, home: Path, part_size: int, keep_last: int, job: str, *,
                 keep_best: int = 0):
        self.name = name
        self.tier = tier
        self.home = home
        self.part_size = part_size
        self.keep_last = keep_last
        self.keep_best = keep_best  # the tier's best checkpoints, kept beside the newest keep_last
        self.job = job
        self._ids = itertools.count()
        self._lock_fd: int | None = None

    def start(self) -> None:
        """At the first buffer: claim `home`, and remove what dead processes of the job left (their RAM)."""
        if self._lock_fd is not None:
            return
        self.claim()
        freed = self.clean_stale(self.job)
        if freed:
            self.tier.account(-freed, "staging buffers of processes that are gone")  # counted at the tier's open
            log.info("removed %d bytes of staging buffers that processes of job %r left when they died", freed,
                     self.job)

    owned_by = staticmethod(owned_by)

    @staticmethod
    def home_for(tier: FileTier, job: str, session: str, rank: int) -> Path:
        """This process's folder of free buffers (host and pid in the name are for people; liveness is its lock)."""
        return tier.path_of(f"{STAGING_DIR}/{job}-{session}-r{rank}-{socket.gethostname()}-p{os.getpid()}")

    def claim(self) -> None:
        """Create `home` and hold an exclusive flock on its lock file for as long as this process lives: the
        kernel drops it when the process dies, which is how `clean_stale` (and `tiered-ckpt gc`, `free`) tell a
        dead folder (PIDs are reused and differ between PID namespaces that share one /dev/shm). A cleaner may
        find the folder before this lock is taken, take it for a dead one's and remove it under its own lock:
        then the lock file this process opened is no longer the one at its path, and it claims the folder anew."""
        for _ in range(CLAIM_TRIES):
            self.tier.make_folder(self.home)
            try:
                fd = os.open(self.home / LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o644)
            except FileNotFoundError:  # removed between the two calls
                continue
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:  # a cleaner holds it while it removes the folder: wait for it to finish
                os.close(fd)
                time.sleep(0.01)
                continue
            try:
                same = os.stat(self.home / LOCK_FILE).st_ino == os.fstat(fd).st_ino
            except FileNotFoundError:
                same = False
            if same:
                self._lock_fd = fd
                return
            os.close(fd)
        raise OSError(f"cannot claim the staging folder {self.home}: for {CLAIM_TRIES} tries its lock stayed held "
                      f"(a cleaner removing it) or its lock file was replaced")

    def release_claim(self) -> None:
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None
        shutil.rmtree(self.home, ignore_errors=True)

    def clean_stale(self, job: str) -> int:
        """Remove the buffer folders of this job's processes that are gone (killed or crashed mid-save: their
        staging files hold a state's worth of RAM): those whose lock file nobody holds. Returns bytes freed."""
        freed = 0
        for folder in staging_folders(self.home.parent.parent, job):
            if folder.path == self.home or folder.alive:
                continue
            freed += remove_dead(folder.path) or 0
        return freed

    @property
    def held(self) -> int:
        """Checkpoints the tier keeps besides those in flight (keep_every's come on top, unbounded: a full tier
        retires them before the best ones)."""
        return self.keep_last + self.keep_best

    def check_fits(self, nbytes: int, max_inflight: int) -> None:
        """The tier's capacity holds keep_last (and keep_best) checkpoints, the one retention retires only after
        the next commits, and those in flight; else a ConfigError saying what to change."""
        capacity = self.tier.capacity
        need = (self.held + 1 + max_inflight) * nbytes
        if capacity is not None and need > capacity:
            best, best_n = (" + keep_best", f" + {self.keep_best}") if self.keep_best else ("", "")
            raise ConfigError(f"the memory tier holds keep_last{best} + 1 + max_inflight = {self.keep_last}{best_n} + "
                              f"1 + {max_inflight} states of {nbytes} bytes ({need} bytes) but its capacity is "
                              f"{capacity}: raise capacity, or lower keep_last{', keep_best' if best else ''} or "
                              f"max_inflight", key=f"tiers.{self.name}.capacity")

    def file_bytes(self, nbytes: int) -> int:
        """What one buffer of `nbytes` takes of the tmpfs: each part file rounded up to whole pages, and its
        folder."""
        page = os.sysconf("SC_PAGE_SIZE")
        parts = -(-nbytes // self.part_size) if nbytes else 1
        return sum(-(-min(self.part_size, nbytes - i * self.part_size) // page) * page for i in range(parts)) + page

    def new(self, nbytes: int, pin: bool) -> StagingBuffer:
        self.start()
        folder = self.home / f"buf-{next(self._ids)}"
        return StagingBuffer(nbytes, pin, files=MappedParts(folder, nbytes, self.part_size, pin=pin))

    def publish(self, buf: StagingBuffer, keys: list[str]) -> None:
        """The parts become the tier's values under `keys` (a rename each; no byte is copied)."""
        assert buf.files is not None and not buf.published
        self.tier.account(buf.files.nbytes, f"staged parts of {keys[0] if keys else 'an empty save'}")
        try:
            targets = [self.tier.path_of(k) for k in keys]
            for folder in sorted({t.parent for t in targets}):  # the tier's own folders: a new step folder among the
                self.tier.make_folder(folder)  # names it keeps (LocalTier._child_made), not a change it must list
            buf.files.move(targets)
        except BaseException:
            self.tier.account(-buf.files.nbytes, "staged parts not published")
            raise
        buf.published = True

    def take_back(self, buf: StagingBuffer) -> bool:
        """Move published part files home (the tier no longer holds that checkpoint); False when the buffer
        cannot be reused: its files are gone (the tier deleted them: a failed save's cleanup, a deletion by
        another process), or a reader kept one locked past TAKE_BACK_WAIT seconds (then they are unlinked,
        and the reader keeps its mapping of the old file)."""
        assert buf.files is not None
        try:
            if not buf.files.intact():
                raise FileNotFoundError("a part file is gone")
            if buf.published:
                buf.files.move([buf.files.home / p.name for p in buf.files.paths], exclusive=True,
                               wait=TAKE_BACK_WAIT)
        except (OSError, TimeoutError):
            if buf.published:
                buf.published = False
                self.tier.account(-sum(_size(p) for p in buf.files.paths), "retired staged parts")
            buf.files.unlink()
            return False
        if buf.published:
            buf.published = False
            self.tier.account(-buf.files.nbytes, "retired staged parts")
        return True


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError:
        return 0


