"""Contiguous host memory backed by one file per part on a tmpfs: the memory tier's copy of a checkpoint
that is also the staging buffer a save copies into.

A save stages a rank's packed stream into one flat buffer; the memory tier stores it as one file per part.
Mapping each part file at its offset inside one reserved address range (`mmap` with MAP_FIXED) gives both
at once: the staging copy writes the tier's pages, and committing to the memory tier is a rename per part.
Files are preallocated (`fallocate`) and the mapping populated up front, so no save pays tmpfs page
allocation or page faults once the buffer exists. Linux only (MAP_FIXED, MAP_POPULATE); elsewhere, and
for part sizes that are not a multiple of the page size, the engine stages into anonymous memory.
"""
from __future__ import annotations

import ctypes
import fcntl
import functools
import mmap
import os
import sys
import time
import weakref
from pathlib import Path

import torch

PAGE = mmap.PAGESIZE
_PROT_NONE, _PROT_RW = 0, mmap.PROT_READ | mmap.PROT_WRITE
_MAP_SHARED, _MAP_PRIVATE, _MAP_FIXED, _MAP_ANONYMOUS, _MAP_NORESERVE, _MAP_POPULATE = (
    0x01, 0x02, 0x10, 0x20, 0x4000, 0x8000)


def supported(part_size: int) -> bool:
    return sys.platform == "linux" and part_size % PAGE == 0


@functools.cache
def _libc() -> ctypes.CDLL:
    """libc, loaded once: each CDLL makes its own function-pointer classes, reference cycles that a buffer made
    per save would leave for the collector (about 120 objects each)."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    return libc


def _lock_exclusive(fd: int, path: Path, wait: float) -> None:
    deadline = time.monotonic() + wait
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return
        except BlockingIOError:
            if time.monotonic() > deadline:
                raise TimeoutError(f"{path} stayed locked by a reader for {wait}s") from None
            time.sleep(0.005)


def _round_up(n: int) -> int:
    return -(-n // PAGE) * PAGE


def _register(address: int, length: int) -> bool:
    status = torch.cuda.cudart().cudaHostRegister(address, length, 0)
    if int(getattr(status, "value", status)) != 0:
        clear_cuda_error()
        return False
    return True


def clear_cuda_error() -> None:
    """Take a failed CUDA runtime call's error off this thread: left there, the next kernel launch's check
    reports it as its own. torch binds no cudaGetLastError, so it is called in the CUDA runtime library the
    process has loaded (found in /proc/self/maps)."""
    clear = getattr(torch.cuda.cudart(), "cudaGetLastError", None)
    if clear is None:
        library = _loaded_cudart()
        clear = library.cudaGetLastError if library is not None else None
    if clear is not None:
        clear()


def _loaded_cudart() -> ctypes.CDLL | None:
    try:
        with open("/proc/self/maps") as maps:
            paths = [line.split()[-1] for line in maps if "libcudart" in line]
    except OSError:
        return None
    return ctypes.CDLL(paths[0]) if paths else None


def _unmap(libc: ctypes.CDLL, address: int, length: int, pinned: bool) -> None:
    if pinned:
        torch.cuda.cudart().cudaHostUnregister(address)
    libc.munmap(address, length)


class MappedParts:
    """`nbytes` of contiguous memory (`tensor`, flat uint8) whose part p lives in file `paths[p]`.

    The mapping outlives renames of the files (it refers to their inodes), so `move` publishes the parts
    under the tier's keys, or takes them back, without touching their bytes. The memory is unmapped when the
    last reference to `tensor` (and any view of it) is gone."""

    def __init__(self, folder: Path, nbytes: int, part_size: int, *, pin: bool = False):
        if not supported(part_size):
            raise ValueError(f"part_size {part_size} is not a multiple of the page size {PAGE}")
        libc = _libc()
        folder.mkdir(parents=True, exist_ok=True)
        self.home = folder
        self.nbytes = nbytes
        self.part_size = part_size
        self.paths: list[Path] = []
        self._identity: list[tuple[int, int, int]] = []  # per part file: device, inode, length as mapped
        lengths = [min(part_size, nbytes - start) for start in range(0, nbytes, part_size)]
        span = max(_round_up(nbytes), PAGE)
        base = libc.mmap(None, span, _PROT_NONE, _MAP_PRIVATE | _MAP_ANONYMOUS | _MAP_NORESERVE, -1, 0)
        if base in (None, ctypes.c_void_p(-1).value):
            raise OSError(ctypes.get_errno(), f"cannot reserve {span} bytes of address space")
        try:
            for p, length in enumerate(lengths):
                path = folder / f"part-{p:06d}"
                fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
                try:
                    os.ftruncate(fd, length)
                    st = os.fstat(fd)
                    self._identity.append((st.st_dev, st.st_ino, length))
                    if length:
                        os.posix_fallocate(fd, 0, length)  # tmpfs pages now, not under the first save
                        address = base + p * part_size
                        got = libc.mmap(address, _round_up(length), _PROT_RW, _MAP_SHARED | _MAP_FIXED | _MAP_POPULATE,
                                        fd, 0)
                        if got != address:
                            raise OSError(ctypes.get_errno(), f"cannot map {path}")
                finally:
                    os.close(fd)
                self.paths.append(path)
        except BaseException:
            libc.munmap(base, span)
            for path in self.paths:
                path.unlink(missing_ok=True)
            raise
        if pin:  # D2H copies are DMA straight into the tier; if CUDA refuses, the buffer works unpinned
            pin = _register(base, span)
        memory = (ctypes.c_ubyte * max(nbytes, 1)).from_address(base)
        weakref.finalize(memory, _unmap, libc, base, span, pin)
        self.tensor = torch.frombuffer(memory, dtype=torch.uint8)
        self.pinned = pin

    def move(self, targets: list[Path], *, exclusive: bool = False, wait: float = 10.0) -> None:
        """Rename the part files to `targets` (same file system), creating their folders. `exclusive`: each
        under an exclusive flock, which waits (up to `wait` seconds, then TimeoutError) for readers that map
        the file in place (they hold a shared one while they verify and copy it; see tiers/memory.py), so
        none of them sees it rewritten."""
        for folder in {t.parent for t in targets}:
            folder.mkdir(parents=True, exist_ok=True)
        for p, target in enumerate(targets):
            fd = os.open(self.paths[p], os.O_RDONLY) if exclusive else -1
            try:
                if exclusive:
                    _lock_exclusive(fd, self.paths[p], wait)
                os.replace(self.paths[p], target)
            finally:
                if fd >= 0:
                    os.close(fd)
            self.paths[p] = target

    def intact(self) -> bool:
        """Every part file is still the one mapped, whole, where this buffer last put it: nobody deleted,
        truncated or replaced it meanwhile. Writing into a mapping of a file truncated under it kills the
        process (SIGBUS), so a buffer that is not intact is never staged into again, only dropped."""
        for path, (device, inode, length) in zip(self.paths, self._identity):
            try:
                st = os.stat(path)
            except OSError:
                return False
            if (st.st_dev, st.st_ino) != (device, inode) or st.st_size != length:
                return False
        return True

    def unlink(self) -> None:
        for path in self.paths:
            path.unlink(missing_ok=True)
