"""One adapter per library that `tiered-ckpt bench --peers` compares, each used the way its documentation
shows. An adapter's `save` returns when the caller may modify the tensors again (blocked time), with a
`Pending` that says when the checkpoint was durable on disk; `load_cold` restores into the caller's
tensors (copying where a library returns new ones, as `load_state_dict` would)."""
from __future__ import annotations

import asyncio
import os
import shutil
import threading
import time
import warnings
from pathlib import Path
from typing import Any, Callable

import torch

from .measure import engine_config, fsync_tree

State = dict[str, torch.Tensor]
RAW = "raw"  # not a library: memcpy, write + fsync and cold read of the same bytes


class Pending:
    """A save that has let go of the tensors; `durable()` says when it was durable on disk."""

    def __init__(self, started: float):
        self.started = started
        self.at = time.perf_counter()  # a blocking save: durable when it returned

    async def durable(self) -> float:
        """Seconds from the save call until the checkpoint was durable on disk."""
        return self.at - self.started


class Watched(Pending):
    """A thread waits for the library's own completion signal, then fsyncs the checkpoint's files and folders
    (a no-op where the library already did) and stamps the time, so that the caller's work meanwhile (the
    in-place change of every tensor) does not delay the stamp."""

    def __init__(self, started: float, wait: Callable[[], object], folder: Path):
        super().__init__(started)
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, args=(wait, folder), daemon=True)
        self._thread.start()

    def _run(self, wait: Callable[[], object], folder: Path) -> None:
        try:
            wait()
            fsync_tree(folder)
            self.at = time.perf_counter()
        except BaseException as e:  # noqa: BLE001 - re-raised by durable()
            self._error = e

    async def durable(self) -> float:
        await asyncio.to_thread(self._thread.join)
        if self._error is not None:
            raise self._error
        return self.at - self.started


def copy_into(state: State, loaded: dict[str, Any]) -> None:
    """What `load_state_dict` does with tensors a library returned: copy them into the live ones."""
    missing = set(state) - set(loaded)
    if missing:
        raise AssertionError(f"the load returned no value for {sorted(missing)[:3]}")
    for key, tensor in state.items():
        if loaded[key] is not tensor:
            tensor.copy_(loaded[key])


def _wait_for_file(path: Path, text: str, timeout: float = 1800.0) -> None:
    deadline = time.monotonic() + timeout
    while not (path.exists() and path.read_text().strip() == text):
        if time.monotonic() > deadline:
            raise TimeoutError(f"{path} never said {text!r}")
        time.sleep(0.002)


class Library:
    """The common shape: `folder` is this library's own directory (its cache is dropped before the cold load)."""

    name = ""
    fsyncs_itself = True  # False: the harness's fsync after the library's completion is part of `durable`
    loads_from_memory = False

    def __init__(self, folder: Path, shm: Path, nbytes: int):
        self.folder, self.shm, self.nbytes = folder, shm, nbytes
        self.returned: float | None = None  # set where the call returns before the tensors may change

    async def open(self) -> None:
        pass

    async def prepare(self, state: State) -> bool:
        """Set-up a library offers before the first save (untimed in the saves; reported on its own): whether
        there was any."""
        return False

    async def save(self, step: int, state: State, started: float) -> Pending:
        raise NotImplementedError

    async def load_cold(self, step: int, state: State) -> None:
        raise NotImplementedError

    async def load_memory(self, step: int, state: State) -> None:
        raise NotImplementedError

    async def close(self) -> None:
        pass

    @staticmethod
    def clean_after(pid: int) -> None:
        """Remove what this library leaves outside its folder when the process `pid` was killed."""

    def step_folder(self, step: int) -> Path:
        return self.folder / f"step-{step}"


class TorchSave(Library):
    """`torch.save` into a file, flush and fsync: blocked until durable."""

    name = "torch.save"

    async def save(self, step: int, state: State, started: float) -> Pending:
        self.step_folder(step).mkdir(parents=True)
        with open(self.step_folder(step) / "state.pt", "wb") as f:
            torch.save(state, f)
            f.flush()
            os.fsync(f.fileno())
        fsync_tree(self.step_folder(step))
        return Pending(started)

    async def load_cold(self, step: int, state: State) -> None:
        copy_into(state, torch.load(self.step_folder(step) / "state.pt", map_location="cpu", weights_only=True))


class DcpAsync(Library):
    """`torch.distributed.checkpoint.async_save` with one `DefaultStager` reused across calls (its fastest
    options on CPU), a thread executor and `FileSystemWriter(thread_count=2)`; DCP fsyncs its files."""

    name = "DCP async_save"

    async def open(self) -> None:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
        from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

        warnings.filterwarnings("ignore", message=".*assuming the intent is to.*single process")
        self.dcp, self.thread = dcp, AsyncCheckpointerType.THREAD
        self.stager = DefaultStager(StagingOptions(False, False, True, False))

    async def save(self, step: int, state: State, started: float) -> Pending:
        writer = self.dcp.FileSystemWriter(self.step_folder(step), thread_count=2)
        response = self.dcp.async_save(state, storage_writer=writer, async_stager=self.stager,
                                       async_checkpointer_type=self.thread)
        self.returned = time.perf_counter() - started
        response.staging_completion.result()  # until then the tensors may not change
        return Watched(started, response.upload_completion.result, self.step_folder(step))

    async def load_cold(self, step: int, state: State) -> None:
        self.dcp.load(state, storage_reader=self.dcp.FileSystemReader(self.step_folder(step)))

    async def close(self) -> None:
        self.stager.close()


class TorchCheckpointing(Library):
    """PyTorch's `torch_checkpointing.CheckpointManager` (asynchronous: stages in a thread, writes from a
    subprocess). The caller may change the tensors once `manager.lock()` can be taken. It writes through the
    page cache without fsync; `use_direct_io=False` because its O_DIRECT writes fail on ext4 here."""

    name = "torch_checkpointing"
    fsyncs_itself = False

    async def open(self) -> None:
        from torch_checkpointing import CheckpointManager
        from torch_checkpointing.storage.filesystem import LocalFileSystemStorageConfig

        self.folder.mkdir(parents=True, exist_ok=True)
        storage = LocalFileSystemStorageConfig(use_direct_io=False)
        self.manager = CheckpointManager(CheckpointManager.Config(storage_config=storage))

    async def save(self, step: int, state: State, started: float) -> Pending:
        write = self.manager.save(str(self.step_folder(step)), {"model": state})
        self.returned = time.perf_counter() - started
        with self.manager.lock():  # what the library asks around an in-place update such as optimizer.step()
            pass
        assert write is not None
        return Watched(started, write.result, self.step_folder(step))

    async def load_cold(self, step: int, state: State) -> None:
        loaded = self.manager.load(str(self.step_folder(step)), into={"model": state})
        copy_into(state, loaded["model"])

    async def close(self) -> None:
        self.manager.close()


class TorchSnapshot(Library):
    """torchsnapshot's `Snapshot.async_take` (returns once CPU tensors are copied; `wait()` writes the
    metadata). It writes without fsync. Its calls run their own event loop, which cannot start inside this
    process's running one: they are called from a worker thread (the caller waits for them all the same)."""

    name = "torchsnapshot async_take"
    fsyncs_itself = False

    async def open(self) -> None:
        warnings.filterwarnings("ignore", message="TypedStorage is deprecated")
        from torchsnapshot import Snapshot, StateDict

        self.snapshot, self.wrap = Snapshot, StateDict

    async def save(self, step: int, state: State, started: float) -> Pending:
        pending = await asyncio.to_thread(self.snapshot.async_take, str(self.step_folder(step)),
                                          {"model": self.wrap(state)})
        return Watched(started, pending.wait, self.step_folder(step))

    async def load_cold(self, step: int, state: State) -> None:
        target = self.wrap(state)
        await asyncio.to_thread(self.snapshot(str(self.step_folder(step))).restore, {"model": target})
        copy_into(state, dict(target))


class TorchSnapshotTake(TorchSnapshot):
    """torchsnapshot's blocking `Snapshot.take`."""

    name = "torchsnapshot take"

    async def save(self, step: int, state: State, started: float) -> Pending:
        await asyncio.to_thread(self.snapshot.take, str(self.step_folder(step)), {"model": self.wrap(state)})
        return Watched(started, lambda: None, self.step_folder(step))  # blocked: the take; durable: + the fsync


class Dlrover(Library):
    """dlrover's flash checkpoint (`DdpCheckpointer`), without dlrover-run: it starts its own saver process,
    `save_checkpoint(storage_type=DISK)` copies into shared memory and returns, the saver writes with
    `torch.save` (no fsync) and then names the step in `dlrover_latest.txt`. Its disk load is `torch.load`
    of that file (what its `load_checkpoint` does when shared memory holds nothing); `load_checkpoint()`
    with the shared memory alive is its load from host memory."""

    name = "dlrover flash checkpoint"
    fsyncs_itself = False
    loads_from_memory = True

    async def open(self) -> None:
        # dlrover names its shared memory and sockets after this variable: one of our own, removed at close
        self.job = os.environ["TORCHELASTIC_RUN_ID"] = self._job(os.getpid())
        from dlrover.trainer.torch.flash_checkpoint.ddp import DdpCheckpointer, StorageType

        self.folder.mkdir(parents=True, exist_ok=True)
        self.checkpointer, self.disk = DdpCheckpointer(str(self.folder)), StorageType.DISK

    def _file(self, step: int) -> Path:
        return self.folder / str(step) / "rank_0.pt"

    async def save(self, step: int, state: State, started: float) -> Pending:
        self.checkpointer.save_checkpoint(step, state, str(self._file(step)), storage_type=self.disk)

        def wait() -> None:
            _wait_for_file(self.folder / "dlrover_latest.txt", str(step))

        return Watched(started, wait, self.folder / str(step))

    async def load_cold(self, step: int, state: State) -> None:
        copy_into(state, torch.load(self._file(step), map_location="cpu", weights_only=True))

    async def load_memory(self, step: int, state: State) -> None:
        copy_into(state, self.checkpointer.load_checkpoint())

    async def close(self) -> None:
        self.clean_after(os.getpid())

    @staticmethod
    def _job(pid: int) -> str:
        return f"tiered-ckpt-bench-{pid}"

    @staticmethod
    def clean_after(pid: int) -> None:
        job = Dlrover._job(pid)
        Path("/dev/shm", f"{job}_ckpt_shm_0").unlink(missing_ok=True)
        shutil.rmtree(Path("/tmp/ckpt_sock", job), ignore_errors=True)


class TieredCkpt(Library):
    """tiered_ckpt with a memory tier (its files are the staging buffer) and a disk tier, the embedded file
    index, `part_size = 64MiB`, `max_inflight = 1`, `keep_last = 1`: the configuration of `tiered-ckpt
    bench`. `await engine.save()` returns once staged; durable on disk is the disk tier's commit."""

    name = "tiered_ckpt"
    loads_from_memory = True

    async def open(self) -> None:
        from .. import Engine

        self.engine = Engine(engine_config(self.folder, self.shm, 64 << 20, self.nbytes))
        await self.engine.__aenter__()

    async def save(self, step: int, state: State, started: float) -> Pending:
        return DiskCommit(started, await self.engine.save(step, state))

    async def _load(self, step: int, state: State, tier: str) -> None:
        info = await self.engine.load(state, tiers=[tier])
        if info.step != step or info.tier != tier or info.fallbacks:
            raise AssertionError(f"loaded step {info.step} from {info.tier} (fallbacks {info.fallbacks}), "
                                 f"not step {step} from {tier}")

    async def load_cold(self, step: int, state: State) -> None:
        await self._load(step, state, "disk")

    async def load_memory(self, step: int, state: State) -> None:
        await self._load(step, state, "host")

    async def close(self) -> None:
        await self.engine.__aexit__(None, None, None)


class TieredCkptReserved(TieredCkpt):
    """The same, with `engine.reserve(state)` at set-up: every staging buffer made before the first save."""

    name = "tiered_ckpt+reserve"

    async def prepare(self, state: State) -> bool:
        await self.engine.reserve(state)
        return True


class DiskCommit(Pending):
    """tiered_ckpt stamps each tier's commit itself (seconds from when the handle was made, inside `save()`)."""

    def __init__(self, started: float, handle: Any):
        super().__init__(started)
        self.handle = handle

    async def durable(self) -> float:
        await self.handle.wait("disk")
        return self.handle.started + self.handle.durable_at["disk"] - self.started


LIBRARIES: dict[str, type[Library]] = {
    "torch_save": TorchSave, "dcp_async": DcpAsync, "torch_checkpointing": TorchCheckpointing,
    "torchsnapshot_async": TorchSnapshot, "torchsnapshot_take": TorchSnapshotTake, "dlrover": Dlrover,
    "tiered_ckpt": TieredCkpt, "tiered_ckpt_reserved": TieredCkptReserved}
