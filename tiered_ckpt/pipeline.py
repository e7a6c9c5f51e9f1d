"""TierPipeline: one per tier. Bounded concurrency (workers), a byte budget for data in flight, per-op
timeouts, and bounded retries with exponential backoff and jitter for retryable tier errors.

Submitters wait while the pipeline is full (backpressure); an item larger than the whole budget runs only
when nothing else is in flight, so it can never deadlock.
"""
from __future__ import annotations

import asyncio
import logging
import random
from typing import Awaitable, Callable, TypeVar

from .errors import TierError, TierTimeout

T = TypeVar("T")
log = logging.getLogger(__name__)


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


class TierPipeline:
    def __init__(self, name: str, *, workers: int, inflight: int, retries: int, timeout: float,
                 backoff: float = 0.2, max_backoff: float = 10.0):
        self.name = name
        self.retries = retries
        self.timeout = timeout
        self.backoff = backoff
        self.max_backoff = max_backoff
        self._workers = asyncio.Semaphore(workers)
        self._budget = ByteBudget(inflight)
        self.retried = 0  # ops that needed more than one attempt (for tests and stats)

    async def submit(self, nbytes: int, op: Callable[[], Awaitable[T]], what: str) -> T:
        """Run `op` under this tier's budget, retrying retryable errors; raise the last error otherwise."""
        await self._budget.acquire(nbytes)
        try:
            async with self._workers:
                return await self.attempt(op, what)
        finally:
            await self._budget.release(nbytes)

    async def attempt(self, op: Callable[[], Awaitable[T]], what: str) -> T:
        """Run `op` with this tier's timeout and retries, outside the budget (for work already counted in
        another pipeline's budget)."""
        attempt = 0
        while True:
            try:
                return await asyncio.wait_for(op(), self.timeout)
            except (asyncio.TimeoutError, TierError) as e:
                if isinstance(e, asyncio.TimeoutError) and not isinstance(e, TierError):
                    e = TierTimeout(f"{what} took longer than {self.timeout}s", tier=self.name)
                if not getattr(e, "retryable", False) or attempt >= self.retries:
                    if attempt:
                        e.add_note(f"gave up after {attempt + 1} attempts")
                    raise e
                attempt += 1
                self.retried += 1
                delay = min(self.max_backoff, self.backoff * 2 ** (attempt - 1)) * random.uniform(0.5, 1.5)
                log.warning("tier %s: %s failed (%s); retry %d/%d in %.2fs", self.name, what, e, attempt,
                            self.retries, delay)
                await asyncio.sleep(delay)
