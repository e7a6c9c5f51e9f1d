"""Host staging buffers, reused across saves, and the copy of a state's tensors into them.

A buffer is one flat uint8 tensor (pinned when CUDA is present, so device-to-host copies are DMA on a
side stream). Buffers are allocated once, touched once (first-touch page faults cost 4-5x a memcpy), and
then recycled: a save never allocates host memory proportional to the state after the first one.
At most `max_inflight` buffers are in flight; a save that needs one waits for a release, it never drops.

With a memory tier first in the stack (an `Arena`), a buffer is the memory tier's files, mapped
(mapped.py): the staging copy is the tier's copy, committing there is a rename per part, and the buffer
stays with the checkpoint while the tier keeps it. When retention retires that checkpoint, its files (pages
already allocated) come back as the next free buffer. Host memory: about keep_last + max_inflight states.
"""
from __future__ import annotations

import asyncio
import fcntl
import logging
import itertools
import os
import shutil
import socket
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Mapping, Sequence

import torch

from ..distributed.dtensor import local_tensor
from ..errors import ConfigError
from .mapped import MappedParts

log = logging.getLogger(__name__)

if TYPE_CHECKING:  # plan.py uses tensor_bytes from here
    from .plan import Plan


def tensor_bytes(t: torch.Tensor) -> memoryview:
    """A writable byte view of a contiguous CPU tensor's memory (no copy). The view holds a reference to
    the tensor's storage (through a uint8 view and its numpy array), so memory can never be freed under a
    thread that still reads or writes it, e.g. after a timed-out or cancelled read."""
    if t.device.type != "cpu" or not t.is_contiguous():
        raise ValueError("tensor_bytes needs a contiguous CPU tensor")
    return memoryview(t.detach().reshape(-1).view(torch.uint8).numpy()).cast("B")


class StagingBuffer:
    def __init__(self, nbytes: int, pin: bool, parts: MappedParts | None = None):
        self.parts = parts  # the memory tier's files behind this buffer (None: anonymous memory)
        if parts is None:
            self.tensor = torch.empty(max(nbytes, 1), dtype=torch.uint8, pin_memory=pin)
            self.tensor.zero_()  # touch every page now, not during a save
        else:
            self.tensor = parts.tensor  # preallocated and populated by MappedParts
        self.view = tensor_bytes(self.tensor)
        self.pinned = parts.pinned if parts is not None else pin
        self.step: int | None = None  # the memory tier's checkpoint these files hold (retained buffers)
        self.published = False  # the files sit under the memory tier's keys
        self.in_use = False  # a save is reading or writing it (between acquire and release)
        self._views: tuple[tuple, list[torch.Tensor]] | None = None  # (plan key, typed views) of the last plan

    def views_for(self, plan: Plan) -> list[torch.Tensor]:
        """Typed, shaped views of this buffer at the plan's offsets; built once per plan, not per save."""
        if self._views is None or self._views[0] is not plan.key:
            views = [self.tensor[c.offset : c.offset + c.nbytes].view(c.dtype).view(c.shape) for c in plan.local]
            self._views = (plan.key, views)
        return self._views[1]

    @property
    def capacity(self) -> int:
        return self.tensor.numel()


STAGING_DIR = ".staging"  # at the memory tier's root, beside the jobs' folders
LOCK_FILE = ".owner"  # in a process's staging folder, flock-ed while it lives
TAKE_BACK_WAIT = 10.0  # seconds retention waits for a reader of a retired part file before giving the file up


class Arena:
    """Where mapped buffers live on the memory tier (`tier`, a LocalTier driver): free ones in a folder of
    this process (`home`, locked while the process lives), retained ones under the checkpoint's keys."""

    def __init__(self, name: str, tier: Any, home: Path, part_size: int, keep_last: int, job: str):
        self.name = name
        self.tier = tier
        self.home = home
        self.part_size = part_size
        self.keep_last = keep_last
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

    @staticmethod
    def home_for(tier: Any, job: str, session: str, rank: int) -> Path:
        """This process's folder of free buffers (host and pid in the name are for people; liveness is its lock)."""
        return tier.path_of(f"{STAGING_DIR}/{job}-{session}-r{rank}-{socket.gethostname()}-p{os.getpid()}")

    def claim(self) -> None:
        """Create `home` and hold an exclusive flock on its lock file for as long as this process lives: the
        kernel drops it when the process dies, which is how `clean_stale` tells a dead folder (PIDs are
        reused and differ between PID namespaces that share one /dev/shm)."""
        self.home.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.home / LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o644)
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        self._lock_fd = fd

    def release_claim(self) -> None:
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None
        shutil.rmtree(self.home, ignore_errors=True)

    def clean_stale(self, job: str) -> int:
        """Remove the buffer folders of this job's processes that are gone (killed or crashed mid-save: their
        staging files hold a state's worth of RAM): those whose lock file nobody holds. Returns bytes freed."""
        freed = 0
        for folder in self.home.parent.glob(f"{job}-*"):
            if folder == self.home or not folder.is_dir():
                continue
            try:
                fd = os.open(folder / LOCK_FILE, os.O_RDWR)
            except FileNotFoundError:
                continue  # not (yet) claimed: a process between mkdir and its lock
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                continue  # its process is alive
            else:
                freed += sum(_size(f) for f in folder.rglob("*") if f.is_file())
                shutil.rmtree(folder, ignore_errors=True)
            finally:
                os.close(fd)
        return freed

    def new(self, nbytes: int, pin: bool) -> StagingBuffer:
        self.start()
        folder = self.home / f"buf-{next(self._ids)}"
        return StagingBuffer(nbytes, pin, MappedParts(folder, nbytes, self.part_size, pin=pin))

    def publish(self, buf: StagingBuffer, keys: list[str]) -> None:
        """The parts become the tier's values under `keys` (a rename each; no byte is copied)."""
        assert buf.parts is not None and not buf.published
        self.tier.account(buf.parts.nbytes, f"staged parts of {keys[0] if keys else 'an empty save'}")
        try:
            buf.parts.move([self.tier.path_of(k) for k in keys])
        except BaseException:
            self.tier.account(-buf.parts.nbytes, "staged parts not published")
            raise
        buf.published = True

    def take_back(self, buf: StagingBuffer) -> bool:
        """Move published part files home (the tier no longer holds that checkpoint); False when the buffer
        cannot be reused: its files are gone (the tier deleted them: a failed save's cleanup, a deletion by
        another process), or a reader kept one locked past TAKE_BACK_WAIT seconds (then they are unlinked,
        and the reader keeps its mapping of the old file)."""
        assert buf.parts is not None
        try:
            if not buf.parts.intact():
                raise FileNotFoundError("a part file is gone")
            if buf.published:
                buf.parts.move([buf.parts.home / p.name for p in buf.parts.paths], exclusive=True,
                               wait=TAKE_BACK_WAIT)
        except (OSError, TimeoutError):
            if buf.published:
                buf.published = False
                self.tier.account(-sum(_size(p) for p in buf.parts.paths), "retired staged parts")
            buf.parts.unlink()
            return False
        if buf.published:
            buf.published = False
            self.tier.account(-buf.parts.nbytes, "retired staged parts")
        return True


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError:
        return 0


class StagingPool:
    def __init__(self, max_inflight: int, *, pin: bool | None = None, arena: Arena | None = None):
        self.max_inflight = max_inflight
        self.pin = torch.cuda.is_available() if pin is None else pin
        self.arena = arena
        self._free: list[StagingBuffer] = []
        self._count = 0  # buffers in flight or free (retained ones do not count)
        self._retained: dict[int, StagingBuffer] = {}  # step → the buffer whose files hold it on the memory tier
        self._cond = asyncio.Condition()

    @property
    def exhausted(self) -> bool:
        return not self._free and self._count >= self.max_inflight

    async def acquire(self, nbytes: int) -> StagingBuffer:
        await self._drop_vanished()
        async with self._cond:
            await self._cond.wait_for(lambda: self._free or self._count < self.max_inflight)
            buf = next((b for b in self._free if b.capacity >= nbytes and (b.parts is None or
                                                                            b.parts.nbytes == nbytes)), None)
            if buf is not None:
                self._free.remove(buf)
                buf.in_use = True
                return buf
            stale = self._free.pop() if self._free else None  # another size (the state changed): replace it
            if stale is None:
                self._count += 1
        try:
            if stale is not None:
                await self._discard(stale)
            buf = await asyncio.to_thread(self._new, nbytes)
            buf.in_use = True
            return buf
        except BaseException:
            async with self._cond:
                self._count -= 1
                self._cond.notify()
            raise

    def _new(self, nbytes: int) -> StagingBuffer:
        if self.arena is not None:
            self._check_fits(nbytes)
            try:
                return self.arena.new(nbytes, self.pin)
            except OSError as e:  # e.g. tmpfs full: the save still goes on, staged in anonymous memory
                log.warning("cannot stage in the memory tier's files (%s); staging in anonymous memory, and the "
                            "memory tier gets its own copy", e)
        return StagingBuffer(nbytes, self.pin)

    async def release(self, buf: StagingBuffer) -> None:
        """A save is done with `buf` (a retained buffer stays with its checkpoint until `reclaim`)."""
        buf.in_use = False
        if buf.step is not None:
            if buf.step not in self._retained:  # retired while its save still read it: free it now
                await self._take_home(buf, counted=False)
            return
        await self._take_home(buf, counted=True)

    async def retain(self, buf: StagingBuffer, step: int) -> None:
        """`buf`'s files now hold checkpoint `step` on the memory tier: it stays with it, and no longer counts
        against max_inflight (the next save may take another buffer). Saves still writing other tiers keep
        reading it; retention never retires a step that a save is writing."""
        async with self._cond:
            if buf.step is None:
                buf.step = step
                self._retained[step] = buf
                self._count -= 1
                self._cond.notify()

    async def reclaim(self, tier: str, step: int) -> None:
        """Retention retires `step` from `tier`: if a buffer holds it, its files come home as a free buffer."""
        if self.arena is None or tier != self.arena.name or step not in self._retained:
            return
        buf = self._retained.pop(step)
        if not buf.in_use:  # else its save frees it at release
            await self._take_home(buf, counted=False)

    async def _take_home(self, buf: StagingBuffer, *, counted: bool) -> None:
        """`buf` is free again: kept for the next save while fewer than max_inflight buffers exist, else
        dropped (a burst must not leave buffers behind). `counted`: it still counts in `_count`."""
        reusable = True
        try:
            if buf.parts is not None and self.arena is not None:
                reusable = await asyncio.to_thread(self.arena.take_back, buf)
        except Exception as e:
            log.warning("a staging buffer could not be taken back (%s); it is dropped", e)
            reusable = False
        finally:
            buf.step = None
            async with self._cond:
                keep = reusable and (self._count - counted) < self.max_inflight
                if keep:
                    self._free.append(buf)
                    self._count += not counted
                else:
                    self._count -= counted
                self._cond.notify()
        if not keep:
            await self._discard(buf)

    async def _drop_vanished(self) -> None:
        """Retained buffers whose files someone else deleted (e.g. `tiered-ckpt delete` in another process):
        their memory stays mapped until dropped here."""
        gone = [step for step, buf in self._retained.items()
                if not buf.in_use and buf.parts is not None and not buf.parts.intact()]
        for step in gone:
            buf = self._retained.pop(step)
            buf.step = None
            await self._discard(buf)

    def _check_fits(self, nbytes: int) -> None:
        assert self.arena is not None
        capacity = self.arena.tier.options.capacity
        # keep_last checkpoints, the one retention retires only after the next commits, and those in flight
        need = (self.arena.keep_last + 1 + self.max_inflight) * nbytes
        if capacity is not None and need > capacity:
            raise ConfigError(f"the memory tier holds keep_last + 1 + max_inflight = {self.arena.keep_last} + 1 + "
                              f"{self.max_inflight} states of {nbytes} bytes ({need} bytes) but its capacity is "
                              f"{capacity}: raise capacity, or lower keep_last or max_inflight",
                              key=f"tiers.{self.arena.name}.capacity")

    async def _discard(self, buf: StagingBuffer) -> None:
        """Drop a buffer: its files (if not the tier's) go, and its memory is unmapped, in a thread (hundreds of
        ms for a large state)."""
        await asyncio.to_thread(_drop, buf)

    async def clear(self) -> None:
        free, self._free = self._free, []
        for buf in free:
            await self._discard(buf)
        self._retained.clear()  # their files stay: they are the memory tier's checkpoints
        self._count = 0
        if self.arena is not None:
            await asyncio.to_thread(self.arena.release_claim)

    @property
    def held_bytes(self) -> int:
        return sum(b.capacity for b in self._free)


def _drop(buf: StagingBuffer) -> None:
    if buf.parts is not None and not buf.published:
        buf.parts.unlink()
    buf.parts = None
    buf.tensor = buf.view = None  # type: ignore[assignment]  # the last references: unmapped here
    buf._views = None


def producer_events(tensors: Sequence[torch.Tensor] | None = None) -> dict[torch.device, Any]:
    """For each CUDA device that `tensors` live on (None: the current device), an event recorded now on the
    calling thread's current stream: the point after which the tensors hold the values to save. Staging
    copies wait for it, so a copy can never read a tensor before a pending kernel (the optimizer step, the
    forward) has written it. Record it in the thread that runs the training step. Empty without CUDA."""
    if not torch.cuda.is_available():
        return {}
    if tensors is None:
        devices = {torch.device("cuda", torch.cuda.current_device())}
    else:
        devices = {local_tensor(t).device for t in tensors if local_tensor(t).is_cuda}
    return {d: torch.cuda.current_stream(d).record_event() for d in devices}


def stream_steps(devices: Sequence[torch.device | None], events: Mapping[torch.device, Any]) -> list[tuple[Any, ...]]:
    """The order of operations that copies sources on `devices` (None for a CPU source) to host memory:
    for each CUDA device, a side stream that first waits for the producer (its event, or else the current
    stream of the copying thread), then the copies (CUDA ones on their device's side stream), then every
    side stream synchronized, so the buffer holds the data when staging returns. Kept apart from the CUDA
    calls so that a CPU test can check the ordering."""
    cuda_devices = sorted({d for d in devices if d is not None}, key=str)
    steps: list[tuple[Any, ...]] = []
    for d in cuda_devices:
        steps.append(("stream", d))
        steps.append(("wait_event", d, events[d]) if d in events else ("wait_stream", d))
    steps += [("copy", i, d) for i, d in enumerate(devices)]
    steps += [("synchronize", d) for d in cuda_devices]
    return steps


def stage(plan: Plan, tensors: Sequence[torch.Tensor], buf: StagingBuffer,
          events: Mapping[torch.device, Any] | None = None, staged_up_to: Callable[[int], None] | None = None) -> None:
    """Copy this rank's boxes into `buf` at the plan's offsets. Runs in a worker thread (copy_ drops the
    GIL). CUDA tensors are copied on side streams ordered after `events` (see stream_steps).
    `staged_up_to(n)`: the first n bytes of the buffer hold their final bytes (called as CPU copies progress,
    so parts can be checksummed while later ones are still being copied; once more at the end)."""
    in_order = all(a.offset <= b.offset for a, b in zip(plan.local, plan.local[1:]))
    report = staged_up_to if in_order else None
    sources = []
    for c in plan.local:
        src = local_tensor(tensors[c.index])
        sources.append(src if c.dim0 is None else src.narrow(0, *c.dim0))
    views = buf.views_for(plan)
    streams: dict[torch.device, Any] = {}
    with torch.no_grad():
        for step in stream_steps([s.device if s.is_cuda else None for s in sources], events or {}):
            op, *args = step
            if op == "stream":
                streams[args[0]] = torch.cuda.Stream(device=args[0])
            elif op == "wait_event":
                streams[args[0]].wait_event(args[1])
            elif op == "wait_stream":
                streams[args[0]].wait_stream(torch.cuda.current_stream(args[0]))
            elif op == "copy":
                index, device = args
                src, dst = sources[index], views[index]
                if device is None:
                    dst.copy_(src)
                    if report is not None and not streams:
                        report(plan.local[index].offset + plan.local[index].nbytes)
                else:
                    with torch.cuda.stream(streams[device]):
                        dst.copy_(src, non_blocking=True)
            else:  # synchronize
                streams[args[0]].synchronize()
    if staged_up_to is not None:
        staged_up_to(buf.view.nbytes)
