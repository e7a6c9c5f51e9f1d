"""Files in a directory: write to a temp file, fsync, rename, fsync the directory.

Bulk I/O uses os.pwrite/os.preadv in executor threads (they release the GIL); preadv scatters a part
straight into the caller's buffers, so a load copies each byte once.
"""
from __future__ import annotations

import bisect
import contextlib
import errno
import logging
import os
import shutil
import sys
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, ClassVar, Iterator, Sequence

import msgpack

from ...checksum import seal, unseal
from ...errors import ConfigError, IntegrityError, TierError, TierFull, TierNotFound
from ..files import check_creatable, fsync_dir, not_private
from .base import FileTier, folder_stamp, listing_trusted

log = logging.getLogger(__name__)
TMP = ".tmp-"
TAILS = f"{TMP}names"  # <root>/.tmp-names/<job>: a job folder's newest step names, kept across processes (`_Tail`)
TAIL_FORMAT = 1
TAIL_NAMES = 64  # a tail file holds at least the newest 64 names (a writer's start and retention's window look there)
IOV_MAX = os.sysconf("SC_IOV_MAX") if "SC_IOV_MAX" in os.sysconf_names else 1024


@dataclass(frozen=True)
class LocalOptions:
    path: str
    capacity: int | None = field(default=None, metadata={"size": True, "min": 1, "why": "omit it for no limit"})
    fsync: bool = True
    mode: int = field(default=0o700, metadata={"min": 0, "max": 0o777})  # the tier's folder, when it creates it


class LocalTier(FileTier):
    Options = LocalOptions
    read_span = 16 << 20  # read_chunks reads this much at a time: a disk wants large requests
    private: ClassVar[bool] = False  # refuse a folder another user owns or can write (its default path is shared)

    @classmethod
    def check_options(cls, name: str, options: LocalOptions) -> None:
        if not options.path.strip():
            raise ConfigError("must name a folder (an empty path would be the current folder)",
                              key=f"tiers.{name}.path")

    def __init__(self, name: str, options: LocalOptions):
        super().__init__(name, options)
        self.root = Path(options.path)
        self._used: int | None = None  # bytes stored; counted at open() when a capacity is set
        self._used_lock = threading.Lock()  # account() runs in worker threads, the rest on the event loop
        self._writing: set[Path] = set()  # files being written, with a capacity: one write of a file at a time
        self._written = threading.Condition(self._used_lock)
        self._owned: Callable[[str], bool] = lambda key: True  # what counts toward the capacity (count_only)
        self._root_checked = False  # the tier's folder was found this user's own (private tiers)
        self._sorted_names: dict[str, tuple[tuple[int, int, int], list[str], bool]] = {}  # list_from's
        self._names_lock = threading.Lock()
        self._tails: dict[str, _Tail] = {}  # per job folder: its names from a step on (a tail file's, kept up)
        self._tails_written: dict[str, tuple[tuple[int, int, int], str]] = {}  # per job folder: its tail file's
        # stamp and floor, as this process last wrote or read it
        self._asked: dict[str, str] = {}  # per job folder: the last `start` a writer asked its names from
        self._tails_read: set[str] = set()  # job folders whose tail file this process has read
        self._probed: dict[str, tuple[tuple[int, int, int], tuple[int, int, int]]] = {}  # per job folder: its
        # stamps before and after this process's probe (a file made and removed there: no name changed)

    async def open(self) -> None:
        """Check that the directory exists or can be created; it is created at the first write, so a
        process that only reads (`tiered-ckpt ls`, `show`, `verify`) never brings back a removed one."""
        try:
            await self.run_blocking(check_creatable, self.root)
        except OSError as e:
            raise TierError(f"cannot create directory {self.root}: {e}", tier=self.name) from e
        await self.run_blocking(self._check_private)
        await self.recount()  # what earlier processes left here (this job's only)

    async def recount(self) -> None:
        if self.options.capacity is not None:
            used = await self.run_blocking(_owned_size, self.root, self._owned)
            with self._used_lock:
                self._used = used

    def count_only(self, owned: Callable[[str], bool]) -> None:
        self._owned = owned

    def make_folder(self, path: Path) -> None:
        if not os.path.lexists(self.root):
            self.root.parent.mkdir(parents=True, exist_ok=True)
            mode = getattr(self.options, "mode", 0o700)  # the memory tier's is always 0700
            try:
                os.mkdir(self.root, mode)
                os.chmod(self.root, mode)  # exactly this mode, whatever the umask
            except FileExistsError:
                pass  # another process made it first
            self._root_checked = False
        if not self._root_checked:  # once, and again after the folder was made anew (by anyone)
            self._check_private()
            self._root_checked = True
        made = self._new_child_of_listed(path)
        if made is None:
            path.mkdir(parents=True, exist_ok=True)
            return
        folder, name = made
        before = folder_stamp(self.root / folder)
        path.mkdir(parents=True, exist_ok=True)
        self._child_made(folder, name, before, folder_stamp(self.root / folder))

    def _new_child_of_listed(self, path: Path) -> tuple[str, str] | None:
        """(a folder whose sorted names this tier keeps, the name of its child that making `path` creates), or None:
        `path` lies in no such folder, or that child exists already (making `path` leaves the folder as it is)."""
        with self._names_lock:
            listed = [*self._sorted_names, *(f for f in self._tails if f not in self._sorted_names)]
        if not listed:
            return None
        rel = str(path)[len(str(self.root)):].lstrip("/")
        for folder in listed:
            if rel.startswith(folder + "/"):
                name = rel[len(folder) + 1:].split("/", 1)[0]
                return None if os.path.isdir(self.root / folder / name) else (folder, name)
        return None

    def _child_made(self, folder: str, name: str, before: tuple[int, int, int] | None,
                    after: tuple[int, int, int] | None) -> None:
        """This process made folder `name` in `folder`, whose names it keeps: put it among them when that was the
        folder's only change since they were listed (its stamp then was `before`, and its link count, which counts
        subfolders, grew by one), so a save's own new step folder does not make the next look list ten thousand
        step folders again. Else the names are left to be listed again (their stamp no longer matches)."""
        if before is None or after is None or after[2] != before[2] + 1 or before[2] <= 1:
            return
        self._carry_names(folder, before, after, lambda names, floor: _with(names, name) if name >= floor else names)

    def _child_removed(self, folder: str, name: str, before: tuple[int, int, int] | None,
                       after: tuple[int, int, int] | None) -> None:
        """`_child_made` for this process's removal of folder `name` from `folder` (a step retention removed): its
        link count fell by one and nothing else changed it since its names were listed."""
        if before is None or after is None or after[2] != before[2] - 1 or after[2] < 2:
            return
        self._carry_names(folder, before, after, lambda names, floor: _without(names, name))

    def _carry_names(self, folder: str, before: tuple[int, int, int], after: tuple[int, int, int],
                     edit: Callable[[list[str], str], list[str]]) -> None:
        """The names kept of `folder` while its stamp was `before`, edited by this process's own change, are its
        names at stamp `after` (`edit(names, floor)`; floor "" for the whole folder's, the tail's lowest name)."""
        with self._names_lock:
            hit = self._sorted_names.get(folder)
            if hit is not None and hit[0] == before and hit[2]:
                self._sorted_names[folder] = (after, edit(hit[1], ""), True)
            tail = self._tails.get(folder)
            if tail is not None and tail.stamp == before:
                self._tails[folder] = _Tail(after, tail.floor, edit(tail.names, tail.floor))
        self._keep_tail(folder)

    async def probe(self, key: str) -> None:
        """A writer's probe writes and removes a file in the job's folder (`<job>/.probe-…`), which changes the
        folder's modification time but none of its names: when nothing else changed it meanwhile (its inode and
        link count the same), the names the tail file keeps for the folder's stamp before the probe are its names
        after it too (`_names_from`), so the probe does not send the writer's start to list ten thousand folders."""
        folder = key.split("/", 1)[0] if "/" in key else ""
        before = folder_stamp(self.root / folder) if folder else None
        await super().probe(key)
        after = folder_stamp(self.root / folder) if folder else None
        if before is not None and after is not None and before[1:] == after[1:] and before != after:
            with self._names_lock:
                self._probed[folder] = (before, after)
                hit = self._sorted_names.get(folder)
                if hit is not None and hit[0] == before:
                    self._sorted_names[folder] = (after, hit[1], hit[2])
                tail = self._tails.get(folder)
                if tail is not None and tail.stamp == before:
                    self._tails[folder] = _Tail(after, tail.floor, tail.names)

    def _names_from(self, folder: str, start: str, *, writer: bool) -> list[str]:
        """`folder`'s sorted names from `start` on, without listing the folder where this process knows them (it
        listed it, unchanged since but for its own steps) or where its tail file (`_Tail`) holds them: the file is
        good only while the folder is unchanged since it was written (the same stamp: modification time in ns,
        inode, link count), so a step made or removed by anyone else, a crash between a step folder made and the
        file written, another incarnation's leftovers, all send this look to the folder. A writer (`writer`: the
        job's start and retention) keeps the file for the next process (`_keep_tail`)."""
        path = self._path(folder)
        stamp = folder_stamp(path)
        if stamp is None:
            return []
        with self._names_lock:
            if writer:
                self._asked[folder] = start
            hit = self._sorted_names.get(folder)
            tail = self._tails.get(folder)
        if hit is not None and hit[0] == stamp and hit[2]:
            names = hit[1]
        else:
            if tail is None and folder not in self._tails_read:
                self._tails_read.add(folder)
                read = _read_tail(self._tail_path(folder))
                probed = self._probed.get(folder)
                if read is not None and probed is not None and read.stamp == probed[0]:
                    read = _Tail(probed[1], read.floor, read.names)  # (this process's probe since it was written)
                if read is not None and read.stamp == stamp:
                    with self._names_lock:
                        tail = self._tails.setdefault(folder, read)
                        self._tails_written[folder] = (read.stamp, read.floor)
            if tail is not None and tail.stamp == stamp and tail.floor <= start:
                names = tail.names
            else:
                names = self._names_of(folder)
        found = names[bisect.bisect_left(names, start):]
        if writer:
            self._keep_tail(folder)
        return found

    def _tail_path(self, folder: str) -> Path:
        return self.root / TAILS / folder

    def _keep_tail(self, folder: str) -> None:
        """Write `folder`'s tail file when what it would say changed: as of the folder's stamp that this process
        knows its names at, the names from the newest `TAIL_NAMES` on, or from the last `start` a writer asked if
        lower (retention's window: the next process's first pass asks from about there). Only for a job's folder
        whose names a writer asked for in this process (it listed them, or read them from the tail file, and kept
        up with its own steps since); best effort: a cache, never an error."""
        if "/" in folder or folder.startswith(".") or not folder:
            return
        with self._names_lock:
            asked = self._asked.get(folder)
            if asked is None:
                return
            hit = self._sorted_names.get(folder)
            tail = self._tails.get(folder)
        now = folder_stamp(self._path(folder))  # (names of an earlier stamp would be a file no one can use)
        with self._names_lock:
            if hit is not None and hit[2] and hit[0] == now:
                stamp, names, lowest = hit[0], hit[1], ""
            elif tail is not None and tail.stamp == now:
                stamp, names, lowest = tail.stamp, tail.names, tail.floor
            else:
                return
            newest = names[-TAIL_NAMES] if len(names) >= TAIL_NAMES else ""
            floor = max(min(asked, newest), lowest)
            if self._tails_written.get(folder) == (stamp, floor):
                return
            kept = _Tail(stamp, floor, names[bisect.bisect_left(names, floor):])
        try:
            _write_tail(self._tail_path(folder), kept)
        except OSError as e:
            log.debug("tier %s: the names of %s not kept: %s", self.name, folder, e)
            return
        with self._names_lock:
            self._tails_written[folder] = (stamp, floor)
            if folder not in self._tails or self._tails[folder].stamp != stamp:  # (one of its own steps since)
                self._tails[folder] = kept

    def _check_private(self) -> None:
        """A private tier's existing folder must be this user's and closed to others: else another local user
        could read every checkpoint, or swap the job's folder for a forged one (checksums are no signatures)."""
        if not self.private:
            return
        try:
            problem = not_private(self.root)
        except FileNotFoundError:
            return  # created at the first write, with this tier's mode
        if problem is not None:
            raise TierError(f"refusing {problem}: another user could read or replace its checkpoints; remove it, or "
                            f"set this tier's `path` to a folder of your own", tier=self.name)

    @property
    def capacity(self) -> int | None:
        return self.options.capacity

    def account(self, nbytes: int, what: str) -> None:
        """Count `nbytes` that entered the tier without `write` (negative: that left it without `delete`): the
        memory tier's staging files, published and taken back by rename. Past the capacity: TierFull."""
        if self._used is None:
            return
        with self._used_lock:
            if nbytes > 0 and self._used + nbytes > self.options.capacity:
                raise TierFull(f"capacity {self.options.capacity} bytes exceeded: {self._used} used, adding "
                               f"{nbytes} more ({what}); raise `capacity` or lower `keep_last`", tier=self.name)
            self._used += nbytes

    def _add_used(self, nbytes: int) -> None:
        if self._used is not None:
            with self._used_lock:
                self._used += nbytes

    def path_of(self, key: str) -> Path:
        """The file that holds `key`."""
        return self._path(key)

    def _path(self, key: str) -> Path:
        if key.startswith("/") or ".." in key.split("/"):
            raise ValueError(f"invalid key {key!r}")
        return self.root / key

    async def write(self, key: str, data: memoryview) -> None:
        path = self._path(key)
        try:
            await self.run_blocking(self._reserve_and_write, path, data)
        except TierFull:  # (an OSError too) raised by the capacity check: nothing was counted or written
            raise
        except OSError as e:
            if e.errno == errno.ENOSPC:
                raise TierFull(f"no space left writing {path}", tier=self.name) from e
            raise TierError(f"writing {path}: {e}", tier=self.name) from e

    def _reserve_and_write(self, path: Path, data: memoryview) -> None:
        """One trip to a worker thread for both (the capacity check stats the file it replaces): a save writes
        several small records per tier, and each trip costs the event loop, and so the training thread's GIL,
        more than the stat. A write that fails gives back what the check counted. With a capacity, writes of one
        file run one at a time: a retry beside a timed-out write still running in its thread would otherwise
        count the same file twice (each check stats the file before either rename)."""
        if self.options.capacity is None:
            self._write_sync(path, data)
        else:
            with self._sole_writer(path):
                counted = self._reserve(path, len(data))
                try:
                    self._write_sync(path, data)
                except BaseException:
                    self._add_used(-counted)
                    raise
        if self.options.fsync:  # after the rename the bytes are the tier's: a failure here keeps them counted
            fsync_dir(path.parent)

    @contextlib.contextmanager
    def _sole_writer(self, path: Path) -> Iterator[None]:
        with self._written:
            while path in self._writing:
                self._written.wait()
            self._writing.add(path)
        try:
            yield
        finally:
            with self._written:
                self._writing.discard(path)
                self._written.notify_all()

    def _reserve(self, path: Path, nbytes: int) -> int:
        """Count `nbytes` replacing the file at `path` against the capacity; return the change counted."""
        assert self._used is not None, "open() counts the used bytes of a tier with a capacity"
        old = _size_or_zero(path)
        with self._used_lock:
            if self._used - old + nbytes > self.options.capacity:
                raise TierFull(
                    f"capacity {self.options.capacity} bytes exceeded: {self._used} used, writing {nbytes} more "
                    f"({path}); raise `capacity` or lower `keep_last`", tier=self.name)
            self._used += nbytes - old
        return nbytes - old

    def _write_sync(self, path: Path, data: memoryview) -> None:
        """Write a temporary file and rename it over `path` (the caller makes the rename durable)."""
        tmp = path.with_name(f"{TMP}{path.name}.{uuid.uuid4().hex[:8]}")
        for attempt in range(3):  # a cleaner (gc) may remove an empty folder between the mkdir and the open
            try:
                self.make_folder(path.parent)
                fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
                break
            except FileNotFoundError:
                if attempt == 2:
                    raise
        try:
            view, pos = memoryview(data).cast("B"), 0
            while pos < len(view):
                pos += os.pwrite(fd, view[pos : pos + (1 << 30)], pos)
            if self.options.fsync:
                os.fsync(fd)
        except BaseException:
            os.close(fd)
            tmp.unlink(missing_ok=True)
            raise
        os.close(fd)
        os.replace(tmp, path)

    async def read_into(self, key: str, out: Sequence[memoryview]) -> int:
        path = self._path(key)
        try:
            return await self.run_blocking(_read_into_sync, path, out)
        except FileNotFoundError:
            raise TierNotFound(f"{path} not found", tier=self.name) from None
        except OSError as e:
            raise TierError(f"reading {path}: {e}", tier=self.name) from e

    async def read_chunks(self, key: str, chunk_size: int, length: int,
                          consume: Callable[[memoryview, int], bool]) -> int | None:
        path = self._path(key)

        span = max(chunk_size, min(self.read_span, length) // chunk_size * chunk_size)

        def read() -> int | None:
            fd = self._open_for_chunks(path)
            if fd is None:
                return None
            try:
                size = os.fstat(fd).st_size
                if size != length:
                    return size
                buf = _chunk_buffer(span)
                at = 0
                while at < size:
                    want = min(span, size - at)
                    got = 0
                    while got < want:
                        n = os.preadv(fd, [buf[got:want]], at + got)
                        if n <= 0:
                            return at + got  # shrank while reading
                        got += n
                    for piece in range(0, got, chunk_size):
                        if not consume(buf[piece:min(piece + chunk_size, got)], at + piece):
                            return size
                    at += got
                return size
            finally:
                os.close(fd)  # (releases a reader's lock, where there is one)

        try:
            return await self.run_blocking(read)
        except FileNotFoundError:
            raise TierNotFound(f"{path} not found", tier=self.name) from None
        except OSError as e:
            raise TierError(f"reading {path}: {e}", tier=self.name) from e

    def _open_for_chunks(self, path: Path) -> int | None:
        """The file, opened to be read chunk by chunk; None if it cannot be read that way now."""
        return os.open(path, os.O_RDONLY)

    async def read(self, key: str) -> bytes:
        path = self._path(key)
        try:
            return await self.run_blocking(path.read_bytes)
        except FileNotFoundError:
            raise TierNotFound(f"{path} not found", tier=self.name) from None
        except OSError as e:
            raise TierError(f"reading {path}: {e}", tier=self.name) from e

    async def delete(self, prefix: str) -> None:
        freed = await self.run_blocking(self._delete_tracked, prefix.rstrip("/"))
        self._add_used(-freed)

    def _delete_tracked(self, key: str) -> int:
        """`_delete_sync`, keeping the names this process knows of the job folder up to date when it removes one of
        its step folders (`_child_removed`)."""
        parts = key.split("/")
        with self._names_lock:
            known = len(parts) >= 2 and (parts[0] in self._sorted_names or parts[0] in self._tails)
        if not known:
            return self._delete_sync(self._path(key))
        folder, name = parts[0], parts[1]
        before = folder_stamp(self.root / folder)
        freed = self._delete_sync(self._path(key))
        if not os.path.lexists(self.root / folder / name):
            self._child_removed(folder, name, before, folder_stamp(self.root / folder))
        return freed

    def _delete_sync(self, path: Path) -> int:
        if path.is_dir():
            freed = _tree_size(path)
            failed = _remove_tree(path)
            if failed:  # a read-only remount, an immutable file: a delete that did not happen says so
                raise TierError(f"could not remove {len(failed)} item(s) under {path}, first: {failed[0]}",
                                tier=self.name)
        else:
            freed = _size_or_zero(path)
            path.unlink(missing_ok=True)
        if self.options.fsync and path.parent.exists():
            fsync_dir(path.parent)
        parent = path.parent  # folders left empty (a step's, once its last incarnation folder went) go too;
        while parent != self.root and self.root in parent.parents:  # a writer racing with this retries its mkdir
            try:
                parent.rmdir()
            except OSError:
                break
            parent = parent.parent
        return freed

    async def missing(self, keys: Sequence[str]) -> list[str]:
        """A file can vanish behind the engine's back (an operator or a cleaner of /dev/shm): one stat per
        key before a commit is cheap next to writing the parts."""
        return await self.run_blocking(lambda: [k for k in keys if not self._path(k).is_file()])

    async def list_from(self, prefix: str, start: str) -> list[str]:
        """The folder `prefix`'s sorted names, then a walk of only the sub-folders whose keys can sort at or after
        `start`: a load's look at a job's newest steps does not walk its whole history. The names are listed again
        only once the folder changed (its modification time in nanoseconds and inode, one stat): ten thousand step
        folders take 5 ms to list and sort, and a load looks at them each time."""
        if not prefix.endswith("/") or not start.startswith(prefix):
            return await super().list_from(prefix, start)

        def walk() -> list[str]:
            first = start[len(prefix):].split("/")[0]
            keys = []
            for name in self._names_from(prefix.rstrip("/"), first, writer=False):
                if name.startswith(TMP):
                    continue
                path = self._path(prefix + name)
                if path.is_dir():
                    keys += [key for key in self._keys_under(path) if key >= start]
                elif prefix + name >= start:
                    keys.append(prefix + name)
            return sorted(keys)
        return await self.run_blocking(walk)

    async def list_names(self, prefix: str, start: str | None = None) -> list[str]:
        """The folder's sorted names (`_names_of`: listed again only once it changed), temp files left out; with
        `start`, those from `start` on (`_names_from`: a writer's look at its newest steps reads no listing of the
        folder where its tail file says them)."""
        if not prefix.endswith("/"):
            return await super().list_names(prefix, start)
        if start is None:
            return await self.run_blocking(lambda: _without_temp(self._names_of(prefix.rstrip("/"))))
        return await self.run_blocking(lambda: _without_temp(self._names_from(prefix.rstrip("/"), start,
                                                                              writer=True)))

    def _names_of(self, folder: str) -> list[str]:
        """`folder`'s names, sorted: from the last listing while the folder is unchanged since (a file system
        keeping times coarsely could hide a change made within the tick of that listing: `listing_trusted`)."""
        path = self._path(folder)
        stamp = folder_stamp(path)
        if stamp is None:
            return []
        with self._names_lock:
            hit = self._sorted_names.get(folder)
        if hit is not None and hit[0] == stamp and hit[2]:
            return hit[1]
        listed_at = time.time_ns()
        try:
            names = sorted(os.listdir(path))
        except (FileNotFoundError, NotADirectoryError):
            return []
        with self._names_lock:  # (changed since the stat: listed again at the next look)
            self._sorted_names[folder] = (stamp, names, listing_trusted(stamp, listed_at))
        return names

    async def list(self, prefix: str) -> list[str]:
        def walk() -> list[str]:
            base = self._path(prefix.rstrip("/")) if prefix else self.root
            start = base if base.is_dir() else base.parent
            keys = [key for key in self._keys_under(start) if key.startswith(prefix)]
            return sorted(keys)
        return await self.run_blocking(walk)

    def _keys_under(self, folder: Path) -> Iterator[str]:
        """The keys of the files below `folder` (a folder of this tier), temp files left out, in no order; what
        os.walk would find (a link to a folder is not followed nor listed; a folder that cannot be read is passed
        over). Each folder's part of the key is cut once from its path, not worked out per file, and the walk is
        one scandir per folder: os.path.relpath per file, and os.walk's join and islink per folder, were most of
        the CPU of listing a tier that keeps ten thousand checkpoints (40,000 files in 80,000 folders)."""
        root = str(self.root)
        below = root if root.endswith("/") else root + "/"
        stack = [str(folder)]
        while stack:
            path = stack.pop()
            rel = path[len(below):] if path.startswith(below) else "" if path == root else os.path.relpath(path, root)
            head = rel + "/" if rel else ""
            try:
                entries = os.scandir(path)
            except OSError:
                continue
            with entries:
                for entry in entries:
                    try:
                        is_dir = entry.is_dir()
                    except OSError:
                        is_dir = False
                    if is_dir:
                        if not entry.is_symlink() and not entry.name.startswith(TMP):  # (the tails' folder)
                            stack.append(entry.path)
                    elif not entry.name.startswith(TMP):
                        yield head + entry.name

    async def usage(self, prefix: str) -> dict[str, int]:
        def walk() -> dict[str, int]:
            found = {}
            base = self._path(prefix.rstrip("/")) if prefix else self.root
            for dirpath, _, files in os.walk(base if base.is_dir() else base.parent):
                for f in files:
                    key = os.path.relpath(os.path.join(dirpath, f), self.root)
                    if not f.startswith(TMP) and key.startswith(prefix):
                        found[key] = _size_or_zero(Path(dirpath, f))
            return found
        return await self.run_blocking(walk)

    async def debris(self, prefix: str, older_than: float) -> list[tuple[str, int]]:
        """Temp files (`.tmp-*`, a write cut short) and folders holding no file, below the folder `prefix`
        names (never that folder itself), all untouched for more than `older_than` seconds."""
        return await self.run_blocking(self._debris_sync, prefix, time.time() - older_than)

    def _debris_sync(self, prefix: str, cutoff: float) -> list[tuple[str, int]]:
        base = self._path(prefix.rstrip("/")) if prefix else self.root
        if not base.is_dir():
            return []
        found: list[tuple[str, int]] = []
        empty: set[Path] = set()  # folders that hold nothing but old temp files and such folders
        for dirpath, dirs, files in os.walk(base, topdown=False):
            folder, only_debris = Path(dirpath), True
            for f in files:
                try:
                    st = (folder / f).lstat()
                except FileNotFoundError:
                    continue
                if f.startswith(TMP) and st.st_mtime < cutoff:
                    found.append((os.path.relpath(folder / f, self.root), st.st_size))
                else:
                    only_debris = False
            if folder != base and only_debris and all(folder / d in empty for d in dirs):
                if _mtime(folder) < cutoff:
                    empty.add(folder)
        found += [(os.path.relpath(d, self.root) + "/", 0) for d in sorted(empty) if d.parent not in empty]
        return found

    async def remove_debris(self, names: Sequence[str], older_than: float) -> int:
        freed = await self.run_blocking(self._remove_debris_sync, list(names), time.time() - older_than)
        self._add_used(-freed)
        return freed

    def _remove_debris_sync(self, names: list[str], cutoff: float) -> int:
        freed = 0
        for name in sorted(names, key=lambda n: n.endswith("/")):  # temp files first, then the folders
            path = self._path(name.rstrip("/"))
            if not name.endswith("/"):
                try:
                    st = path.lstat()
                    if path.name.startswith(TMP) and st.st_mtime < cutoff:
                        path.unlink()
                        freed += st.st_size
                except FileNotFoundError:
                    pass
                continue
            for dirpath, _, _ in os.walk(path, topdown=False):  # rmdir only: a file written meanwhile stays
                try:
                    os.rmdir(dirpath)
                except OSError:
                    break
        return freed


def _remove_tree(path: Path) -> list[OSError]:
    """rmtree that goes on past errors and returns them; a file already gone (a racing delete) is no error."""
    failed: list[OSError] = []

    def note(_fn: object, _path: str, exc: object) -> None:
        error = exc[1] if isinstance(exc, tuple) else exc
        if isinstance(error, OSError) and not isinstance(error, FileNotFoundError):
            failed.append(error)
        elif not isinstance(error, OSError):
            raise error  # type: ignore[misc]

    if sys.version_info >= (3, 12):
        shutil.rmtree(path, onexc=note)  # type: ignore[call-arg]
    else:
        shutil.rmtree(path, onerror=note)
    return failed


def _mtime(path: Path) -> float:
    try:
        return path.lstat().st_mtime
    except OSError:
        return float("inf")


_buffers = threading.local()


def _chunk_buffer(chunk_size: int) -> memoryview:
    """This thread's buffer for chunked reads: reused, so its pages stay allocated (and, as small as the memory
    tier's reads keep it, its bytes in cache)."""
    buf = getattr(_buffers, "chunk", None)
    if buf is None or len(buf) < chunk_size:
        buf = _buffers.chunk = memoryview(bytearray(chunk_size))
    return buf


def _read_into_sync(path: Path, out: Sequence[memoryview]) -> int:
    fd = os.open(path, os.O_RDONLY)
    try:
        size = os.fstat(fd).st_size
        want = sum(len(b) for b in out)
        if size == want:
            bufs, pos = [memoryview(b).cast("B") for b in out if len(b)], 0
            while bufs:
                n = os.preadv(fd, bufs[:IOV_MAX], pos)
                if n == 0:
                    return pos  # shrank while reading
                pos += n
                while bufs and n >= len(bufs[0]):
                    n -= len(bufs[0])
                    bufs.pop(0)
                if n:
                    bufs[0] = bufs[0][n:]
        return size
    finally:
        os.close(fd)


def _size_or_zero(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError:
        return 0


def _owned_size(root: Path, owned: Callable[[str], bool]) -> int:
    """Bytes of the files below `root` whose key (path relative to `root`) `owned` accepts."""
    total = 0
    for dirpath, _, files in os.walk(root):
        for f in files:
            key = os.path.relpath(os.path.join(dirpath, f), root)
            if owned(key):
                total += _size_or_zero(Path(dirpath, f))
    return total


def _tree_size(path: Path) -> int:
    total = 0
    for dirpath, _, files in os.walk(path):
        total += sum(_size_or_zero(Path(dirpath, f)) for f in files)
    return total


def _without_temp(names: list[str]) -> list[str]:
    """Sorted `names` but temp files': theirs sort together (one prefix), so two bisects and a copy in C, not a
    test per name (ten thousand step folders)."""
    lo = bisect.bisect_left(names, TMP)
    hi = bisect.bisect_left(names, TMP[:-1] + chr(ord(TMP[-1]) + 1), lo)
    return names[:lo] + names[hi:] if hi > lo else list(names)


@dataclass(frozen=True)
class _Tail:
    """A job folder's names from `floor` on, as they were when the folder had `stamp` (modification time in ns,
    inode, link count): kept by a writer in `<root>/.tmp-names/<job>` as its own steps land or go, so that a new
    process's first look at its newest steps (the writer's start, retention's first pass, a load's pick) reads a
    few names instead of listing ten thousand step folders. Good only while the folder still has that stamp."""

    stamp: tuple[int, int, int]
    floor: str
    names: list[str]


def _read_tail(path: Path) -> _Tail | None:
    """The tail file's record, or None: missing, torn (its seal), or of another format."""
    try:
        data = path.read_bytes()
    except OSError:
        return None
    try:
        body = unseal(data, f"tail {path}")
        if body is None:
            return None
        record = msgpack.unpackb(body)
        fmt, stamp, floor, names = record
        if fmt != TAIL_FORMAT or not isinstance(floor, str) or not all(isinstance(n, str) for n in names):
            return None
        return _Tail((int(stamp[0]), int(stamp[1]), int(stamp[2])), floor, sorted(names))
    except (IntegrityError, ValueError, TypeError, IndexError, msgpack.UnpackException):
        return None


def _write_tail(path: Path, tail: _Tail) -> None:
    """Replace the tail file (a cache: not fsynced; a torn one fails its seal and the folder is listed)."""
    path.parent.mkdir(exist_ok=True)
    tmp = path.with_name(f"{TMP}{path.name}.{uuid.uuid4().hex[:8]}")
    try:
        with open(tmp, "xb") as f:
            f.write(seal(msgpack.packb([TAIL_FORMAT, list(tail.stamp), tail.floor, tail.names])))
        os.replace(tmp, path)
    finally:
        if os.path.lexists(tmp):
            os.unlink(tmp)


def _with(names: list[str], name: str) -> list[str]:
    at = bisect.bisect_left(names, name)
    return names if at < len(names) and names[at] == name else [*names[:at], name, *names[at:]]


def _without(names: list[str], name: str) -> list[str]:
    at = bisect.bisect_left(names, name)
    return [*names[:at], *names[at + 1:]] if at < len(names) and names[at] == name else names
