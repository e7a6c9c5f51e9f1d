"""The commands that open a job: ls, show, verify, export, delete and gc (free: cli/free.py). Each returns the exit status
(docs/operations.md, *CLI*)."""
from __future__ import annotations

import argparse
import asyncio
import dataclasses
import sys
from typing import Any, NoReturn

from ..errors import TierError, TieredCkptError
from ..lifecycle.gc import in_flight_steps
from ..sizes import format_size
from ..storage.index import CheckpointStatus
from ..job_store import JobStore
from .memory import host_memory, print_host_memory
from .text import KEY_WIDTH, age, local_time, plain_values, print_json, short, status_json

EXIT_OK, EXIT_PROBLEM, EXIT_USAGE = 0, 1, 2  # docs/operations.md, *CLI*


class Refused(Exception):
    """The command will not do what was asked (a step being saved, a question answered no): exit status 2."""


async def cmd_ls(checkpoints: JobStore, args: argparse.Namespace) -> int:
    """A job without checkpoints is no error here (an empty list): a script may ask before the first save."""
    rows = await checkpoints.list()
    ram = host_memory(checkpoints)
    if args.json:
        print_json({"job": checkpoints.job, "index": checkpoints.index.identity,
                     "checkpoints": [status_json(c) for c in rows], "host_memory": ram,
                     "host_memory_budget": checkpoints.config.engine.host_memory}, ready=("checkpoints",))
        return EXIT_OK
    if not rows:
        print(f"job {checkpoints.job!r}: no checkpoints{await _jobs_hint(checkpoints)}")
        print_host_memory(ram, checkpoints.job, checkpoints.config.engine.host_memory)
        return EXIT_OK
    when = [local_time(c.created) for c in rows]
    width = max(len("created"), *map(len, when))
    lines = [f"{'step':>10}  {'created':<{width}}  {'size':>10}  {'state':<10}  "
             f"tiers (* = complete, ! = failed, > = skipped for a newer save)"]
    for c, created in zip(rows, when, strict=True):
        marks = " ".join(f"{t}{'*' if t in c.complete else '!' if t in c.failed else '>' if t in c.skipped else ''}"
                         for t in c.tiers)
        foreign = f"  (foreign: committed to {c.foreign})" if c.foreign else ""
        size = "-" if c.nbytes is None else format_size(c.nbytes)
        lines.append(f"{c.step:>10}  {created:<{width}}  {size:>10}  "
                     f"{'complete' if c.is_complete else 'incomplete':<10}  {marks}{foreign}")
    sys.stdout.write("\n".join(lines) + "\n")  # one write: ten thousand print() calls cost 0.1-0.4 s
    print_host_memory(ram, checkpoints.job, checkpoints.config.engine.host_memory)
    return EXIT_OK


async def cmd_show(checkpoints: JobStore, args: argparse.Namespace) -> int:
    best: dict[str, Any] | None = None
    if args.step == "best":  # the one load(best=True) takes
        status = await checkpoints.best()
        rule = checkpoints.best_rule()
        best = {"metric": rule.metric, "mode": rule.mode, "value": status.metadata.get(rule.metric)}
        headline = (f"best by {rule.metric} ({'lowest' if rule.mode == 'min' else 'highest'}): step {status.step}, "
                    f"{rule.metric} = {best['value']!r}")
    elif args.step == "latest":  # the one load() takes
        status = await checkpoints.latest()
        headline = f"latest complete checkpoint: step {status.step}"
    else:
        found = await checkpoints.status(args.step)
        if found is None:
            raise LookupError(f"job {checkpoints.job!r} has no checkpoint {args.step}")
        status, headline = found, None
    m = await checkpoints.read_manifest(status.step, status.tiers)
    values = plain_values(m.skeleton_of(0))
    if args.json:
        print_json({**status_json(status), "job": m.job, "created": m.created, "format": m.version,
                     "nbytes": m.nbytes, "parts": sum(len(r.checksums) for r in m.ranks), "part_size": m.part_size,
                     "checksum": m.checksum, "world_size": m.world_size, "best": best, "metadata": m.metadata,
                     "values": dict(values),
                     "tensors": [{"path": t.path, "dtype": t.dtype.removeprefix("torch."), "shape": list(t.shape),
                                  "nbytes": sum(c.nbytes for c in t.chunks)} for t in m.tensors]})
        return EXIT_OK
    if headline:
        print(headline)
    print(f"job {m.job!r} step {m.step}  created {local_time(m.created)}  format v{m.version}")
    print(f"  size {format_size(m.nbytes)} in {sum(len(r.checksums) for r in m.ranks)} parts of "
          f"{format_size(m.part_size)}, {m.checksum}; world size {m.world_size}; {len(m.tensors)} tensors")
    print(f"  complete on: {', '.join(checkpoints.io.order(status.complete)) or 'none'}")
    for tier, reason in status.failed.items():
        print(f"  failed on {tier}: {reason}")
    for tier, newer in status.skipped.items():
        print(f"  skipped on {tier}: step {newer} superseded it there")
    tensors = m.tensors if args.tensors else m.tensors[:20]
    shown_values = values if args.values else values[:50]
    width = min(KEY_WIDTH, max([len(str(k)) for k in m.metadata] + [len(p) for p, _ in shown_values]
                               + [len(t.path) for t in tensors] + [1]))
    if m.metadata:
        print("  metadata:")
        for key, value in m.metadata.items():  # any msgpack-able key: an int too
            print(f"    {str(key):<{width}} = {short(value)}")
    if values:
        print(f"  values{' (rank 0)' if m.world_size > 1 else ''}:")
        for path, value in shown_values:
            print(f"    {path:<{width}} = {short(value)}")
        if len(shown_values) < len(values):
            print(f"    ... {len(values) - len(shown_values)} more (--values lists all)")
    print("  tensors:")
    for t in tensors:
        nbytes = sum(c.nbytes for c in t.chunks)
        print(f"    {t.path:<{width}} {t.dtype.removeprefix('torch.'):<14} {str(list(t.shape)):<20} "
              f"{format_size(nbytes)}")
    if len(tensors) < len(m.tensors):
        print(f"    ... {len(m.tensors) - len(tensors)} more (--tensors lists all)")
    return EXIT_OK


async def cmd_verify(checkpoints: JobStore, args: argparse.Namespace) -> int:
    """Exit 0: every copy intact; 1: damage on a tier (or in the index) where the checkpoint is complete;
    2: nothing to verify (no such step, a job without checkpoints)."""
    statuses = await checkpoints.list()
    if not statuses:
        raise LookupError(f"job {checkpoints.job!r} has no checkpoints to verify{await _jobs_hint(checkpoints)}")
    if args.step is not None:
        steps = ", ".join(str(s.step) for s in statuses)
        statuses = [s for s in statuses if s.step == args.step]
        if not statuses:
            raise LookupError(f"job {checkpoints.job!r} has no checkpoint {args.step} (its checkpoints: {steps})")
    entries = []
    for status in statuses:
        entry = await _verify_step(checkpoints, status)
        if not args.json:
            _print_verified(entry)
        entries.append(entry)
    ok = all(e["ok"] for e in entries)
    if args.json:
        print_json({"job": checkpoints.job, "index": checkpoints.index.identity, "ok": ok, "checkpoints": entries})
    return EXIT_OK if ok else EXIT_PROBLEM


async def _verify_step(checkpoints: JobStore, status: CheckpointStatus) -> dict[str, Any]:
    """Verify one checkpoint on its tiers and in the index: its entry of `verify --json`. It is "ok" unless a
    copy is damaged where the checkpoint is complete (bad parts where it is incomplete are only reported)."""
    from tqdm import tqdm

    from ..load.verify import verify, verify_index

    step = status.step
    entry: dict[str, Any] = {"step": step, "ok": True, "error": None, "retired": False, "tiers": [], "index": None}
    try:
        m = await checkpoints.read_manifest(step)
    except TieredCkptError as e:
        if await checkpoints.status(step) is None:  # retention (or a delete) removed it meanwhile: no damage
            entry["retired"] = True
            return entry
        entry.update(ok=False, error=str(e))
        return entry
    # the bytes verify reads: every part on each configured tier the checkpoint targets; a bar on a terminal only
    with tqdm(total=m.nbytes * len(checkpoints.io.order(status.tiers)), unit="B", unit_scale=True,
              desc=f"step {step}", file=sys.stderr, disable=None) as bar:
        reports = await verify(checkpoints.io, status, m, bar.update)
    # a checkpoint retired while verify read it (retention beside a live trainer) is gone, not damaged: what was
    # bad on a tier that no longer holds it (or on every tier, once the index forgot it) is reported as retired
    now = await checkpoints.status(step) if any(not r.ok for r in reports) else status
    still = set(now.complete) if now is not None else set()
    entry["retired"] = now is None
    entry["tiers"] = [{"tier": r.tier, "complete": r.complete, "parts": r.parts, "ok": r.ok, "bad": list(r.bad),
                       "retired": not r.ok and r.complete and r.tier not in still} for r in reports]
    damaged = any(not t["ok"] and t["complete"] and not t["retired"] for t in entry["tiers"])
    if now is not None and status.incarnation is None:  # else from the tiers' manifests: no index record to check
        index = await verify_index(checkpoints.index, m)
        checked = index.unreachable is None
        entry["index"] = {"index": index.index, "checked": checked, "unreachable": index.unreachable,
                          "rank_records": index.records - 1 if checked else None, "ok": index.ok if checked else None,
                          "bad": list(index.bad)}
        if not index.ok and await checkpoints.status(step) is None:
            entry["retired"] = True  # its records went with it while they were read
        else:
            damaged = damaged or (not index.ok and status.is_complete)
    entry["ok"] = not damaged
    return entry


def _print_verified(entry: dict[str, Any]) -> None:
    step = entry["step"]
    if entry["error"] is not None:
        print(f"step {step}: {entry['error']}")
        return
    if entry["retired"]:
        print(f"step {step}: retired while verify read it (retention or a delete removed it): not damage")
        return
    for r in entry["tiers"]:
        verdict = "ok" if r["ok"] else "retired while verify read it" if r["retired"] else f"{len(r['bad'])} problem(s)"
        print(f"step {step} tier {r['tier']} ({'complete' if r['complete'] else 'incomplete'}): {r['parts']} parts, "
              f"{verdict}")
        for line in r["bad"] if not r["retired"] else []:
            print(f"    {line}")
    index = entry["index"]
    if index is None:
        return
    if not index["checked"]:
        print(f"step {step} index {index['index']}: not checked ({index['unreachable']})")
        return
    verdict = "ok" if index["ok"] else f"{len(index['bad'])} bad record(s)"
    print(f"step {step} index {index['index']}: manifest and {index['rank_records']} rank record(s), {verdict}")
    for line in index["bad"]:
        print(f"    {line}")


async def _jobs_hint(checkpoints: JobStore) -> str:
    """"; jobs with checkpoints in <index>: a, b", so a mistyped job name shows; "" when the index can't say."""
    try:
        jobs = await checkpoints.index.jobs()
    except TieredCkptError:
        return ""
    return f"; jobs with checkpoints in {checkpoints.index.identity}: {', '.join(jobs) if jobs else 'none'}"


async def cmd_export(checkpoints: JobStore, args: argparse.Namespace) -> int:
    from tqdm import tqdm

    with tqdm(unit="B", unit_scale=True, desc="export", file=sys.stderr, disable=None) as bar:
        def progress(done: int, total: int) -> None:
            bar.total = total
            bar.update(done - bar.n)

        try:
            info = await checkpoints.export(args.output, to=args.to, step=args.step, select=args.select,
                                            force=args.force, progress=progress)
        except TieredCkptError:
            raise
        except (FileExistsError, ValueError) as e:  # an existing PATH, a --select that matches nothing, a dtype
            print(f"tiered-ckpt: {e}", file=sys.stderr)
            return EXIT_USAGE
        except OSError as e:  # PATH's folder cannot be made or written (a file in the way, no permission)
            print(f"tiered-ckpt: cannot write {args.output}: {e.strerror or e}"
                  f"{f' ({e.filename})' if e.filename else ''}", file=sys.stderr)
            return EXIT_USAGE
    print(f"step {info.step}: {info.tensors} tensors ({format_size(info.nbytes)}) and {info.values} plain values "
          f"-> {info.path} ({info.format})")
    for line in info.skipped:
        print(f"  left out {line}")
    for f in info.fallbacks:
        print(f"  {f.part}: read from a slower tier ({f.tier}: {f.reason})")
    return EXIT_OK


async def cmd_delete(checkpoints: JobStore, args: argparse.Namespace) -> int:
    """Asks first when stdin is a terminal (not with --yes or --dry-run); a script's stdin is not one, so
    scripts are never asked. The writer lease is held only to delete: while a dry run looks or a person
    answers, a trainer's first save does not wait for it."""
    ask = not (args.yes or args.dry_run) and sys.stdin is not None and sys.stdin.isatty()
    status = await _deletable(checkpoints, args.step, hold=not (args.dry_run or ask))
    if args.dry_run:
        print(f"would delete {_deletion(checkpoints, status)} (dry run: nothing deleted)")
        return EXIT_OK
    if ask:
        try:
            yes = await _confirm(f"delete {_deletion(checkpoints, status)}? [y/N] ")
        except asyncio.CancelledError:  # Ctrl-C: asyncio.run cancels this task; an answer that is not yes
            print(file=sys.stderr)
            raise Refused("nothing deleted") from None
        if not yes:
            raise Refused("nothing deleted")
        status = await _deletable(checkpoints, args.step, hold=True)  # again: it may have changed meanwhile
    try:
        await checkpoints.delete(args.step)
    except TierError as e:  # the index forgot it, a tier kept (some of) its data: done in part, a problem left
        print(f"tiered-ckpt: {e}", file=sys.stderr)
        return EXIT_PROBLEM
    print(f"deleted {_deletion(checkpoints, status)}")
    return EXIT_OK


async def _deletable(checkpoints: JobStore, step: int, *, hold: bool) -> CheckpointStatus:
    """The checkpoint `delete STEP` may remove: it exists and no running save may still write it."""
    # first without the lease: taking it writes the job's lease file, which a step or job that does not exist
    # (a mistyped --job, the wrong folder) must not leave behind, as status 2 means nothing was done
    if await checkpoints.status(step) is None:
        await _no_checkpoint(checkpoints, step)
    exclusive = await checkpoints.attach(hold=hold)  # no new incarnation: a running trainer is not fenced out
    status = await checkpoints.status(step)  # again, under the lease: it may have gone meanwhile
    if status is None:
        await _no_checkpoint(checkpoints, step)
    flying, _, _ = await in_flight_steps(checkpoints.index, checkpoints.job, [status], exclusive=exclusive)
    if status.step in flying:
        raise Refused(f"job {checkpoints.job!r} step {step} is being saved (it began {local_time(status.created)} "
                      f"and is not complete on {', '.join(status.incomplete)}); delete it once the save is over")
    return status


async def _no_checkpoint(checkpoints: JobStore, step: int) -> NoReturn:
    buried = step in await checkpoints.index.buried(checkpoints.job)
    hint = " (its removal was cut short: `tiered-ckpt gc` finishes it)" if buried else ""
    raise LookupError(f"job {checkpoints.job!r} has no checkpoint {step}{hint}")


def _deletion(checkpoints: JobStore, status: CheckpointStatus) -> str:
    size = "" if status.nbytes is None else f", {format_size(status.nbytes)}"
    where = ", ".join(checkpoints.io.order(status.tiers)) or "no tier"
    return (f"step {status.step} of job {checkpoints.job!r} ({'complete' if status.is_complete else 'incomplete'}"
            f"{size}) from {where} and the index")


async def _confirm(question: str) -> bool:
    """Ask on stderr, read one line of the terminal on stdin: yes only for y or yes. The loop waits for the line
    (a terminal's stdin turns readable once a line or an EOF is typed), not a thread: Ctrl-C cancels the wait at
    once, where asyncio.run would wait for a thread blocked in readline() until Enter."""
    print(question, end="", file=sys.stderr, flush=True)
    loop = asyncio.get_running_loop()
    typed = loop.create_future()
    fd = sys.stdin.fileno()
    loop.add_reader(fd, lambda: typed.done() or typed.set_result(None))
    try:
        await typed
    finally:
        loop.remove_reader(fd)
    return sys.stdin.readline().strip().lower() in ("y", "yes")


async def cmd_gc(checkpoints: JobStore, args: argparse.Namespace) -> int:
    from tqdm import tqdm

    with tqdm(unit="op", desc="gc", file=sys.stderr, disable=None, leave=False) as bar:  # a bar on a terminal only
        def progress(done: int, total: int) -> None:
            bar.total = total
            bar.update(done - bar.n)

        report = await checkpoints.gc(dry_run=args.dry_run, grace=args.grace, other_indexes=args.other_indexes,
                                      progress=progress)
    freed = report.freed()
    if args.json:
        for line in report.errors:
            print(f"  error: {line}", file=sys.stderr)
        print_json({"job": checkpoints.job, "dry_run": report.dry_run, "exclusive": report.exclusive,
                     "grace": report.grace, "removed": [dataclasses.asdict(r) for r in report.removed],
                     "checkpoints": report.checkpoints, "kept": report.kept, "errors": report.errors,
                     "freed": {tier: dict(zip(("items", "nbytes", "unknown_sizes"), freed.get(tier, (0, 0, False))))
                               for tier in checkpoints.io}})
        return EXIT_PROBLEM if report.errors else EXIT_OK
    verb = "would remove" if report.dry_run else "removed"
    mode = ("no writer can be running (the job's writer lease was free)" if report.exclusive else
            f"a writer may be running: incomplete saves younger than {age(report.grace)} are kept")
    print(f"gc of job {checkpoints.job!r}{' (dry run: nothing changed)' if report.dry_run else ''}; {mode}")
    width = max([len(r.name) for r in report.removed] + [10])
    for r in report.removed:
        size = "" if r.nbytes is None else format_size(r.nbytes)
        print(f"  {verb} {r.tier or 'index':<8} {r.name:<{width}} {size:>10}  {r.what}")
    for line in report.kept:
        print(f"  kept {line}")
    if not report.removed:
        print("  nothing to remove")
    for tier in checkpoints.io:
        count, nbytes, unknown = freed.get(tier, (0, 0, False))
        amount = "size unknown" if unknown and not nbytes else format_size(nbytes) + (" + unknown" if unknown else "")
        print(f"  {tier}: {verb} {count} item(s), {amount}")
    if report.checkpoints:
        print(f"  index: {verb} {len(report.checkpoints)} checkpoint(s): {', '.join(map(str, report.checkpoints))}")
    for line in report.errors:
        print(f"  error: {line}", file=sys.stderr)
    return EXIT_PROBLEM if report.errors else EXIT_OK
