"""When a failed save stops training, and how a tier's outage is reported.

A tier that fails for a checkpoint is that tier's failure for that checkpoint: recorded in the index (every rank's
wait sees it, `tiered-ckpt ls` shows it), in `on_event` records and metrics, and warned about once per outage, not
once per save. Training is stopped (the next `save()`, or `close()`, raises `SaveError`) only by a stated policy:

- a tier marked `required = true` failed a save (a user who cannot train without that copy says so), or
- `[engine] stop_after_failed_saves` saves in a row committed on no tier at all: nothing durable is being written.

A save that committed on some tier while others failed is a checkpoint: a load takes it from there, so training goes
on. A tier skipped because a newer save took its turn is no failure.
"""
from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass

from ..errors import RankFailed, SaveError
from .handle import SaveHandle, TierDone

log = logging.getLogger(__name__)


def real_errors(handle: SaveHandle) -> dict[str, BaseException]:
    """The tiers that failed (a cancelled save's tiers are no outage of theirs)."""
    return {t: e for t, e in handle.errors.items() if not isinstance(e, asyncio.CancelledError)}


@dataclass
class Outage:
    """One tier failing, from its first failed save until it commits one again."""

    first_step: int
    warned: bool  # this rank's own error began it (it warned); another rank's failure is said at INFO
    saves: int = 1  # failed saves so far


class FailurePolicy:
    """One engine's record of its saves' outcomes: the outages of its tiers and the rule that stops training."""

    def __init__(self, job: str, required: frozenset[str], stop_after: int):
        self.job = job
        self.required = required
        self.stop_after = stop_after
        self.nothing_durable = 0  # saves in a row, up to now, that committed on no tier and failed on some
        self.outages: dict[str, Outage] = {}  # tier → its outage, while it lasts
        self._stop: SaveError | None = None  # the error that stops training, until raised
        self._stop_handle: SaveHandle | None = None

    def watch(self, handle: SaveHandle) -> None:
        """Follow `handle`'s tiers as they finish (warn once per outage, say when a tier works again)."""
        handle.on_tier_done(self._tier_done)

    def _tier_done(self, done: TierDone) -> None:
        outage = self.outages.get(done.tier)
        if done.committed:
            if outage is not None:
                del self.outages[done.tier]
                say = log.warning if outage.warned else log.info
                say("job %r: tier %s works again: step %d is complete on it, after %d failed save(s) there (since "
                    "step %d)", self.job, done.tier, done.step, outage.saves, outage.first_step)
            return
        if done.error is None or isinstance(done.error, asyncio.CancelledError):
            return  # skipped for a newer save, or cancelled: no outage of the tier
        if outage is not None:
            outage.saves += 1
            log.info("job %r: step %d failed on tier %s too (failed saves there since step %d: %d): %s: %s",
                     self.job, done.step, done.tier, outage.first_step, outage.saves, type(done.error).__name__,
                     done.error)
            return
        # the rank whose own error it is warns; the others (RankFailed naming it) say it at INFO: one warning a job
        warned = not isinstance(done.error, RankFailed)
        self.outages[done.tier] = Outage(done.step, warned)
        say = log.warning if warned else log.info
        policy = ("a required tier: training stops at the next save" if done.tier in self.required else
                  "training goes on while another tier commits the saves")
        say("job %r: step %d failed on tier %s (%s); %s. Further failures there are logged at INFO until the "
                    "tier works again", self.job, done.step, done.tier, f"{type(done.error).__name__}: {done.error}",
                    policy)

    def finished(self, handle: SaveHandle) -> None:
        """`handle`'s save is done on every tier: count it, and arm the stop error when the policy says so."""
        errors = real_errors(handle)
        committed = [t for t in handle.tiers if t not in handle.errors and t not in handle.skipped]
        if committed:
            self.nothing_durable = 0
        elif errors:
            self.nothing_durable += 1
        required = sorted(set(errors) & self.required)
        if required:
            reason = (f"tier(s) {', '.join(required)} are required (required = true) and failed it; training stops "
                      f"(the checkpoint is complete on {', '.join(committed) or 'no tier'})")
        elif errors and not committed and self.nothing_durable >= self.stop_after:
            reason = (f"no tier committed the last {self.nothing_durable} save(s) ([engine] stop_after_failed_saves = "
                      f"{self.stop_after}): nothing durable is being written, training stops")
        else:
            return
        if self._stop is None or self._stop_handle is None or self._stop_handle.observed:
            self._stop, self._stop_handle = SaveError(handle.step, errors, reason=reason), handle

    def take_stop(self) -> SaveError | None:
        """The error that stops training (once), unless its save's caller already saw it from `wait()`."""
        stop, handle = self._stop, self._stop_handle
        self._stop = self._stop_handle = None
        if stop is None or handle is None or handle.observed:
            return None
        handle.observed = True
        return stop
