"""When to save: the loop asks `should_save(step)`; the answer is the same on every rank.

Rules (`[engine]`, docs/configuration.md): every N steps (`save_every_steps`), every T seconds since the last
save (`save_every_seconds`, by rank 0's clock) and once on SIGTERM (`save_on_sigterm`: a preemption). The step
rule needs no agreement: every rank computes it alike. The other two are facts of one process (rank 0's clock,
a signal delivered to one rank), so with several ranks `should_save` is then a collective: one all_reduce (max)
of two small integers on the engine's gloo group, in program order like save() and load(), in a thread.

After a SIGTERM (on any rank) every rank answers True at the same step, and the save that follows is the last:
`Engine.save` waits until it is done on every tier, then lets the process end as the signal would have, on
every rank: the SIGTERM handler that was there before (the default ends the process; a handler of the program's
own runs) gets the signal (`finish`).
"""
from __future__ import annotations

import logging
import os
import signal
import threading
import time
from types import FrameType
from typing import Any

from ..config import EngineConfig
from ..distributed.coordinator import Coordinator
from ..errors import ConfigError

log = logging.getLogger(__name__)
SIGNAL = signal.SIGTERM


class SavePolicy:
    def __init__(self, every_steps: int | None, every_seconds: float | None, on_sigterm: bool):
        self.every_steps = every_steps
        self.every_seconds = every_seconds
        self.on_sigterm = on_sigterm
        self.coordinator = Coordinator()  # the engine's, set at open
        self._since: float | None = None  # monotonic time of the last save (or of the first question)
        self._signalled = False  # this process received SIGTERM (set in the main thread, by the handler)
        self._last_save_due = False  # agreed: the next save is the last one
        self._finishing = False  # the last save is done: the next SIGTERM (our own) goes to the previous handler
        self._previous: Any = None  # the SIGTERM handler ours replaced
        self._armed = False

    @classmethod
    def of(cls, engine: EngineConfig) -> "SavePolicy":
        return cls(engine.save_every_steps, engine.save_every_seconds, engine.save_on_sigterm)

    @property
    def configured(self) -> bool:
        return self.every_steps is not None or self.every_seconds is not None or self.on_sigterm

    @property
    def collective(self) -> bool:
        """Whether should_save issues a collective: several ranks, and a rule that one process alone decides."""
        return self.coordinator.distributed and (self.every_seconds is not None or self.on_sigterm)

    @property
    def last_save_due(self) -> bool:
        """A SIGTERM was agreed on: the save that comes next is the last."""
        return self._last_save_due

    # -- the signal ---------------------------------------------------------------------------------
    def arm(self) -> None:
        """Install the SIGTERM handler (save_on_sigterm), remembering the one it replaces. Python runs signal
        handlers in the main thread and lets only that thread install them: a no-op elsewhere (should_save then
        says so)."""
        if not self.on_sigterm or self._armed or threading.current_thread() is not threading.main_thread():
            return
        self._previous = signal.getsignal(SIGNAL)
        signal.signal(SIGNAL, self._on_signal)
        self._armed = True

    def disarm(self) -> None:
        """Put the previous handler back (main thread only; elsewhere the caller that armed it does)."""
        if self._armed and threading.current_thread() is threading.main_thread():
            self._armed = False
            if signal.getsignal(SIGNAL) == self._on_signal:
                signal.signal(SIGNAL, self._previous if self._previous is not None else signal.SIG_DFL)

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        if not self._finishing:
            self._signalled = True  # the loop's next should_save answers True on every rank
            return
        previous = self._previous  # our own re-delivery after the last save: as if we had never been there
        self.disarm()
        if callable(previous):
            previous(signum, frame)
        elif previous in (None, signal.SIG_DFL):
            signal.raise_signal(signum)  # the default action: the process ends, killed by SIGTERM
        # SIG_IGN: the program chose to ignore it; it goes on

    def finish(self) -> None:
        """The last save is done: deliver SIGTERM to this process again, now for the handler that was there
        before ours (from any thread: the handler runs in the main thread)."""
        self._last_save_due = False
        self._signalled = False
        self._finishing = True
        os.kill(os.getpid(), SIGNAL)

    # -- the question -------------------------------------------------------------------------------
    async def should_save(self, step: int) -> bool:
        if not self.configured:
            raise ConfigError("should_save() has no rule to follow: set save_every_steps, save_every_seconds or "
                              "save_on_sigterm in [engine]", key="engine.save_every_steps")
        if self.on_sigterm and not self._armed:
            raise ConfigError("save_on_sigterm needs a SIGTERM handler, which Python installs only from the main "
                              "thread: open the Engine (or create the tc.Checkpointer) in the main thread",
                              key="engine.save_on_sigterm")
        now = time.monotonic()
        if self._since is None:
            self._since = now  # the clock starts at the first question, not at open (a load may take long)
        by_steps = self.every_steps is not None and step % self.every_steps == 0
        by_time = self.every_seconds is not None and now - self._since >= self.every_seconds
        signalled = self._signalled
        if self.collective:  # rank 0's clock, any rank's signal
            by_time, signalled = (bool(v) for v in await self.coordinator.all_reduce_max(
                [int(by_time and self.coordinator.rank == 0), int(signalled)]))
        if signalled and not self._last_save_due:
            self._last_save_due = True
            log.warning("SIGTERM%s: saving step %d, then the process ends", "" if self._signalled else
                        " (on another rank)", step)
        return by_steps or by_time or signalled

    def saved(self) -> None:
        """A save began: the time rule counts from here."""
        self._since = time.monotonic()
