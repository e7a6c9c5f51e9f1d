"""How often to save, and to which tier: the checkpoint-interval question answered from a job's own costs.

Save too often and training waits for every save; too rarely and each failure throws away more work. Young
(1974) and Daly (2006) give the first-order optimum for one level of checkpoints: an interval of
sqrt(2 * cost / failure rate). Tiers make it multi-level (as in SCR and Moody et al., SC'10): each kind of
failure can resume only from the tiers that survive it, and a tier that takes `d` seconds to make a save
durable cannot take one more often than every `d` seconds (it would skip saves anyway). The expected
fraction of training time lost, for a save every `T` seconds of training, is

    blocked / T  +  sum over failure kinds f of  rate_f * min over tiers i surviving f of (d_i + every_i * T / 2)

(the time training waits in each save, plus, per failure, the age of the newest checkpoint on the best
surviving tier: half its interval on average, plus the delay before it is durable there), where
every_i = max(1, ceil(d_i / T)). `advise` finds the `T` that minimises it (a log-spaced scan, then whole
steps around its best, at most ~400 of them) and each tier's `every`. The restart itself (a new
allocation, the load) costs the same whatever `T` is, so it is reported beside the fraction, not optimised.

Which tiers survive what (from each tier's kind): a job interruption (the processes end, their machines
stay: a crash, a preemption, a hang killed by the launcher) keeps every tier, host memory included; a node
lost with its memory and disks keeps S3 and a Redis peer ring of two or more servers (the copy sits on the
next machine), not the memory and local tiers. The costs come from the job's own save records (`[engine]
events_log`, or `on_event`): the time training paused for a save, each tier's time to durable, and the training steps
per second between saves. Nothing here imports torch.
"""
from __future__ import annotations

import json
import math
import statistics
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Mapping, Sequence

from .config import Config
from .errors import ConfigError

DAY = 86400.0
FAILURES = ("interruption", "node_loss")
SURVIVES_NODE_LOSS = {"s3"}  # and "redis" with two or more urls (a ring): see survivors()


@dataclass(frozen=True)
class SaveCosts:
    """What saving costs this job, measured on its own run."""

    blocked_seconds: float  # training waits this long per save (save(), and a lazy save's wait in staged())
    seconds_per_step: float  # training time per step, saves excluded
    durable_seconds: Mapping[str, float]  # tier -> seconds from save() until the checkpoint is durable there
    saves: int = 0  # how many save records these figures come from (0: given by hand)
    save_every_steps: int | None = None  # the interval the records show (the median distance between saves)


@dataclass(frozen=True)
class FailureRates:
    """How often the job fails, per day of training, as the user knows it from the cluster's history."""

    interruptions_per_day: float = 0.0  # the job stops, its machines stay (host memory survives)
    node_losses_per_day: float = 0.0  # a machine is lost with its memory and disks (the whole job restarts)
    restart_seconds: float = 0.0  # what each failure costs whatever the interval (reallocation, start, load)

    def rates(self) -> dict[str, float]:
        """FailureRates per second of training, by kind."""
        return {"interruption": self.interruptions_per_day / DAY, "node_loss": self.node_losses_per_day / DAY}


@dataclass(frozen=True)
class Plan:
    """One way to save: every `save_every_steps` steps, and each tier taking every `every[tier]`-th save."""

    save_every_steps: int
    every: dict[str, int]
    lost_fraction: float  # expected fraction of training time lost: waiting in saves plus work lost to failures
    blocked_fraction: float  # of which waiting in saves
    resume_from: dict[str, str]  # failure kind -> the tier a resume after it reads from
    restart_fraction: float  # the restarts themselves (not changed by the interval)


@dataclass(frozen=True)
class Advice:
    """The recommendation, and the configuration as it is (when known), under the same costs and failures."""

    recommended: Plan
    current: Plan | None
    costs: SaveCosts
    failures: FailureRates
    survivors: dict[str, tuple[str, ...]] = field(default_factory=dict)  # failure kind -> tiers that survive it
    capped_days: float | None = None  # the longest interval searched (max_days), when the optimum lies beyond it

    def summary(self) -> str:
        """A few lines for a person: what to set, and what it buys."""
        rec, lines = self.recommended, []
        c = self.costs
        lines.append(f"measured{f' over {c.saves} saves' if c.saves else ''}: a save pauses training "
                     f"{c.blocked_seconds:.3g} s, a step takes {c.seconds_per_step:.3g} s, durable after "
                     + ", ".join(f"{t} {s:.3g} s" for t, s in c.durable_seconds.items()))
        f = self.failures
        lines.append(f"failures per day: {f.interruptions_per_day:g} job interruptions (resume from "
                     f"{rec.resume_from.get('interruption', '-')}), {f.node_losses_per_day:g} node losses (resume "
                     f"from {rec.resume_from.get('node_loss', '-')})")
        for name, plan in (("now", self.current), ("recommended", rec)):
            if plan is None:
                continue
            every = ", ".join(f"{t} every {e}" for t, e in plan.every.items())
            lines.append(f"{name}: save_every_steps = {plan.save_every_steps} ({every}): "
                         f"{100 * plan.lost_fraction:.3g}% of training time lost "
                         f"({100 * plan.blocked_fraction:.3g}% waiting in saves)")
        if self.capped_days is not None:
            lines.append(f"(the longest interval looked at, {self.capped_days:g} days: failures this rare put the "
                         f"optimum beyond it)")
        if rec.restart_fraction:
            lines.append(f"plus {100 * rec.restart_fraction:.3g}% in restarts, whatever the interval")
        unmeasured = [t for t in self.survivors.get("interruption", ()) if t not in c.durable_seconds]
        if unmeasured:
            lines.append(f"not in the model: {', '.join(unmeasured)} (no time to durable known: no committed save in "
                         f"the records)")
        return "\n".join(lines)

    def as_json(self) -> dict[str, object]:
        def plan(p: Plan | None) -> dict[str, object] | None:
            return None if p is None else {
                "save_every_steps": p.save_every_steps, "every": p.every, "lost_fraction": p.lost_fraction,
                "blocked_fraction": p.blocked_fraction, "restart_fraction": p.restart_fraction,
                "resume_from": p.resume_from}
        return {"recommended": plan(self.recommended), "current": plan(self.current),
                "costs": {"blocked_seconds": self.costs.blocked_seconds,
                          "seconds_per_step": self.costs.seconds_per_step,
                          "durable_seconds": dict(self.costs.durable_seconds), "saves": self.costs.saves,
                          "save_every_steps": self.costs.save_every_steps},
                "failures": {"interruptions_per_day": self.failures.interruptions_per_day,
                             "node_losses_per_day": self.failures.node_losses_per_day,
                             "restart_seconds": self.failures.restart_seconds},
                "survivors": {k: list(v) for k, v in self.survivors.items()}, "capped_days": self.capped_days}


def survivors(config: Config) -> dict[str, tuple[str, ...]]:
    """The tiers (fastest first) that still hold a checkpoint after each kind of failure."""
    lasting = tuple(t.name for t in config.tiers if t.kind in SURVIVES_NODE_LOSS
                    or (t.kind == "redis" and len(getattr(t.options, "urls", ())) > 1))
    return {"interruption": tuple(t.name for t in config.tiers), "node_loss": lasting}


def expected_loss(seconds: float, costs: SaveCosts, failures: FailureRates, alive: Mapping[str, Sequence[str]],
                  every: Mapping[str, int] | None = None) -> tuple[float, dict[str, int], dict[str, str]]:
    """The model above at a save every `seconds` of training: (lost fraction, each tier's every, the tier
    each failure kind resumes from). `every`: the tiers' own (the configuration as it is), raised where a
    tier's durable time forces more; None: what the durable times force. A failure kind no tier survives
    loses all the work: infinite."""
    forced = {t: max(1, math.ceil(d / seconds - 1e-9)) for t, d in costs.durable_seconds.items()}
    if every is not None:
        forced = {t: max(every.get(t, 1), e) for t, e in forced.items()}
    lost = costs.blocked_seconds / seconds
    resume: dict[str, str] = {}
    for kind, rate in failures.rates().items():
        ages = {t: costs.durable_seconds[t] + forced[t] * seconds / 2 for t in alive.get(kind, ()) if t in forced}
        if ages:
            resume[kind] = min(ages, key=lambda t: ages[t])
        if rate > 0:
            lost += rate * ages[resume[kind]] if ages else math.inf
    return lost, forced, resume


def plan_at(steps: int, costs: SaveCosts, failures: FailureRates, alive: Mapping[str, Sequence[str]],
            every: Mapping[str, int] | None = None) -> Plan:
    """The plan of saving every `steps` steps (each tier's `every` as in expected_loss)."""
    seconds = steps * costs.seconds_per_step
    lost, forced, resume = expected_loss(seconds, costs, failures, alive, every)
    restart = sum(failures.rates().values()) * failures.restart_seconds
    return Plan(steps, forced, lost, costs.blocked_seconds / seconds, resume, restart)


def advise(config: Config, costs: SaveCosts, failures: FailureRates, *, current_every_steps: int | None = None,
           max_days: float = 7.0) -> Advice:
    """The save interval (in whole steps) and each tier's `every` that lose the least training time, under the
    model in this module's docstring; with `current_every_steps` (or the config's `save_every_steps`), the
    same figures for the configuration as it is."""
    _check(costs, failures, config)
    if current_every_steps is not None and current_every_steps < 1:
        raise ValueError(f"current_every_steps must be a whole number of steps >= 1, got {current_every_steps!r}")
    alive = survivors(config)
    if failures.node_losses_per_day > 0 and not alive["node_loss"]:
        raise ConfigError("no tier survives a node loss (memory and local tiers die with their machine): add an "
                          "S3 tier or a Redis peer ring of two or more servers, or give node_losses_per_day = 0",
                          file=config.source)
    for kind, rate in failures.rates().items():
        if rate > 0 and not any(t in costs.durable_seconds for t in alive[kind]):
            raise ValueError(f"no time to durable is known for the tiers a {kind.replace('_', ' ')} leaves "
                             f"({', '.join(alive[kind])}): the records hold no committed save there; give it "
                             f"(--durable {alive[kind][0]}=SECONDS)")
    longest = max(1, int(max_days * DAY / costs.seconds_per_step))

    def loss(steps: int) -> float:
        return plan_at(steps, costs, failures, alive).lost_fraction

    # convex in the interval between the points where some tier's every steps up: a log-spaced scan, then up to
    # ~400 whole steps around the best point of the scan (every one where the stretch is that short)
    scan = sorted({min(longest, round(math.exp(x / 64))) for x in range(int(64 * math.log(longest)) + 2)})
    near = min(scan, key=loss)
    low, high = max(1, int(near / 1.04) - 1), min(longest, int(near * 1.04) + 2)
    best = min({near, *range(low, high + 1, max(1, (high - low) // 400))}, key=lambda s: (loss(s), s))
    steps_now = current_every_steps or config.engine.save_every_steps or costs.save_every_steps
    current = None if not steps_now else plan_at(steps_now, costs, failures, alive,
                                                 {t.name: t.every for t in config.tiers})
    return Advice(plan_at(best, costs, failures, alive), current, costs, failures, alive,
                  capped_days=max_days if best >= longest > 1 else None)


def _check(costs: SaveCosts, failures: FailureRates, config: Config) -> None:
    for name, value in (("blocked_seconds", costs.blocked_seconds), ("seconds_per_step", costs.seconds_per_step),
                        ("interruptions_per_day", failures.interruptions_per_day),
                        ("node_losses_per_day", failures.node_losses_per_day),
                        ("restart_seconds", failures.restart_seconds), *costs.durable_seconds.items()):
        if not math.isfinite(value) or value < 0:
            raise ValueError(f"{name} must be a finite number >= 0, got {value!r}")
    if costs.seconds_per_step < 1e-6:
        raise ValueError(f"seconds_per_step must be at least a microsecond, got {costs.seconds_per_step!r}")
    if failures.interruptions_per_day + failures.node_losses_per_day <= 0:
        raise ValueError("give a failure rate (interruptions_per_day or node_losses_per_day > 0): without "
                         "failures the best interval is never to save")
    unknown = sorted(set(costs.durable_seconds) - {t.name for t in config.tiers})
    if unknown:
        raise ValueError(f"durable_seconds names tiers the configuration lacks: {unknown}")
    if not costs.durable_seconds:
        raise ValueError("durable_seconds is empty: no tier's time to durable is known")


def costs_from_events(records: Iterable[Mapping[str, object]], *, rank: int = 0,
                      job: str | None = None) -> SaveCosts:
    """SaveCosts from the save records of one rank of one job (the JSON lines of `[engine] events_log`, as dicts;
    several jobs may share a file: `job` keeps one, None every record). What a save cost the training loop is
    its `paused_seconds` (save(), and for a lazy save its wait in staged()); a record without it (written
    before it existed) counts its `blocked_seconds`. The first save is left out when there are others (it
    allocates its staging buffers); medians resist a stalled save. The training time per step comes from
    consecutive saves: (their starts' distance less the first one's pause) over their steps' distance."""
    try:
        saves = sorted((r for r in records if r.get("event") == "save" and r.get("rank", 0) == rank
                        and (job is None or r.get("job", job) == job)),
                       key=lambda r: int(r["step"]))  # type: ignore[call-overload]
        for r in saves:
            _paused(r), float(r["time"])  # type: ignore[arg-type]
    except (KeyError, TypeError, ValueError) as e:
        raise ValueError(f"a save record that cannot be read ({type(e).__name__}: {e}): not a tiered_ckpt "
                         f"events log?") from None
    if len(saves) < 2:
        raise ValueError(f"{len(saves)} save record(s) of rank {rank}{f' of job {job!r}' if job is not None else ''}"
                         f": at least 2 are needed (a step's time comes from the distance between saves)")
    later = saves[1:] if len(saves) > 2 else saves
    blocked = statistics.median(_paused(r) for r in later)
    durable: dict[str, list[float]] = {}
    try:
        for r in later:
            for tier, t in dict(r.get("tiers") or {}).items():  # type: ignore[call-overload]
                if t.get("outcome") == "committed" and t.get("seconds") is not None:
                    durable.setdefault(tier, []).append(float(t["seconds"]))
        starts = [(int(r["step"]), _start(r)) for r in saves]  # type: ignore[call-overload]
    except (AttributeError, KeyError, TypeError, ValueError) as e:
        raise ValueError(f"a save record whose tiers cannot be read ({type(e).__name__}: {e}): not a tiered_ckpt "
                         f"events log?") from None
    per_step = [(b - a - _paused(ra)) / (sb - sa)
                for (sa, a), (sb, b), ra in zip(starts, starts[1:], saves) if sb > sa and b > a]
    if not per_step:
        raise ValueError("the save records give no time between saves (steps or times out of order)")
    gaps = [int(b["step"]) - int(a["step"]) for a, b in zip(saves, saves[1:])]  # type: ignore[call-overload]
    gaps = [g for g in gaps if g > 0] or [0]  # a step saved again (a rerun after a restart) is no interval
    return SaveCosts(blocked, statistics.median(per_step), {t: statistics.median(v) for t, v in durable.items()},
                 saves=len(saves), save_every_steps=int(statistics.median(gaps)) or None)


def _paused(record: Mapping[str, object]) -> float:
    """What the save cost the training loop: `paused_seconds`, else (an older record, or a failed copy)
    `blocked_seconds`."""
    paused = record.get("paused_seconds")
    return float(paused if paused is not None else record["blocked_seconds"])  # type: ignore[arg-type]


def _start(record: Mapping[str, object]) -> float:
    """When save() was called: the record is written as the last tier finishes, its seconds after the call."""
    tiers = dict(record.get("tiers") or {})  # type: ignore[call-overload]
    spans = [float(t["seconds"]) for t in tiers.values() if t.get("seconds") is not None]
    blocked = float(record.get("blocked_seconds") or 0.0)  # type: ignore[arg-type]
    return float(record["time"]) - max(spans, default=blocked)  # type: ignore[arg-type]


def read_events(path: str | Path) -> list[dict[str, object]]:
    """The records of a JSON-lines events log; lines that are not JSON objects are named in the error."""
    out = []
    with open(path, encoding="utf-8") as f:
        lines = f.read().split("\n")
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as e:
            if number == len(lines):  # the last line, not ended yet: a log still being written
                break
            raise ValueError(f"line {number} is not JSON ({e.msg})") from None
        if isinstance(record, dict):
            out.append(record)
    return out
