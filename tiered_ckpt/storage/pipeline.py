"""TierPipeline: one per tier. Bounded concurrency (workers), a byte budget for data in flight, per-op
timeouts, and bounded retries with exponential backoff and jitter for retryable tier errors.

Submitters wait while the pipeline is full (backpressure); an item larger than the whole budget runs only
when nothing else is in flight, so it can never deadlock. Saves take turns on a tier (`SaveTurns`): one
writes, one waits, and a newer save supersedes the one waiting, so a tier that cannot keep up skips to
the newest checkpoint instead of queueing every one.
"""
from __future__ import annotations

import asyncio
import logging
import random
from collections import deque
from typing import Awaitable, Callable, TypeVar

from ..errors import TierError, TierTimeout

T = TypeVar("T")
log = logging.getLogger(__name__)
_jitter = random.Random()  # its own: a retry never draws from the training process's global RNG


class ByteBudget:
    def __init__(self, limit: int):
        self.limit = limit
        self.used = 0
        self._cond = asyncio.Condition()

    async def acquire(self, n: int) -> None:
        async with self._cond:
            await self._cond.wait_for(lambda: self.used == 0 or self.used + n <= self.limit)
            self.used += n

    async def release(self, n: int) -> None:
        async with self._cond:
            self.used -= n
            self._cond.notify_all()


class SaveTurns:
    """One save writes to the tier at a time, the others wait in order. With `skip` (the default), at most
    one waits: when a newer save arrives, the waiting one is superseded (`take` returns the newer step), since
    its checkpoint would be stale by the time the tier got to it, and queueing every save of a burst grows
    memory and jobs in flight without bound."""

    def __init__(self, skip: bool = True) -> None:
        self.skip = skip
        self._busy = False
        self._waiting: deque[tuple[int, asyncio.Future[int | None]]] = deque()

    async def take(self, step: int) -> int | None:
        """None once it is `step`'s turn (call `give` after); else the newer step that superseded it."""
        if not self._busy:
            self._busy = True
            return None
        if self.skip:
            newest = max((s for s, t in self._waiting if not t.done()), default=None)
            if newest is not None and newest > step:  # an older save arriving late: the newer one stays
                return newest
            while self._waiting:
                _, superseded = self._waiting.popleft()
                if not superseded.done():
                    superseded.set_result(step)
        turn: asyncio.Future[int | None] = asyncio.get_running_loop().create_future()
        self._waiting.append((step, turn))
        try:
            return await turn
        except asyncio.CancelledError:
            if (step, turn) in self._waiting:
                self._waiting.remove((step, turn))
            elif turn.done() and not turn.cancelled() and turn.result() is None:
                self.give()  # the turn was handed over just as this waiter was cancelled: pass it on
            raise

    def give_once(self) -> Callable[[], None]:
        """`give`, callable any number of times by the save that took the turn: only the first call gives it (the
        turn passes on after the records, and again in a `finally` that must not pass on a second turn)."""
        given = False

        def give() -> None:
            nonlocal given
            if not given:
                given = True
                self.give()
        return give

    def give(self) -> None:
        while self._waiting:
            _, turn = self._waiting.popleft()
            if not turn.done():  # (a waiter being cancelled)
                turn.set_result(None)  # the tier stays busy: it is this waiter's turn
                return
        self._busy = False


class TierPipeline:
    def __init__(self, name: str, *, workers: int, inflight: int, retries: int, timeout: float,
                 backoff: float = 0.2, max_backoff: float = 10.0, skip_when_behind: bool = True):
        self.name = name
        self.retries = retries
        self.timeout = timeout
        self.backoff = backoff
        self.max_backoff = max_backoff
        self._workers = asyncio.Semaphore(workers)
        self._budget = ByteBudget(inflight)
        self.turns = SaveTurns(skip_when_behind)
        self.retried = 0  # ops that needed more than one attempt (for tests and stats)

    async def submit(self, nbytes: int, op: Callable[[], Awaitable[T]], what: str) -> T:
        """Run `op` under this tier's budget, retrying retryable errors; raise the last error otherwise."""
        await self._budget.acquire(nbytes)
        try:
            async with self._workers:
                return await self.attempt(op, what)
        finally:
            await self._budget.release(nbytes)

    async def once(self, op: Callable[[], Awaitable[T]], what: str, timeout: float) -> T:
        """Run `op` one time within `timeout` (a check, not work to get done: no retries, no budget)."""
        try:
            return await asyncio.wait_for(op(), timeout)
        except TierError:  # the driver's own (an OSError too): full, retryable or not, as it said
            raise
        except asyncio.TimeoutError:
            raise TierTimeout(f"{what} took longer than {timeout}s", tier=self.name) from None
        except OSError as e:  # a driver's raw OS error (EROFS, EACCES, EIO...) leaves TierIO as a TierError
            raise TierError(f"{what}: {e}", tier=self.name) from e

    async def attempt(self, op: Callable[[], Awaitable[T]], what: str) -> T:
        """Run `op` with this tier's timeout and retries, outside the budget (for work already counted in
        another pipeline's budget)."""
        attempt = 0
        while True:
            try:
                return await self.once(op, what, self.timeout)
            except TierError as e:  # (once: a timeout, or a driver's raw OS error, as a TierError)
                if not e.retryable or attempt >= self.retries:
                    if attempt:
                        e.add_note(f"gave up after {attempt + 1} attempts")
                    raise
                attempt += 1
                self.retried += 1
                delay = min(self.max_backoff, self.backoff * 2 ** (attempt - 1)) * _jitter.uniform(0.5, 1.5)
                log.warning("tier %s: %s failed (%s); retry %d/%d in %.2fs", self.name, what, e, attempt,
                            self.retries, delay)
                await asyncio.sleep(delay)
