"""Which checkpoints a tier's retention rules keep: the newest `keep_last`, the `keep_best` best by a metric of
their `metadata`, and every step divisible by `keep_every`.

Pure functions of (step, metadata) pairs, which the index lists without reading a manifest, so retention (what
a pass removes, what a full tier retires first) and the catalog (`load(best=True)`) share one definition of
"best". A checkpoint whose metadata lacks the metric, or holds something that is not a finite number there, is
never among the best: keep_last (and keep_every) alone judge it.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from functools import cached_property
from typing import Any, Iterable, Mapping, Sequence

from ..config import Config, TierConfig
from ..errors import ConfigError

Listed = tuple[int, Mapping[str, Any]]  # (step, the metadata given to save())


@dataclass(frozen=True)
class Best:
    """What "best" means: the metadata key `metric`, lowest first ("min") or highest first ("max")."""

    metric: str
    mode: str = "min"

    def score(self, metadata: Mapping[str, Any]) -> float | None:
        """The metric as a number, or None: missing, not a number (bools are not), or not finite (a diverged
        run's nan loss is never the best)."""
        value = metadata.get(self.metric)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            return None
        return float(value)

    def ranked(self, listed: Iterable[Listed]) -> list[int]:
        """Steps that carry the metric, best first; of two equal scores the newer step ranks first."""
        scored = [(score, step) for step, metadata in listed if (score := self.score(metadata)) is not None]
        sign = 1.0 if self.mode == "min" else -1.0
        return [step for _, step in sorted(scored, key=lambda item: (sign * item[0], -item[1]))]

    @classmethod
    def of(cls, config: Config) -> "Best | None":
        """The job's metric: the one the tiers with keep_best name (config.py makes them agree), or None."""
        for tier in config.tiers:
            if tier.best_metric is not None:
                return cls(tier.best_metric, tier.best_mode)
        return None

    @classmethod
    def required(cls, config: Config) -> "Best":
        """The job's metric, for `load(best=True)` and `show best`: a ConfigError naming the keys when no tier
        sets one."""
        best = cls.of(config)
        if best is None:
            raise ConfigError("the best checkpoint is judged by a tier's best_metric: set keep_best and best_metric "
                              "(and best_mode) on a tier", key="tiers.best_metric", file=config.source)
        return best


@dataclass(frozen=True)
class Verdict:
    """What the rules keep among a tier's complete checkpoints."""

    last: frozenset[int]  # the newest keep_last
    best: tuple[int, ...]  # the keep_best best, best first
    every: frozenset[int]  # divisible by keep_every

    @cached_property
    def kept(self) -> frozenset[int]:
        """Every step some rule keeps. Made once per verdict: a pass asks it for each checkpoint it judges, and
        a union of ten thousand steps made at each ask was O(H^2) per pass (seconds on the event loop)."""
        return self.last | frozenset(self.best) | self.every

    @property
    def oldest_last(self) -> int | None:
        """The oldest of the newest keep_last: steps older than it go unless another rule keeps them."""
        return min(self.last, default=None)

    def retire_order(self, steps: Iterable[int]) -> list[int]:
        """The order in which a full tier gives up `steps`: first those no rule keeps, oldest first; then those
        only keep_last keeps, oldest first; then keep_every's, oldest first; the best ones last, worst first."""
        rank = {step: i for i, step in enumerate(self.best)}

        def key(step: int) -> tuple[int, int]:
            if step in rank:
                return 3, -rank[step]
            if step in self.every:
                return 2, step
            return (1 if step in self.last else 0), step

        return sorted(steps, key=key)


@dataclass(frozen=True)
class Rules:
    keep_last: int | None
    keep_best: int | None = None
    best: Best | None = None
    keep_every: int | None = None

    @classmethod
    def of(cls, tier: TierConfig) -> "Rules":
        best = Best(tier.best_metric, tier.best_mode) if tier.best_metric is not None else None
        return cls(tier.keep_last, tier.keep_best, best, tier.keep_every)

    @property
    def bounded(self) -> bool:
        """Whether retention removes anything here (without keep_last a tier keeps every checkpoint)."""
        return self.keep_last is not None

    def may_keep_old(self, step: int) -> bool:
        """Whether a rule other than keep_last could keep `step` (so a copy older than the keep_last window is
        worth looking at)."""
        return self.keep_best is not None or (self.keep_every is not None and step % self.keep_every == 0)

    def judge(self, complete: Sequence[Listed]) -> Verdict:
        """`complete`: the tier's complete checkpoints as (step, metadata)."""
        steps = sorted(step for step, _ in complete)
        last = frozenset(steps[-self.keep_last:]) if self.keep_last is not None else frozenset(steps)
        best = tuple(self.best.ranked(complete)[:self.keep_best]) if self.best and self.keep_best else ()
        every = frozenset(s for s in steps if self.keep_every is not None and s % self.keep_every == 0)
        return Verdict(last, best, every)
