"""`tiered-ckpt free [--all-jobs] [--force] [--dry-run] [-y] [--json]`: give a job's host memory on this machine
back (lifecycle/free.py has the rules: what goes, what a live process keeps, when it is refused). Nothing here
imports torch."""
from __future__ import annotations

import argparse
import asyncio
import sys

from ..lifecycle.free import FreePlan, plan_free, run_free
from ..lifecycle.host_memory import jobs_in, memory_tiers
from ..sizes import format_size
from ..job_store import JobStore
from .commands import EXIT_OK, EXIT_PROBLEM, Refused, _confirm
from .text import print_json


async def cmd_free(checkpoints: JobStore, args: argparse.Namespace) -> int:
    """Exit 0: done (what a live process holds is kept, and said); 1: a removal failed; 2 (Refused, raised):
    no memory tier, the newest checkpoint is only in memory without --force, or the question answered no."""
    if not memory_tiers(checkpoints.io):
        raise Refused("the tier stack has no memory tier: there is no host memory to free")
    present = sorted({j for _, root in memory_tiers(checkpoints.io) for j in jobs_in(root)})
    # a job with nothing in the memory tier here is not attached to (attaching makes its lease in a file index)
    jobs = present if args.all_jobs else [checkpoints.job] if checkpoints.job in present else []
    if not jobs:
        if not args.json:
            print(f"{'no job holds' if args.all_jobs else f'job {checkpoints.job!r} holds no'} host memory in the "
                  f"memory tier on this machine: nothing to free")
            return EXIT_OK
        return _report([], args, dry_run=args.dry_run)
    ask = not (args.yes or args.dry_run) and sys.stdin is not None and sys.stdin.isatty()
    plans = [await _plan(checkpoints, job, args, hold=False) for job in jobs]
    refused = [p.refused for p in plans if p.refused]
    if refused and not args.force:
        raise Refused("; ".join(refused) + ("" if args.dry_run else "; nothing freed"))
    if args.dry_run:
        return _report(plans, args, dry_run=True)
    if ask:
        total = sum(p.nbytes for p in plans)
        losing = "; ".join(f"{p.job!r} {', '.join(map(str, p.lost))}" for p in plans if p.lost)
        try:
            yes = await _confirm(f"free {format_size(total)} of host memory of job(s) {', '.join(map(repr, jobs))} "
                                 f"on this machine{f', losing checkpoint(s) {losing}' if losing else ''}? [y/N] ")
        except asyncio.CancelledError:
            print(file=sys.stderr)
            raise Refused("nothing freed") from None
        if not yes:
            raise Refused("nothing freed")
    # again, holding each job's lease (a trainer may have started or saved meanwhile): every job is planned,
    # and a refusal found now refuses the whole command, before anything is removed
    plans, attached = [], []
    try:
        for job in jobs:
            attached.append(job)
            plans.append(await _plan(checkpoints, job, args, hold=True))
        refused = [p.refused for p in plans if p.refused]
        if refused and not args.force:
            raise Refused("; ".join(refused) + "; nothing freed")
        for plan in plans:
            await run_free(plan)
    finally:
        for job in attached:
            await _detach(checkpoints, job)
    return _report(plans, args, dry_run=False)


async def _plan(checkpoints: JobStore, job: str, args: argparse.Namespace, *, hold: bool) -> FreePlan:
    c = checkpoints.for_job(job)
    exclusive = await c.attach(hold=hold)
    try:
        return await plan_free(job, c.index, c.io, c.removal, exclusive=exclusive, force=args.force)
    finally:
        if not hold:
            await c.writer.detach()


async def _detach(checkpoints: JobStore, job: str) -> None:
    await checkpoints.for_job(job).writer.detach()


def _report(plans: list[FreePlan], args: argparse.Namespace, *, dry_run: bool) -> int:
    errors = [e for p in plans for e in p.errors]
    if args.json:
        for line in errors:
            print(f"  error: {line}", file=sys.stderr)
        print_json({"dry_run": dry_run, "nbytes": sum(p.nbytes for p in plans), "jobs": [p.as_json() for p in plans]})
        return EXIT_PROBLEM if errors else EXIT_OK
    verb = "would free" if dry_run else "freed"
    for p in plans:
        print(f"free host memory of job {p.job!r} on this machine{' (dry run: nothing changed)' if dry_run else ''}")
        width = max([len(r.name) for r in p.removed] + [10])
        for r in p.removed:
            print(f"  {verb} {r.tier:<8} {r.name:<{width}} {format_size(r.nbytes):>10}  {r.what}")
        if p.lost:
            print(f"  {'would lose' if dry_run else 'lost'} checkpoint(s) {', '.join(map(str, p.lost))}: complete in "
                  f"host memory alone")
        for line in p.kept:
            print(f"  kept {line}")
        if not p.removed:
            print("  nothing to free")
        print(f"  {verb} {len(p.removed)} item(s), {format_size(p.nbytes)}")
    for line in errors:
        print(f"  error: {line}", file=sys.stderr)
    return EXIT_PROBLEM if errors else EXIT_OK
