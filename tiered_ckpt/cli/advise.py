"""`tiered-ckpt advise`: how often to save and to which tier, from the job's save records and the failure rates
the user gives (tiered_ckpt/interval.py has the model). Opens neither the index nor the tiers; imports no torch."""
from __future__ import annotations

import argparse
from pathlib import Path

from ..interval import SaveCosts, FailureRates, advise, costs_from_events, read_events
from ..config import Config
from .commands import EXIT_OK, Refused
from .text import print_json


def add_arguments(p: argparse.ArgumentParser, duration: object) -> None:
    p.add_argument("--interruptions-per-day", type=float, default=0.0, metavar="N",
                   help="job interruptions whose machines stay (crashes, preemptions, hangs killed)")
    p.add_argument("--node-losses-per-day", type=float, default=0.0, metavar="N",
                   help="machines lost with their memory and disks")
    p.add_argument("--restart", type=duration, default=0.0, metavar="SECONDS",
                   help="what each failure costs whatever the interval (reallocation, start-up, load)")
    p.add_argument("--events", metavar="FILE", help="the save records (JSON lines) to measure; default: the "
                   "config's [engine] events_log of --rank")
    p.add_argument("--rank", type=int, default=0, help="whose records to read (default 0)")
    p.add_argument("--every-steps", type=_steps, metavar="N", help="the interval now (default: [engine] "
                   "save_every_steps, else the one the records show)")
    p.add_argument("--blocked", type=duration, metavar="SECONDS", help="what training pauses per save (save(), and a lazy save's "
                   "staged()), instead of measured")
    p.add_argument("--step-seconds", type=duration, metavar="SECONDS", help="a training step's time, instead of "
                   "measured")
    p.add_argument("--durable", action="append", default=[], metavar="TIER=SECONDS",
                   help="a tier's time to durable, instead of measured (repeat per tier)")


def _steps(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"a whole number of steps >= 1, got {text!r}")
    return value


def cmd_advise(config: Config, args: argparse.Namespace) -> int:
    costs = _costs(config, args)
    failures = FailureRates(args.interruptions_per_day, args.node_losses_per_day, args.restart)
    try:
        advice = advise(config, costs, failures, current_every_steps=args.every_steps)
    except ValueError as e:
        raise Refused(str(e)) from None
    if args.json:
        print_json(advice.as_json())
    else:
        print(advice.summary())
    return EXIT_OK


def _costs(config: Config, args: argparse.Namespace) -> SaveCosts:
    """Measured from the records, with what the options give in their place."""
    measured = None
    path = args.events or (config.engine.events_log or "").replace("{rank}", str(args.rank))
    given = args.blocked is not None and args.step_seconds is not None and args.durable
    if path and not (given and not args.events):
        if not Path(path).is_file():
            raise Refused(f"{path}: no such events log (set [engine] events_log and run some saves, pass --events "
                          f"FILE, or give --blocked, --step-seconds and --durable TIER=SECONDS)")
        try:
            measured = costs_from_events(read_events(path), rank=args.rank, job=config.engine.job)
        except ValueError as e:
            raise Refused(f"{path}: {e}") from None
    elif not given:
        raise Refused("no save records to measure: set [engine] events_log and run some saves, pass --events FILE, "
                      "or give --blocked, --step-seconds and --durable TIER=SECONDS")
    durable = dict(measured.durable_seconds) if measured else {}
    for item in args.durable:
        tier, sep, value = item.partition("=")
        try:
            durable[tier.strip()] = float(value)
        except ValueError:
            raise Refused(f"--durable {item!r}: expected TIER=SECONDS") from None
        if not sep:
            raise Refused(f"--durable {item!r}: expected TIER=SECONDS")
    return SaveCosts(args.blocked if args.blocked is not None else measured.blocked_seconds,  # type: ignore[union-attr]
                 args.step_seconds if args.step_seconds is not None else measured.seconds_per_step,  # type: ignore[union-attr]
                 durable, saves=measured.saves if measured else 0,
                 save_every_steps=measured.save_every_steps if measured else None)
