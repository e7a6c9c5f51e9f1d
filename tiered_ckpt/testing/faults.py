"""`faulty`: a tier of files on this machine, as `local`, that fails, stalls, fills up, corrupts or loses values on
command: the test double the fault tests use instead of patching a driver's or the engine's internals, and a way
to drill a job's handling of a bad tier.

    [[tiers]]
    name = "disk"
    kind = "faulty"
    path = "/tmp/ckpt/disk"
    control = "/tmp/ckpt/faults.json"     # the active faults; absent: none

    FaultControl("/tmp/ckpt/faults.json").inject("full")       # every process's writes now raise TierFull
    FaultControl("/tmp/ckpt/faults.json").clear()              # no faults (stalls in progress end)

The control file is replaced whole (a temp file renamed over it), so every process that shares it (torchrun's
ranks, emulated nodes) reads either the old faults or the new ones; a driver parses it again only when it changed
(one stat per operation).
"""
from __future__ import annotations

import asyncio
import contextlib
import fcntl
import json
import math
import os
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

from ..errors import ConfigError, TierError, TierFull, TierUnavailable
from ..storage.tiers.base import machine_name
from ..storage.tiers.local import LocalOptions, LocalTier

MODES = ("fail", "error", "stall", "full", "corrupt", "vanish")
OPS = ("write", "read", "delete", "list", "missing", "probe", "usage", "debris")
# the operations a mode acts on (the others act on any): a read cannot be full, nor a write corrupt
MODE_OPS = {"full": ("write", "probe"), "corrupt": ("read",), "vanish": ("write",)}
# a writer's probe writes and removes <job>/.probe-<session>-r<rank> (layout.probe_key): the op "probe", so that
# faults on "write" hit a save's values, not the check at the writer's start (which would then fail or wait)
PROBE = "/.probe-"
STALL_POLL = 0.02  # seconds between looks at the control file while a stall waits to be cleared


@dataclass(frozen=True)
class Fault:
    """One active fault, as the control file holds it (FaultControl.inject's arguments, and an id)."""

    id: str
    mode: str
    ops: tuple[str, ...]
    hosts: tuple[str, ...] | None = None
    ranks: tuple[int, ...] | None = None
    keys: str | None = None
    seconds: float | None = None
    count: int | None = None

    def acts_on(self, op: str) -> bool:
        return (op in self.ops or "*" in self.ops) and op in MODE_OPS.get(self.mode, OPS)


class FaultControl:
    """The faults of every `faulty` tier whose `control` is `path`, in every process that shares the file."""

    def __init__(self, path: str | os.PathLike[str]):
        self.path = Path(path)

    def inject(self, mode: str, *, ops: Sequence[str] = ("write",), hosts: Sequence[str] | None = None,
               ranks: Sequence[int] | None = None, keys: str | None = None, seconds: float | None = None,
               count: int | None = None) -> None:
        """Add a fault: `mode` on the operations `ops` ("*": all), only on machines named in `hosts` (the engine's
        name of a machine: TIERED_CKPT_HOST, else the host name), for ranks in `ranks`, on keys holding `keys`,
        for the first `count` matching operations of each process. `seconds`: a stall's length (None: until
        cleared)."""
        fault = _checked(mode, ops, hosts, ranks, keys, seconds, count)
        with self._locked():
            self._write([*self.faults(), fault])

    def clear(self) -> None:
        """No faults: every stall in progress ends, every later operation runs as on a `local` tier."""
        with self._locked():
            self._write([])

    def stalled(self) -> int:
        """Operations stalled right now, in every live process that shares the control file: what a test waits
        for before it acts on a save held in flight (a kill, a failover, a gc beside it)."""
        try:
            names = os.listdir(_stalls(self.path))
        except FileNotFoundError:
            return 0
        return sum(_alive(int(name.split("-", 1)[0])) for name in names)

    def faults(self) -> list[Fault]:
        """The active faults (none while the file does not exist)."""
        try:
            text = self.path.read_text()
        except FileNotFoundError:
            return []
        return _parse(text, self.path)

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        """One read-modify-write at a time (two processes injecting at once each keep the other's fault)."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path.with_name(self.path.name + ".lock"), os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)

    def _write(self, faults: list[Fault]) -> None:
        """Replace the file whole, its mtime past the old one's: drivers notice a change by (inode, mtime, size),
        and a file's mtime ticks coarsely (a jiffy) while a freed inode number comes back soon."""
        try:
            old = os.stat(self.path).st_mtime_ns
        except FileNotFoundError:
            old = 0
        tmp = self.path.with_name(f".{self.path.name}.{uuid.uuid4().hex[:8]}")
        tmp.write_text(json.dumps({"faults": [_as_dict(f) for f in faults]}, indent=1))
        stamp = max(time.time_ns(), old + 1)
        os.utime(tmp, ns=(stamp, stamp))
        os.replace(tmp, self.path)


@dataclass(frozen=True)
class FaultyOptions(LocalOptions):
    """The `local` tier's keys, and `control`: the file of active faults (absent: none)."""

    control: str = field(kw_only=True)


class FaultyTier(LocalTier):
    """A `local` tier that consults its control file before every operation: it may raise (fail: TierUnavailable,
    retried by the pipeline; error: TierError, not retried; full: TierFull), wait (stall, on the event loop, never
    blocking it), return the stored bytes with one byte flipped (corrupt), or remove a value right after writing it
    (vanish: reads then raise TierNotFound and missing() names it)."""

    Options = FaultyOptions

    @classmethod
    def check_options(cls, name: str, options: FaultyOptions) -> None:  # type: ignore[override]
        super().check_options(name, options)
        if not options.control.strip():
            raise ConfigError("must name the file of faults (FaultControl's path)", key=f"tiers.{name}.control")

    def __init__(self, name: str, options: FaultyOptions):
        super().__init__(name, options)
        self._control = _ControlFile(Path(options.control))
        self._rank = 0

    def bind(self, *, rank: int, world_size: int, node: int, num_nodes: int) -> None:
        self._rank = rank

    # -- the contract, each operation behind the faults that apply to it --------------------------------------
    async def write(self, key: str, data: memoryview) -> None:
        op = "probe" if PROBE in key else "write"
        after = await self._before(op, [key])
        await super().write(key, data)
        if any(f.mode == "vanish" for f in after):  # acknowledged, then gone: an evicting cache, a cleaner of /dev/shm
            self._add_used(-await self.run_blocking(_remove_file, self._path(key)))

    async def read_into(self, key: str, out: Sequence[memoryview]) -> int:
        after = await self._before("read", [key])
        n = await super().read_into(key, out)
        if _corrupts(after) and n == sum(len(b) for b in out) and n:
            _flip_in(out, n // 2)
        return n

    async def read_chunks(self, key: str, chunk_size: int, length: int,
                          consume: Callable[[memoryview, int], bool]) -> int | None:
        after = await self._before("read", [key])
        if _corrupts(after) and length:
            consume = _flipping(consume, length // 2)
        return await super().read_chunks(key, chunk_size, length, consume)

    async def read(self, key: str) -> bytes:
        after = await self._before("read", [key])
        data = await super().read(key)
        if _corrupts(after) and data:
            flipped = bytearray(data)
            flipped[len(data) // 2] ^= 0xFF
            return bytes(flipped)
        return data

    async def delete(self, prefix: str) -> None:
        await self._before("probe" if PROBE in prefix else "delete", [prefix])
        await super().delete(prefix)

    async def list(self, prefix: str) -> list[str]:
        await self._before("list", [prefix])
        return await super().list(prefix)

    async def list_from(self, prefix: str, start: str) -> list[str]:
        await self._before("list", [prefix])
        return await super().list_from(prefix, start)

    async def list_names(self, prefix: str, start: str | None = None) -> list[str]:
        await self._before("list", [prefix])
        return await super().list_names(prefix, start)

    async def missing(self, keys: Sequence[str]) -> list[str]:
        await self._before("missing", keys)
        return await super().missing(keys)

    async def usage(self, prefix: str) -> dict[str, int]:
        await self._before("usage", [prefix])
        return await super().usage(prefix)

    async def debris(self, prefix: str, older_than: float) -> list[tuple[str, int]]:
        await self._before("debris", [prefix])
        return await super().debris(prefix, older_than)

    async def remove_debris(self, names: Sequence[str], older_than: float) -> int:
        await self._before("debris", names)
        return await super().remove_debris(names, older_than)

    # -- the faults ------------------------------------------------------------------------------------------
    async def _before(self, op: str, keys: Sequence[str]) -> list[Fault]:
        """Wait out the stalls, raise for the first failing fault; the faults that act once the operation ran
        (corrupt, vanish). Stalls first, and the rest matched after them: a clear() that ends a stall ends the
        faults injected beside it too."""
        for fault in self._matching(op, keys, stalls=True):
            await self._stall(fault)
        after = []
        for fault in self._matching(op, keys, stalls=False):
            what = f"{op} {keys[0] if len(keys) == 1 else f'{len(keys)} keys'} (fault injected by {self._control.path})"
            if fault.mode == "fail":
                raise TierUnavailable(f"cannot reach the store: {what}", tier=self.name)
            if fault.mode == "error":
                raise TierError(f"failed: {what}", tier=self.name)
            if fault.mode == "full":
                raise TierFull(f"no space left: {what}", tier=self.name)
            after.append(fault)
        return after

    def _matching(self, op: str, keys: Sequence[str], *, stalls: bool) -> Iterator[Fault]:
        """The active faults that apply to `op` on `keys` here, each counted as it is handed out (lazily: a fault
        after one that raised is not used up)."""
        for fault in self._control.current():
            if (fault.mode == "stall") != stalls or not fault.acts_on(op):
                continue
            if fault.hosts is not None and machine_name() not in fault.hosts:
                continue
            if fault.ranks is not None and self._rank not in fault.ranks:
                continue
            if fault.keys is not None and not any(fault.keys in k for k in keys):
                continue
            if _use(self._control.path, fault):
                yield fault

    async def _stall(self, fault: Fault) -> None:
        """Wait on the event loop, a marker file naming this process meanwhile (FaultControl.stalled() counts
        them; made and removed in place, as small as the stat each operation makes)."""
        marker = _stalls(self._control.path) / f"{os.getpid()}-{uuid.uuid4().hex[:12]}"
        marker.parent.mkdir(parents=True, exist_ok=True)
        marker.touch()
        try:
            if fault.seconds is not None:
                await asyncio.sleep(fault.seconds)
                return
            while any(f.id == fault.id for f in self._control.current()):
                await asyncio.sleep(STALL_POLL)
        finally:
            marker.unlink(missing_ok=True)


class _ControlFile:
    """The faults in a control file, parsed again only when the file changed (a new inode after each rename, or
    another size or mtime)."""

    def __init__(self, path: Path):
        self.path = path
        self._seen: tuple[int, int, int] | None = None
        self._faults: tuple[Fault, ...] = ()

    def current(self) -> tuple[Fault, ...]:
        try:
            st = os.stat(self.path)
        except FileNotFoundError:
            self._seen, self._faults = None, ()
            return ()
        seen = (st.st_ino, st.st_mtime_ns, st.st_size)
        if seen != self._seen:
            try:
                text = self.path.read_text()
            except FileNotFoundError:  # replaced between the stat and the read: the next operation reads it
                return self._faults
            self._faults, self._seen = tuple(_parse(text, self.path)), seen
        return self._faults


_used: dict[tuple[str, str], int] = {}  # (control file, fault id) → operations it acted on in this process
_used_lock = threading.Lock()  # drivers of several engines (a Checkpointer's thread) share the counts


def _use(control: Path, fault: Fault) -> bool:
    """Count one operation against `fault`; False once its `count` is used up in this process."""
    if fault.count is None:
        return True
    key = (str(control.absolute()), fault.id)
    with _used_lock:
        done = _used.get(key, 0)
        if done >= fault.count:
            return False
        _used[key] = done + 1
        return True


def _stalls(control: Path) -> Path:
    """The folder of markers of operations stalled now, beside the control file."""
    return control.with_name(control.name + ".stalled")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False  # killed while stalled: its marker stays, and counts for nothing
    except PermissionError:
        pass
    return True


def _remove_file(path: Path) -> int:
    """Remove the file alone (a delete would also remove the folders it leaves empty, under a racing writer of
    the next value); the bytes it held."""
    try:
        size = path.stat().st_size
        path.unlink()
    except FileNotFoundError:
        return 0
    return size


def _corrupts(faults: Sequence[Fault]) -> bool:
    return any(f.mode == "corrupt" for f in faults)


def _flip_in(out: Sequence[memoryview], at: int) -> None:
    """Flip byte `at` of the value that fills the buffers `out` in order."""
    for buf in out:
        view = memoryview(buf).cast("B")
        if at < len(view):
            view[at] ^= 0xFF
            return
        at -= len(view)


def _flipping(consume: Callable[[memoryview, int], bool], at: int) -> Callable[[memoryview, int], bool]:
    """`consume`, handed a copy with byte `at` of the value flipped in the chunk that holds it."""
    def flipped(chunk: memoryview, offset: int) -> bool:
        if offset <= at < offset + len(chunk):
            copy = bytearray(chunk)
            copy[at - offset] ^= 0xFF
            chunk = memoryview(copy)
        return consume(chunk, offset)
    return flipped


def _checked(mode: str, ops: Sequence[str], hosts: Sequence[str] | None, ranks: Sequence[int] | None,
             keys: str | None, seconds: float | None, count: int | None) -> Fault:
    """inject()'s arguments as a Fault; a ValueError naming the argument at fault."""
    if mode not in MODES:
        raise ValueError(f"mode {mode!r} is not one of {', '.join(MODES)}")
    ops = (ops,) if isinstance(ops, str) else tuple(ops)
    if not ops or any(op not in (*OPS, "*") for op in ops):
        raise ValueError(f"ops {ops!r}: give some of {', '.join(OPS)}, or '*' for all")
    acts_on = MODE_OPS.get(mode, OPS)
    if "*" not in ops and any(op not in acts_on for op in ops):
        raise ValueError(f"mode {mode!r} acts on {', '.join(acts_on)} only, not on {', '.join(ops)}: give "
                         f"ops={acts_on[:1]!r}")
    if hosts is not None and (isinstance(hosts, str) or not all(isinstance(h, str) and h for h in hosts)):
        raise ValueError(f"hosts {hosts!r} must be a list of machine names")
    if ranks is not None and not all(isinstance(r, int) and not isinstance(r, bool) and r >= 0 for r in ranks):
        raise ValueError(f"ranks {ranks!r} must be a list of ranks (ints >= 0)")
    if keys is not None and (not isinstance(keys, str) or not keys):
        raise ValueError(f"keys {keys!r} must be a non-empty substring of the keys to act on")
    if seconds is not None and (mode != "stall" or not isinstance(seconds, (int, float)) or isinstance(seconds, bool)
                                or not math.isfinite(seconds) or seconds < 0):
        raise ValueError(f"seconds {seconds!r}: only a stall has seconds, a finite number >= 0 (None: until cleared)")
    if count is not None and (not isinstance(count, int) or isinstance(count, bool) or count < 1):
        raise ValueError(f"count {count!r} must be an int >= 1 (None: every matching operation)")
    return Fault(uuid.uuid4().hex, mode, ops, None if hosts is None else tuple(hosts),
                 None if ranks is None else tuple(ranks), keys, None if seconds is None else float(seconds), count)


def _as_dict(fault: Fault) -> dict[str, Any]:
    return {k: list(v) if isinstance(v, tuple) else v for k, v in fault.__dict__.items()}


def _parse(text: str, path: Path) -> list[Fault]:
    try:
        raw = json.loads(text)
        return [Fault(**{k: tuple(v) if isinstance(v, list) else v for k, v in f.items()}) for f in raw["faults"]]
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise TierError(f"fault control file {path} is not what FaultControl writes ({type(e).__name__}: {e})") from e
