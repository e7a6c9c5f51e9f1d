"""Baselines measured in the same run as tiered_ckpt: memcpy, raw disk, torch.save/load, DCP."""
from __future__ import annotations

import os
import shutil
import time
import warnings
from pathlib import Path

import torch

from .measure import drop_cache, median_time

CHUNK = 16 << 20


def memcpy(state: dict[str, torch.Tensor], repeats: int) -> float:
    """One copy of the state into already-touched, pre-allocated buffers."""
    dst = {k: torch.empty_like(v) for k, v in state.items()}
    for k in state:
        dst[k].copy_(state[k])

    def copy() -> None:
        for k, v in state.items():
            dst[k].copy_(v)

    return median_time(copy, repeats)


def _write_file(path: Path, nbytes: int, buf: memoryview) -> None:
    """`nbytes` into a fresh file in 16 MiB os.write calls, then fsync: the raw disk baseline."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    left = nbytes
    while left > 0:
        left -= os.write(fd, buf[: min(CHUNK, left)])
    os.fsync(fd)
    os.close(fd)


def _read_file(path: Path, out: memoryview) -> None:
    with open(path, "rb", buffering=0) as f:
        while f.readinto(out):
            pass


def raw_write_once(directory: Path, nbytes: int) -> float:
    """One sequential write of `nbytes` + fsync, into a fresh file."""
    path = directory / "raw-once.bin"
    path.unlink(missing_ok=True)
    buf = memoryview(os.urandom(CHUNK))
    t = time.perf_counter()
    _write_file(path, nbytes, buf)
    seconds = time.perf_counter() - t
    path.unlink()
    return seconds


def raw_read_once(directory: Path, nbytes: int) -> float:
    """One cold sequential read of an `nbytes` file (written once, then dropped from the page cache)."""
    path = directory / "raw-read.bin"
    if not path.exists() or path.stat().st_size != nbytes:
        _write_file(path, nbytes, memoryview(os.urandom(CHUNK)))
    drop_cache(path)
    out = memoryview(bytearray(CHUNK))
    t = time.perf_counter()
    _read_file(path, out)
    return time.perf_counter() - t


def raw_write_read(directory: Path, nbytes: int, repeats: int) -> tuple[float, float]:
    """Sequential os.write of 16 MiB buffers + fsync; then a cold sequential read of the same file."""
    path = directory / "raw.bin"
    buf = memoryview(os.urandom(CHUNK))

    write_s = median_time(lambda: _write_file(path, nbytes, buf), repeats, setup=lambda: path.unlink(missing_ok=True))
    out = memoryview(bytearray(CHUNK))
    read_s = median_time(lambda: _read_file(path, out), repeats, setup=lambda: drop_cache(path))
    path.unlink()
    return write_s, read_s


def torch_save_load(state: dict[str, torch.Tensor], directory: Path, repeats: int) -> tuple[float, float]:
    path = directory / "torch.pt"

    def save() -> None:
        with open(path, "wb") as f:
            torch.save(state, f)
            f.flush()
            os.fsync(f.fileno())

    save_s = median_time(save, repeats)
    load_s = median_time(lambda: torch.load(path, weights_only=True), repeats, setup=lambda: drop_cache(path))
    path.unlink()
    return save_s, load_s


def dcp_all(state: dict[str, torch.Tensor], directory: Path, repeats: int) -> dict[str, float]:
    """DCP save (thread_count=2), async_save with a reused stager (its fastest options on CPU) and load."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
    from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

    warnings.filterwarnings("ignore", message=".*assuming the intent is to.*single process")
    out: dict[str, float] = {}
    path = directory / "dcp"

    def clear() -> None:
        shutil.rmtree(path, ignore_errors=True)

    out["dcp_save"] = median_time(
        lambda: dcp.save(state, storage_writer=dcp.FileSystemWriter(path, thread_count=2)), repeats, setup=clear)
    target = {k: torch.empty_like(v) for k, v in state.items()}
    out["dcp_load"] = median_time(lambda: dcp.load(target, storage_reader=dcp.FileSystemReader(path)), repeats,
                                  setup=lambda: drop_cache(path))
    stager = DefaultStager(StagingOptions(use_pinned_memory=torch.cuda.is_available(), use_shared_memory=False,
                                          use_async_staging=True, use_non_blocking_copy=torch.cuda.is_available()))
    blocking, staged, total = [], [], []
    for i in range(repeats + 1):  # the first call allocates the stager's buffers: not counted
        clear()
        t = time.perf_counter()
        resp = dcp.async_save(state, storage_writer=dcp.FileSystemWriter(path, thread_count=2), async_stager=stager,
                              async_checkpointer_type=AsyncCheckpointerType.THREAD)
        t_ret = time.perf_counter()
        resp.staging_completion.result()
        t_staged = time.perf_counter()
        resp.upload_completion.result()
        t_done = time.perf_counter()
        if i:
            blocking.append(t_ret - t)
            staged.append(t_staged - t)
            total.append(t_done - t)
    stager.close()
    clear()
    med = lambda xs: sorted(xs)[len(xs) // 2]  # noqa: E731
    out.update(dcp_async_return=med(blocking), dcp_async_staged=med(staged), dcp_async_durable=med(total))
    return out
