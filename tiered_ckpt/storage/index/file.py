"""The embedded file index: one directory per checkpoint, every record written by atomic rename.

    <root>/<job>/step-000000000100/begun        msgpack {tiers, created}
                                   info         msgpack {nbytes, metadata} (rank 0, at begin)
                                   manifest     the manifest bytes (rank 0)
                                   ranks/<rank> each rank's part checksums
                                   durable/<tier>.<rank>.<session>  a hard link to tallies/<tier>.<session>
                                   tallies/<tier>.<session>          empty; its link count is 1 + the markers
                                   complete/<tier>
                                   failed/<tier>.<rank>.<session>  the reason
                                   abandoned/<tier>.<session>      the node agent ended that session's commit:
                                                                   no later marker completes the tier
                                   skipped/<tier>.<rank>.<session> the newer step that superseded it
    <root>/<job>/notes/<name>                    a writer's note (`put_note`: retention's place per tier)
A tier counts as complete only when complete/<tier> exists; that file is created by rename once every
rank of one session has its durable marker there, so a killed process leaves the checkpoint visibly
incomplete, and an earlier crashed attempt's markers never complete a new one. Every process of a job
must see the same directory (a shared file system for several nodes). Folders are created at the first
write, so opening the index to read (`tiered-ckpt ls`) creates nothing.

A marker and a poll cost O(1) file operations, whatever the number of ranks (listing `durable/` after each
marker made a commit O(R^2): 16.8 s at 1,024 ranks). Each rank's marker is a hard link to its session's tally
file, so the tally's link count, read with one stat after the link, is 1 + the number of ranks marked: the
kernel (or the file server) counts atomically, a rank marked twice (a retry) is counted once, and the count
only grows, so the rank that makes it reach the world size, and any rank that reads it afterwards, tries to
create complete/<tier>; that creation is exclusive (a hard link that fails if the name exists), so the tier
is committed exactly once. Chosen over a counter of numbered slot files (a rank's O_EXCL tries grow with the
ranks before it) and over one rank listing for all (the others would need that rank alive to commit): the
markers stay one file per rank, crash-safe as before, so a listing still names the ranks that never reported.
Where the file system has no hard links, or reports no link count (some FUSE mounts), a marker is a plain file
and the folder is listed after it, as before. A rank's poll (`tier_state` given its rank) stats complete/ and
its own marker, and lists the folders of failures and skips (absent unless a rank failed or skipped).
"""
from __future__ import annotations

import asyncio
import bisect
import errno
import fcntl
import logging
import os
import socket
import threading
import time
import uuid
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping, Sequence, TypeVar

import msgpack

from ...checksum import seal, unseal
from ...errors import IncompleteCheckpoint, IntegrityError, RankFailed, TieredCkptError, WriterConflict
from ...gc_pause import automatic_gc_paused
from ...layout import STEP_DIR, parse_step_dir, step_dir
from ..files import check_creatable, fsync_dir, locked_elsewhere, make_folders
from .base import CheckpointStatus, CommitState, TierState
from . import file_summary
from .file_summary import SUMMARY, StatusSummary, settled, stamp_of, trusted
from ..tiers.base import folder_stamp as _stamp, racy_ns as _racy  # (module names: tests replace them)

T = TypeVar("T")
log = logging.getLogger(__name__)
TOMBSTONES = "tombstones"  # <root>/<job>/tombstones/step-…: checkpoints being removed
NOTES = "notes"  # <root>/<job>/notes/<name>: a writer's notes


class FileIndex:
    def __init__(self, root: Path):
        self.root = Path(root)
        self.epoch = 0
        self.identity = f"file://{os.path.realpath(self.root)}"  # written into each manifest
        self._leases: dict[str, int] = {}  # job → the open, locked writer.lock
        self._names = StepNames()  # each job folder's step folders, sorted: read again only once it changed
        self._summary = StatusSummary()  # settled checkpoints' statuses, by step folder (file_summary.py)
        self._cleaning: set[str] = set()  # jobs whose lease attach() took (a cleaner's, not a writer's)
        self.waiting_for_cleaner = False  # a fence is waiting for a cleaner (gc, delete) to release the lease

    async def open(self) -> None:
        """Check that the directory exists or can be created; it is created at the first write."""
        await self._io(check_creatable, self.root)

    async def close(self) -> None:
        for fd in self._leases.values():
            os.close(fd)  # releases the writer lease
        self._leases.clear()
        self._cleaning.clear()

    async def _io(self, fn: Callable[..., T], *args: Any) -> T:
        """File work in a thread; an OS error becomes an error of the index that names its directory."""
        try:
            return await asyncio.to_thread(fn, *args)
        except TieredCkptError:
            raise
        except OSError as e:
            raise TieredCkptError(f"index {self.root}: {type(e).__name__}: {e}") from e

    async def fence(self, job: str, *, lease: bool = True) -> int:
        """Take the job's writer lease: an exclusive lock on <root>/<job>/writer.lock, held while this index is
        open and released by the OS when the process dies (a crash leaves no stale lease). A second writer
        of the job gets an error naming the holder. The file index has no epochs, so the lease is its only
        fence: taken whatever `lease` says. Returns 0."""
        if job in self._leases:
            self._cleaning.discard(job)  # a cleaner that saves becomes the writer: its lease stays
            return 0
        path = self.root / job / "writer.lock"

        def take() -> int:
            deadline = time.monotonic() + CLEANER_WAIT
            while True:
                fd = _try_lease(path, "")
                if isinstance(fd, int):
                    return fd
                if not fd.startswith(CLEANER) or time.monotonic() > deadline:  # a cleaner holds it for seconds
                    self.waiting_for_cleaner = False
                    raise WriterConflict(f"job {job!r} already has a writer on index {self.root}: {fd}; run one "
                                          f"writer per job (readers may list and load at any time)")
                self.waiting_for_cleaner = True
                time.sleep(0.1)

        try:
            self._leases[job] = await self._io(take)
        finally:
            self.waiting_for_cleaner = False
        return 0

    async def attach(self, job: str, *, hold: bool = True) -> bool:
        """A cleaner (gc, delete) joins the job without starting an incarnation: True when the writer lease is
        free, so no writer of the job runs (with `hold`, it is held until detach() or close, marked as a
        cleaner's, and a writer's first save waits for it); False when a writer holds it. No epochs here."""
        if job in self._leases:
            return True
        path = self.root / job / "writer.lock"
        if not hold:
            return await self._io(_lease_free, path)
        fd = await self._io(_try_lease, path, CLEANER)
        if isinstance(fd, int):
            self._leases[job] = fd
            self._cleaning.add(job)
            return True
        return False

    def lease_fds(self, job: str) -> list[int]:
        """The open writer-lease file of `job` this index holds (fence), for the node agent: the lock is the file
        index's only fence, and a process holding a copy of the descriptor holds the lock (agent/links.py)."""
        fd = self._leases.get(job)
        return [fd] if fd is not None and job not in self._cleaning else []

    async def detach(self, job: str) -> None:
        """The cleaner is done: release the lease attach() took (a writer's lease stays until close)."""
        if job in self._cleaning:
            self._cleaning.discard(job)
            os.close(self._leases.pop(job))

    def _dir(self, job: str, step: int) -> Path:
        return self.root / job / step_dir(step)

    async def begin(self, job: str, step: int, tiers: Sequence[str], info: Mapping[str, Any] | None = None) -> None:
        record = seal(msgpack.packb({"tiers": list(tiers), "created": time.time()}))
        d = self._dir(job, step)

        def write() -> None:
            with self._names.changing(d.parent, d.name, added=True):  # the step's folder is made here
                _atomic_write(d / "begun", record)
        await self._io(write)
        if info is not None:  # rank 0 only: every rank rewrites `begun`, so the info has a file of its own
            await self._io(_atomic_write, self._dir(job, step) / "info", seal(msgpack.packb(dict(info))))

    async def put_manifest(self, job: str, step: int, data: bytes) -> None:
        await self._io(_atomic_write, self._dir(job, step) / "manifest", data)

    async def get_manifest(self, job: str, step: int) -> bytes:
        found = await self._io(_read_or_none, self._dir(job, step) / "manifest")
        if found is None:
            raise IncompleteCheckpoint(f"job {job!r} step {step}: no manifest in the index at {self.root}")
        return found

    async def put_rank_meta(self, job: str, step: int, rank: int, data: bytes) -> None:
        await self._io(_atomic_write, self._dir(job, step) / "ranks" / str(rank), data)

    async def get_rank_meta(self, job: str, step: int, rank: int) -> bytes:
        found = await self._io(_read_or_none, self._dir(job, step) / "ranks" / str(rank))
        if found is None:
            raise IncompleteCheckpoint(f"job {job!r} step {step}: no checksums of rank {rank} in the index")
        return found

    async def mark_durable(self, job: str, step: int, tier: str, rank: int, world_size: int, session: str) -> bool:
        def mark() -> bool:
            d = self._dir(job, step)
            marker = d / "durable" / f"{tier}.{rank}.{session}"
            tally = d / "tallies" / f"{tier}.{session}"
            marked = _link_marker(tally, marker)
            if marked is None:  # no hard links, or no link count, here: a plain marker, and the folder listed
                _atomic_write(marker, b"")
                marked = len(_ranks(d / "durable", tier, session))
            if marked < world_size:
                return False
            with _flocked(tally):  # against abandon(): it commits or the abandonment stands, not both
                abandoned = _read_or_none(d / "abandoned" / f"{tier}.{session}")
                if abandoned is not None:
                    raise RankFailed(f"step {step}: this session's commit was abandoned before rank {rank}'s marker "
                                     f"landed: {abandoned.decode(errors='replace')}", tier=tier)
                return _atomic_create(d / "complete" / tier)  # several last ranks may race here: one wins
        return await self._io(mark)

    async def abandon(self, job: str, step: int, tier: str, session: str, rank: int, reason: str) -> bool:
        """base.Index.abandon: abandoned/<tier>.<session> and this rank's failure, written under the tally's lock
        that the last marker takes to commit (an flock: the check and the write are one step for both)."""
        def abandon() -> bool:
            d = self._dir(job, step)
            if not d.is_dir():  # never begun, or removed: nothing here to commit or to mark
                return True
            tally = d / "tallies" / f"{tier}.{session}"
            _create_tally(tally)
            with _flocked(tally):
                if (d / "complete" / tier).exists():
                    return False
                _atomic_write(d / "abandoned" / f"{tier}.{session}", reason.encode())
                _atomic_write(d / "failed" / f"{tier}.{rank}.{session}", reason.encode())
                return True
        return await self._io(abandon)

    async def mark_failed(self, job: str, step: int, tier: str, rank: int, session: str, reason: str) -> None:
        path = self._dir(job, step) / "failed" / f"{tier}.{rank}.{session}"
        await self._io(_atomic_write, path, reason.encode())

    async def mark_skipped(self, job: str, step: int, tier: str, rank: int, session: str, newer: int) -> None:
        path = self._dir(job, step) / "skipped" / f"{tier}.{rank}.{session}"
        await self._io(_atomic_write, path, str(newer).encode())

    async def tier_state(self, job: str, step: int, tier: str, session: str, *, rank: int | None = None) -> TierState:
        """With `rank` (a rank polling its commit), `ranks_done` holds that rank alone, if it marked the tier:
        a poll stats files instead of listing every rank's marker."""
        def state() -> TierState:
            d = self._dir(job, step)
            if rank is None:
                done = frozenset(_ranks(d / "durable", tier, session))
            else:
                done = frozenset({rank}) if (d / "durable" / f"{tier}.{rank}.{session}").exists() else frozenset()
            if (d / "complete" / tier).exists():
                return TierState(CommitState.COMPLETE, "", done)
            for p in sorted(_entries(d / "skipped")):
                name, _, sess = p.name.rsplit(".", 2)
                if name == tier and sess == session:
                    newer = _read_step(p)
                    if newer is not None:
                        return TierState(CommitState.SKIPPED, "", done, newer)
            for p in sorted(_entries(d / "failed")):
                name, who, sess = p.name.rsplit(".", 2)
                if name == tier and sess == session:
                    return TierState(CommitState.FAILED, f"rank {who}: {p.read_text(errors='replace')}", done)
            return TierState(CommitState.PENDING, "", done)
        return await self._io(state)

    async def unmark(self, job: str, step: int, tier: str) -> None:
        def unmark() -> None:
            d = self._dir(job, step)
            (d / "complete" / tier).unlink(missing_ok=True)
            fsync_dir(d / "complete", missing_ok=True)
            # two processes unmarking two tiers at once (the trainer and the node agent) each read the record and
            # write it back without its tier: unlocked, one of the two writes was lost
            with _flocked(d, os.O_DIRECTORY):
                try:
                    record = _read_begun(d / "begun")
                except FileNotFoundError:  # never begun here, or removed meanwhile
                    record = None
                if record is not None:
                    record["tiers"] = [t for t in record["tiers"] if t != tier]
                    # a removal of the step (delete, or retention on its last tier) may remove the folder
                    # meanwhile: rewrite the record only in the folder as it is, never re-creating it
                    _rewrite(d / "begun", seal(msgpack.packb(record)))
            for p in [*(d / "durable").glob(f"{tier}.*"), *(d / "failed").glob(f"{tier}.*"),
                      *(d / "skipped").glob(f"{tier}.*"), *(d / "tallies").glob(f"{tier}.*"),
                      *(d / "abandoned").glob(f"{tier}.*")]:
                p.unlink(missing_ok=True)
        await self._io(unmark)

    async def list(self, job: str) -> list[CheckpointStatus]:
        return await self._io(self._list_sync, job)

    async def list_range(self, job: str, first: int = 0, *, newest: int | None = None, oldest: int | None = None,
                         also: Sequence[int] = ()) -> list[CheckpointStatus]:
        """The checkpoints of step >= `first` (with `newest`, only that many of the newest of them; with `oldest`,
        that many of the oldest), and those of `also` that exist, oldest first. The job folder's names are read and sorted (one listing, in C: step
        folders' names are fixed-width, so their order is the steps'); only the folders asked for are read."""
        def read() -> list[CheckpointStatus]:
            names = self._names.get(self.root / job)
            lo = bisect.bisect_left(names, step_dir(max(first, 0)))
            window = names[lo:] if newest is None else names[max(lo, len(names) - max(newest, 0)):]
            if oldest is not None:
                window = window[:max(oldest, 0)]
            chosen = set(window)
            chosen.update(step_dir(step) for step in also)  # read from their folders, whatever the cached names
            # say (a folder another process made within the file system's time granularity may be missing there)
            return self._read_names(self.root / job, sorted(chosen), names)
        return await self._io(read)

    async def steps(self, job: str) -> list[int]:
        """The step folders' numbers, from the job folder's sorted names (one listing, read again only once the
        folder changed): no step folder is read."""
        return await self._io(lambda: [int(n[len(STEP_DIR):]) for n in self._names.get(self.root / job)])

    def _list_sync(self, job: str) -> list[CheckpointStatus]:
        """Every step folder's status. From `file_summary.LISTED_FROM` steps on, a settled one is taken from the
        summary while its folders are unchanged (two stats), and the summary is written again once enough were
        read fresh: a listing of ten thousand checkpoints took 0.44 s of CPU, each folder listed and two records
        read."""
        base = self.root / job
        names = self._names.get(base)
        return self._read_names(base, names, names)

    def _read_names(self, base: Path, chosen: list[str], names: list[str]) -> list[CheckpointStatus]:
        """The statuses of step folders `chosen` (sorted) of job folder `base`, whose step folders are `names`: a
        listing's, or a range's (`list_range` from a step far back: a first retention pass from an old place)."""
        where = str(base)
        with automatic_gc_paused():  # ten thousand statuses, in a thread: a collection there stalls the loop too
            if len(chosen) < file_summary.LISTED_FROM:
                return [status for n in chosen if (status := self._status_sync(where, n)) is not None]
            summary = self._summary
            known = summary.entries(where)
            out = []
            for n in chosen:
                read_at = time.time_ns()  # before the stats: a change after them changes the stamp
                stamp = stamp_of(f"{where}/{n}")
                if stamp is None:
                    continue  # removed meanwhile
                hit = known.get(n)
                if hit is not None and hit[0] == stamp:
                    out.append(hit[1])
                    continue
                status, markers = self._read_status(where, n)
                if status is None:
                    continue
                if settled(status) and not markers and trusted(stamp, read_at):
                    summary.put(where, n, stamp, status)
                elif hit is not None:
                    summary.drop(where, n)
                out.append(status)
            with self._names.changing(base, SUMMARY, added=True):  # (not a step's name: the names stay as they are)
                summary.save_if_stale(where, set(names))
            return out

    def _status_sync(self, base: str, name: str) -> CheckpointStatus | None:
        """The status of step folder `name` in job folder `base`; None when it promises nothing (killed before
        `begin` landed). Paths as strings: a listing reads ten thousand of these, and pathlib's objects cost more
        than the reads."""
        return self._read_status(base, name)[0]

    def _read_status(self, base: str, name: str) -> tuple[CheckpointStatus | None, bool]:
        """`_status_sync`, and whether the folder holds a failed/ or skipped/ folder (such a status is not kept
        in the summary: a marker added there later changes only that folder; one of a complete tier, listed as
        nothing, may stand beside one of a tier no longer targeted, which is listed)."""
        step = parse_step_dir(name)
        if step is None:
            return None, False
        d = f"{base}/{name}"
        try:
            held = set(os.listdir(d))  # one listing says which records exist: none is looked for in vain
        except (FileNotFoundError, NotADirectoryError):
            return None, False
        markers = "failed" in held or "skipped" in held
        failures = [p.name.rsplit(".", 2) for p in _entries(Path(d, "failed"))] if "failed" in held else []
        unreadable = ""
        try:
            record = _read_begun(f"{d}/begun")
        except FileNotFoundError:
            if not failures:
                return None, markers  # killed before `begin` landed: nothing was promised
            record = {"tiers": sorted({name for name, _, _ in failures})}  # a rank failed before begin
        except (IntegrityError, ValueError, KeyError, TypeError, msgpack.UnpackException) as e:
            log.warning("index %s: the record of step %d cannot be read (%s); listed as incomplete", self.root,
                        step, e)
            record, unreadable = {"tiers": []}, f"the index record cannot be read: {e}"
        complete = frozenset(name for name in _names(f"{d}/complete") if name in record["tiers"]) \
            if "complete" in held else frozenset()
        failed = {}
        for p in _entries(Path(d, "failed")) if failures else []:
            name, rank, _ = p.name.rsplit(".", 2)
            if name not in complete:
                failed.setdefault(name, f"rank {rank}: {p.read_text(errors='replace')}")
        if unreadable:
            failed["index"] = unreadable
        skipped: dict[str, int] = {}
        for p in _entries(Path(d, "skipped")) if "skipped" in held else []:
            name = p.name.rsplit(".", 2)[0]
            newer = _read_step(p)
            if name in record["tiers"] and name not in complete and newer is not None:
                skipped.setdefault(name, newer)
        info = _read_info(f"{d}/info") if "info" in held else {}
        return CheckpointStatus(step, tuple(record["tiers"]), complete, failed, record.get("created", 0.0),
                                nbytes=info.get("nbytes"), metadata=info.get("metadata") or {}, skipped=skipped,
                                folder=folder if isinstance(folder := info.get("folder"), str) and folder else None), \
            markers

    async def jobs(self) -> list[str]:
        """The jobs with a checkpoint folder here, sorted."""
        def read() -> list[str]:
            return sorted(d.name for d in _entries(self.root) if d.is_dir()
                          and any(parse_step_dir(s.name) is not None for s in _entries(d)))
        return await self._io(read)

    async def bury(self, job: str, step: int) -> None:
        await self._io(_atomic_write, self.root / job / TOMBSTONES / step_dir(step), b"")

    async def now(self) -> float:
        """This machine's clock: a file index is one machine's folder. On a shared file system a trainer
        elsewhere stamps its saves with its own clock; what its running writer may be writing is told apart by
        `began_under_writer`, not by the clocks."""
        return time.time()

    async def began_under_writer(self, job: str, steps: Sequence[int]) -> set[int]:
        """Of `steps`, those whose save began while the job's live writer (another process holding its lease)
        held it: their `begun` record is no older than the lease, by the modification times the file system
        gave both (one clock: the file server's, or this machine's kernel; the saves' `created` stamps are
        the writer's clock, which may be hours off). Empty when no other live process holds the lease."""
        def read() -> set[int]:
            if job in self._leases or lease_holder(self.root, job) is None:
                return set()
            try:
                taken = (self.root / job / "writer.lock").stat().st_mtime_ns
            except FileNotFoundError:
                return set()
            out = set()
            for step in steps:
                d = self._dir(job, step)
                for path in (d / "begun", d):  # no `begun`: a rank failed before it; the folder's own time
                    try:
                        began = path.stat().st_mtime_ns
                    except FileNotFoundError:
                        continue
                    if began >= taken:
                        out.add(step)
                    break
            return out
        return await self._io(read)

    async def buried(self, job: str) -> set[int]:
        def read() -> set[int]:
            steps = (parse_step_dir(p.name) for p in _entries(self.root / job / TOMBSTONES))
            return {s for s in steps if s is not None}
        return await self._io(read)

    async def unbury(self, job: str, step: int) -> None:
        def remove() -> None:
            (self.root / job / TOMBSTONES / step_dir(step)).unlink(missing_ok=True)
            fsync_dir(self.root / job / TOMBSTONES, missing_ok=True)
        await self._io(remove)

    async def get_note(self, job: str, name: str) -> bytes | None:
        return await self._io(_read_or_none, self._note(job, name))

    async def put_note(self, job: str, name: str, data: bytes) -> None:
        await self._io(_atomic_write, self._note(job, name), data)

    def _note(self, job: str, name: str) -> Path:
        if not name or "/" in name or name.startswith("."):
            raise ValueError(f"a note's name is one file name, not {name!r}")
        return self.root / job / NOTES / name

    async def delete(self, job: str, step: int) -> None:
        def delete() -> None:
            d = self._dir(job, step)
            if not d.exists():
                return
            # Drop the commit records first: a crash part-way leaves an incomplete entry, never a false one.
            trash = d.with_name(f".deleting-{d.name}-{uuid.uuid4().hex[:6]}")
            with self._names.changing(d.parent, d.name, added=False):
                os.replace(d, trash)
            fsync_dir(d.parent, missing_ok=True)
            for path in sorted(trash.rglob("*"), key=lambda p: -len(p.parts)):
                path.rmdir() if path.is_dir() else path.unlink()
            with self._names.changing(d.parent, trash.name, added=False):  # (not a step's name: stays as it is)
                trash.rmdir()
        await self._io(delete)

    async def get_rank_metas(self, job: str, step: int, ranks: Sequence[int]) -> dict[int, bytes]:
        """Every record asked for in one pass of one thread (a load reads every saved rank's)."""
        folder = self._dir(job, step) / "ranks"

        def read() -> dict[int, bytes]:
            found = {r: _read_or_none(folder / str(r)) for r in ranks}
            return {r: data for r, data in found.items() if data is not None}
        return await self._io(read)


CLEANER = "cleaner"  # how a lease taken by attach() starts: a writer's fence waits for it
CLEANER_WAIT = 60.0  # seconds a writer's first save waits for a cleaner's lease (gc or delete take seconds)


def _lease_record(role: str) -> bytes:
    who = f"pid {os.getpid()} on {socket.gethostname()} since {time.strftime('%Y-%m-%d %H:%M:%S %z')}"
    return f"{role} ({who})".encode() if role else who.encode()


def _try_lease(path: Path, role: str) -> int | str:
    """The open, exclusively locked lease file (its record rewritten for `role`), or the holder's record."""
    make_folders(path.parent)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.pread(fd, 4096, 0).decode(errors="replace").strip() or "unknown"
        os.close(fd)
        return holder
    os.ftruncate(fd, 0)
    os.pwrite(fd, _lease_record(role), 0)
    return fd


def _lease_free(path: Path) -> bool:
    """Whether no process holds the lease, tested without taking it for longer than the test (nor creating
    the file: a job that never had a writer has none)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError:
        return True
    try:
        return not locked_elsewhere(fd)
    finally:
        os.close(fd)  # drops the shared lock, if taken


def lease_holder(root: Path, job: str) -> str | None:
    """Who holds `job`'s writer lease in the file index at `root` (its record: pid, host, since when), or None
    when no live process does (or there is no lease file, or it cannot be opened). Reads only: tested with a
    shared lock taken and dropped at once, nothing created. gc and free use it to tell a live writer of
    another index from a run that is over."""
    try:
        fd = os.open(Path(root) / job / "writer.lock", os.O_RDONLY)
    except OSError:
        return None
    try:
        if not locked_elsewhere(fd):
            return None
        return os.pread(fd, 4096, 0).decode(errors="replace").strip() or "unknown"
    finally:
        os.close(fd)


def _read_info(path: str) -> dict[str, Any]:
    """Rank 0's {nbytes, metadata} of a step; {} when absent (an older release, a save cut short before it)
    or unreadable (a size is not worth failing a listing for)."""
    try:
        data = _read(path)
        body = unseal(data, f"index record {path}")
        info = msgpack.unpackb(data if body is None else body, strict_map_key=False)
    except FileNotFoundError:
        return {}
    except (IntegrityError, ValueError, TypeError, msgpack.UnpackException) as e:
        log.warning("index %s: %s cannot be read (%s)", Path(path).parent.parent.parent, path, e)
        return {}
    return info if isinstance(info, dict) else {}


def _read(path: str) -> bytes:
    """A small record's bytes: os.read on a descriptor (a listing reads twenty thousand; the buffered file
    object cost as much as the reads themselves)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        chunks = [os.read(fd, 1 << 16)]
        while len(chunks[-1]) == 1 << 16:  # larger than a record ever is, but read whole
            chunks.append(os.read(fd, 1 << 16))
    finally:
        os.close(fd)
    return chunks[0] if len(chunks) == 1 else b"".join(chunks)


def _read_begun(path: str | Path) -> dict[str, Any]:
    data = _read(str(path))
    body = unseal(data, f"index record {path}")
    record = msgpack.unpackb(data if body is None else body)
    if not isinstance(record, dict) or not isinstance(record.get("tiers"), list):
        raise ValueError(f"unexpected content {record!r:.80}")
    return record


def _read_or_none(path: Path) -> bytes | None:
    try:
        return path.read_bytes()
    except FileNotFoundError:
        return None


def _read_step(path: Path) -> int | None:
    """The step a `skipped/` marker names; None when it cannot be read (then it counts for nothing)."""
    try:
        text = path.read_bytes().decode()
    except (OSError, UnicodeDecodeError):
        return None
    return int(text) if text.isdigit() else None


def _ranks(d: Path, tier: str, session: str) -> set[int]:
    ranks = set()
    for p in _entries(d):
        name, rank, sess = p.name.rsplit(".", 2)
        if name == tier and sess == session:
            ranks.add(int(rank))
    return ranks


# os.link's refusals that mean "no hard links here" (not "no such folder"): the marker falls back to a plain file
NO_LINKS = {errno.EPERM, errno.EOPNOTSUPP, errno.ENOTSUP, errno.EXDEV, errno.EMLINK, errno.ENOSYS}


def _link_marker(tally: Path, marker: Path) -> int | None:
    """Link `marker` to `tally` (made first if missing) and return how many markers the tally has now (one
    stat: its link count less its own name); None where the file system takes no hard links or counts none.
    A marker already there (this rank's retry) is counted once, as the first time."""
    try:
        try:
            os.link(tally, marker)
        except FileNotFoundError:  # the session's first marker here, or the folders not made yet
            make_folders(marker.parent)
            _create_tally(tally)
            try:
                os.link(tally, marker)
            except FileExistsError:
                pass
        except FileExistsError:
            pass
        fsync_dir(marker.parent)
        links = os.stat(tally).st_nlink
    except OSError as e:
        if e.errno in NO_LINKS:
            return None
        raise
    return links - 1 if links >= 2 else None  # a marker is linked: fewer links means no real count here


@contextmanager
def _flocked(path: Path, flags: int = 0) -> Iterator[None]:
    """An exclusive flock on `path` (a file, or a folder with O_DIRECTORY) while the block runs; none where it is
    missing. Used on a session's tally file (never replaced: made once, O_EXCL), held by the last marker while
    it commits and by `abandon` while it ends the commit (a missing tally: no hard links, and the lock then covers
    nothing, the marker's process being gone before the agent abandons: operations.md); and on a step's folder
    itself while `unmark` rewrites its record (a folder removed meanwhile leaves nothing to rewrite)."""
    try:
        fd = os.open(path, os.O_RDONLY | flags)
    except FileNotFoundError:
        yield
        return
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def _create_tally(tally: Path) -> None:
    """The empty file that every marker of one tier and session links to; created once (O_EXCL), directly under
    its name: a temporary name linked to it meanwhile would count as a marker."""
    make_folders(tally.parent)
    try:
        fd = os.open(tally, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
    fsync_dir(tally.parent)


class StepNames:
    """The sorted step folder names of each job folder, read again only when the folder changed: its modification
    time (nanoseconds) and inode, one stat, say so. This index's own creations and removals of step folders
    (begin, delete) update the names in place when nothing else changed the folder since they were read, so a
    writer's saves never list the folder again: a save's bookkeeping costs the same at ten thousand checkpoints
    as at a hundred. A change by another process (another rank making the same step's folder, gc or delete from
    the CLI) changes the time, and the folder is listed again at the next look. (A file system that keeps
    modification times coarsely (to the second; a kernel's clock tick) could hide another process's change made
    within the same tick as the listing. Where a folder's link count counts its subfolders (ext4, xfs, tmpfs,
    Lustre, NFS), a step folder made or removed changes it, so the stamp holds it too. Elsewhere (btrfs keeps
    one link) a listing made within the time granularity of the folder's last change (`racy_ns`) is not trusted,
    and the folder is listed again at the next look, as git does with its index. A folder renamed within the
    tick of a listing can still go unseen until the folder changes again. Steps asked for by name are read from
    their folders, never from these names.)"""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._cache: dict[Path, tuple[tuple[int, int, int], list[str], bool]] = {}  # stamp, names, trusted

    def get(self, base: Path) -> list[str]:
        stamp = _stamp(base)
        with self._lock:
            hit = self._cache.get(base)
        if stamp is None:
            return []
        if hit is not None and hit[0] == stamp and hit[2]:
            return hit[1]
        listed_at = time.time_ns()
        names = _step_names(base)  # (a change between the stat and the listing: listed again at the next look)
        with self._lock:
            self._cache[base] = (stamp, names, stamp[2] > 1 or listed_at - stamp[0] > _racy(stamp[0]))
        return names

    @contextmanager
    def changing(self, base: Path, name: str, *, added: bool) -> Iterator[None]:
        """Around this process's own creation (`added`) or removal of folder `name` in `base`."""
        before = _stamp(base)
        try:
            yield
        finally:
            after = _stamp(base)
            with self._lock:
                hit = self._cache.pop(base, None)
                if hit is not None and before is not None and after is not None and hit[0] == before:
                    names = hit[1]
                    at = bisect.bisect_left(names, name)
                    present = at < len(names) and names[at] == name
                    if added and not present and parse_step_dir(name) is not None:
                        names = [*names[:at], name, *names[at:]]
                    elif not added and present:
                        names = [*names[:at], *names[at + 1:]]
                    self._cache[base] = (after, names, hit[2])  # (this process's own change: known exactly)




def _step_names(base: Path) -> list[str]:
    """The step folders' names in a job's folder, sorted (so by step: the names are fixed-width)."""
    try:
        names = sorted(os.listdir(base))
    except (FileNotFoundError, NotADirectoryError):
        return []
    lo, hi = bisect.bisect_left(names, STEP_DIR), bisect.bisect_left(names, STEP_DIR[:-1] + chr(ord(STEP_DIR[-1]) + 1))
    return [n for n in names[lo:hi] if n[len(STEP_DIR):].isdigit()] if hi - lo else []


def _names(d: str) -> list[str]:
    """The names in folder `d` but temp files'; [] when it does not exist."""
    try:
        return [n for n in os.listdir(d) if not n.startswith(".tmp-")]
    except FileNotFoundError:
        return []


def _entries(d: Path) -> list[Path]:
    try:
        return [p for p in d.iterdir() if not p.name.startswith(".tmp-")]
    except FileNotFoundError:
        return []


def _atomic_write(path: Path, data: bytes) -> None:
    make_folders(path.parent)
    tmp = path.with_name(f".tmp-{path.name}.{uuid.uuid4().hex[:8]}")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_dir(path.parent, missing_ok=True)


def _rewrite(path: Path, data: bytes) -> bool:
    """Replace a record atomically in its folder as it is. False, with nothing written, when the folder was
    removed meanwhile (a removal of the step won the race: re-creating the folder would bring the step back)."""
    tmp = path.with_name(f".tmp-{path.name}.{uuid.uuid4().hex[:8]}")
    try:
        with open(tmp, "xb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except FileNotFoundError:  # the folder went away before the temp file, or between it and the rename
        return False
    fsync_dir(path.parent, missing_ok=True)
    return True


def _atomic_create(path: Path) -> bool:
    """Create an empty, durable `path` unless it exists; True for the one caller that created it."""
    make_folders(path.parent)
    tmp = path.with_name(f".tmp-{path.name}.{uuid.uuid4().hex[:8]}")
    with open(tmp, "wb") as f:
        os.fsync(f.fileno())
    try:
        os.link(tmp, path)  # atomic, and fails if the name exists
        created = True
    except FileExistsError:
        created = False
    except OSError:  # a file system without hard links: rename (atomic, but two racers may both see True)
        created = not path.exists()
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    fsync_dir(path.parent, missing_ok=True)
    return created
