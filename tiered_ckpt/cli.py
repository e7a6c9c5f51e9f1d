"""`tiered-ckpt ls | show STEP|best | verify [STEP] | export [STEP] --to FORMAT -o PATH | delete STEP |
gc [--dry-run] | config check FILE | bench`."""
from __future__ import annotations

import argparse
import asyncio
import dataclasses
import datetime
import math
import os
import sys
from typing import Any, Awaitable, Callable

from .config import load_config
from .engine import Engine
from .errors import ConfigError, TieredCkptError
from .lifecycle.gc import GRACE, in_flight
from .lifecycle.rules import Best
from .sizes import format_size
from .state import PerRankMark, Pickled, TensorAlias, TensorRef, decode_skeleton, path_str
from .storage.index import CheckpointStatus, open_index
from .storage.redis_connect import redact

DEFAULT_CONFIG = os.environ.get("TIERED_CKPT_CONFIG", "tiers/local.toml")
UNSET = {"keep_last": "all", "capacity": "unlimited", "keep_best": "none", "best_metric": "none", "keep_every": "none",
         "save_every_steps": "none", "save_every_seconds": "none"}  # what `config check` says of a key left unset


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="tiered-ckpt", description=__doc__)
    config_help = "tier stack TOML (default: $TIERED_CKPT_CONFIG or tiers/local.toml)"
    parser.add_argument("-c", "--config", default=DEFAULT_CONFIG, help=config_help)
    parser.add_argument("--job", default=None, help="override [engine] job")
    sub = parser.add_subparsers(dest="command", required=True)

    def with_config(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
        # accepted after the subcommand too (`tiered-ckpt ls -c x.toml`); there, a value wins over one before it
        p.add_argument("-c", "--config", default=argparse.SUPPRESS, help=config_help)
        p.add_argument("--job", default=argparse.SUPPRESS, help="override [engine] job")
        return p

    with_config(sub.add_parser("ls", help="list checkpoints and the tiers that hold them"))
    show = with_config(sub.add_parser("show", help="describe one checkpoint"))
    show.add_argument("step", type=_step_or_best, metavar="STEP|best",
                      help="a step, or best: the best complete checkpoint by the tiers' best_metric")
    show.add_argument("--tensors", action="store_true", help="list every tensor")
    show.add_argument("--values", action="store_true", help="list every plain value")
    verify = with_config(sub.add_parser("verify", help="re-read every part on every tier and check checksums"))
    verify.add_argument("step", type=int, nargs="?", help="default: every checkpoint")
    export = with_config(sub.add_parser("export", help="write one checkpoint as safetensors, torch.save or DCP "
                                                     "(read-only; sharded tensors come out whole)"))
    export.add_argument("step", type=int, nargs="?", help="default: the newest complete checkpoint")
    export.add_argument("--to", required=True, choices=["safetensors", "torch", "dcp"], help="output format")
    export.add_argument("-o", "--output", required=True, metavar="PATH", help="file (safetensors, torch) or "
                        "directory (dcp) to create")
    export.add_argument("--select", metavar="PREFIX", help="only this subtree (e.g. model), names relative to it")
    export.add_argument("--force", action="store_true", help="replace PATH if it exists")
    delete = with_config(sub.add_parser("delete", help="delete one checkpoint from every tier and the index"))
    delete.add_argument("step", type=int)
    gc = with_config(sub.add_parser("gc", help="remove what crashed runs left: incomplete checkpoints, stray "
                                               "folders, temp files, removals cut short (docs/operations.md)"))
    gc.add_argument("--dry-run", action="store_true", help="print what would be removed; change nothing")
    gc.add_argument("--grace", type=_duration, default=GRACE, metavar="DURATION",
                    help="when a trainer may be running: keep saves that began less than this long ago, and temp "
                         "files and empty folders younger than this (default 1h; e.g. 90s, 30m, 2h)")
    gc.add_argument("--other-indexes", action="store_true", help="also remove other indexes' folders of this job "
                    "(runs that share the tier's path and job name with their own index)")
    config = sub.add_parser("config", help="configuration tools")
    config_sub = config.add_subparsers(dest="config_command", required=True)
    check = config_sub.add_parser("check", help="validate a tier stack TOML")
    check.add_argument("file")
    bench = sub.add_parser("bench", help="benchmark against torch.save, DCP, memcpy and raw disk in one run")
    from .bench.run import add_arguments

    add_arguments(bench)
    args = parser.parse_args(argv)
    try:
        status = _run(args)
        sys.stdout.flush()  # here, where a reader that went away (`| head`) can be told from a failure
        return status
    except BrokenPipeError:
        return _reader_went_away()
    except (TieredCkptError, LookupError) as e:
        print(f"tiered-ckpt: {e}", file=sys.stderr)
        return 2


def _run(args: argparse.Namespace) -> int:
    if args.command == "config":
        return config_check(args.file)
    if args.command == "bench":
        from .bench.run import run_bench

        return run_bench(args)
    commands: dict[str, Callable[[Engine, argparse.Namespace], Awaitable[int]]] = {
        "ls": cmd_ls, "show": cmd_show, "verify": cmd_verify, "export": cmd_export, "delete": cmd_delete,
        "gc": cmd_gc}
    return asyncio.run(_with_engine(args, commands[args.command]))


def _reader_went_away() -> int:
    """stdout's reader closed the pipe (`tiered-ckpt ls | head -1`): stop quietly, as the Python docs advise
    (output still buffered would fail again at exit, so stdout points at /dev/null from now on)."""
    try:
        fd = sys.stdout.fileno()
    except (OSError, ValueError):  # not a file (a test's capture): nothing is left to flush at exit
        return 1
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, fd)
    os.close(devnull)
    return 1


async def _with_engine(args: argparse.Namespace, fn: Callable[[Engine, argparse.Namespace], Awaitable[int]]) -> int:
    overrides: dict[str, Any] = {"job": args.job} if args.job else {}
    async with Engine(load_config(args.config, **overrides)) as engine:
        return await fn(engine, args)


def config_check(path: str) -> int:
    try:
        cfg = load_config(path)
        open_index(cfg.engine.index)  # parses a Redis URL and its options (nothing is connected)
    except ConfigError as e:
        print(f"invalid: {e}", file=sys.stderr)
        return 2
    print(f"{path}: ok (every effective key, defaults included)")
    print("  [engine]")
    _print_keys(_keys(cfg.engine))
    for t in cfg.tiers:
        print(f"  [[tiers]] {t.name} (kind {t.kind})")
        _print_keys([(k, v) for k, v in _keys(t) if k not in ("name", "kind")] + _keys(t.options))
    return 0


def _keys(obj: Any) -> list[tuple[str, str]]:
    """A config dataclass's keys and values as the TOML would say them: sizes human, secrets hidden."""
    out = []
    for f in dataclasses.fields(obj):
        if f.name == "options":
            continue
        value = getattr(obj, f.name)
        if f.metadata.get("size") and value is not None:
            text = f"{_human(value)} ({value} bytes)"
        elif value is None:
            text = UNSET.get(f.name, "default")
        elif isinstance(value, bool):
            text = str(value).lower()
        elif isinstance(value, str):
            text = redact(value)
        elif isinstance(value, (tuple, list)):
            text = ", ".join(redact(v) if isinstance(v, str) else str(v) for v in value)
        else:
            text = str(value)
        out.append((f.name, text))
    return out


def _print_keys(items: list[tuple[str, str]]) -> None:
    width = max((len(k) for k, _ in items), default=0)
    for key, text in items:
        print(f"    {key:<{width}} = {text}")


def _human(n: int) -> str:
    """format_size, without decimals when the value is a whole number of its unit ("64 MiB", "1.50 GiB")."""
    text = format_size(n)
    return text.replace(".00 ", " ")


def _when(ts: float) -> str:
    """Local time with its zone."""
    if not ts:
        return "?"
    local = datetime.datetime.fromtimestamp(ts).astimezone()
    return local.strftime("%Y-%m-%d %H:%M:%S ") + (local.strftime("%Z") or local.strftime("%z"))


def _duration(text: str) -> float:
    """Seconds from "90", "90s", "30m", "2h", "1d"."""
    units = {"s": 1, "m": 60, "h": 3600, "d": 86400}
    try:
        value = float(text[:-1]) * units[text[-1]] if text and text[-1] in units else float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a duration like 90s, 30m or 2h, got {text!r}") from None
    if not math.isfinite(value) or value < 0:  # nan and inf: never a duration
        raise argparse.ArgumentTypeError(f"a duration must be a finite number >= 0, got {text!r}")
    return value


async def cmd_ls(engine: Engine, args: argparse.Namespace) -> int:
    rows = [c async for c in engine.list()]
    if not rows:
        print(f"job {engine.job!r}: no checkpoints{await _jobs_hint(engine)}")
        return 0
    when = [_when(c.created) for c in rows]
    width = max(len("created"), *map(len, when))
    print(f"{'step':>10}  {'created':<{width}}  {'size':>10}  {'state':<10}  "
          f"tiers (* = complete, ! = failed, > = skipped for a newer save)")
    for c, created in zip(rows, when, strict=True):
        marks = " ".join(f"{t}{'*' if t in c.complete else '!' if t in c.failed else '>' if t in c.skipped else ''}"
                         for t in c.tiers)
        foreign = f"  (foreign: committed to {c.foreign})" if c.foreign else ""
        size = "-" if c.nbytes is None else format_size(c.nbytes)
        print(f"{c.step:>10}  {created:<{width}}  {size:>10}  {'complete' if c.is_complete else 'incomplete':<10}  "
              f"{marks}{foreign}")
    return 0


def _step_or_best(text: str) -> int | str:
    if text == "best":
        return text
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a step (an integer) or best, got {text!r}") from None


async def cmd_show(engine: Engine, args: argparse.Namespace) -> int:
    if args.step == "best":  # the one load(best=True) takes
        picked = await engine.best()
        best = Best.of(engine.config)
        assert best is not None
        print(f"best by {best.metric} ({'lowest' if best.mode == 'min' else 'highest'}): step {picked.step}, "
              f"{best.metric} = {picked.metadata.get(best.metric)!r}")
        args.step = picked.step
    status = await engine.status(args.step)
    if status is None:
        raise LookupError(f"job {engine.job!r} has no checkpoint {args.step}")
    m = await engine.read_manifest(args.step, status.tiers)
    print(f"job {m.job!r} step {m.step}  created {_when(m.created)}  format v{m.version}")
    print(f"  size {format_size(m.nbytes)} in {sum(len(r.checksums) for r in m.ranks)} parts of "
          f"{format_size(m.part_size)}, {m.checksum}; world size {m.world_size}; {len(m.tensors)} tensors")
    print(f"  complete on: {', '.join(engine.io.order(status.complete)) or 'none'}")
    for tier, reason in status.failed.items():
        print(f"  failed on {tier}: {reason}")
    for tier, newer in status.skipped.items():
        print(f"  skipped on {tier}: step {newer} superseded it there")
    values = _plain_values(decode_skeleton(m.skeleton_of(0)))
    tensors = m.tensors if args.tensors else m.tensors[:20]
    shown_values = values if args.values else values[:50]
    width = max([len(k) for k in m.metadata] + [len(p) for p, _ in shown_values] + [len(t.path) for t in tensors]
                + [1])
    if m.metadata:
        print("  metadata:")
        for key, value in m.metadata.items():
            print(f"    {key:<{width}} = {_short(value)}")
    if values:
        print(f"  values{' (rank 0)' if m.world_size > 1 else ''}:")
        for path, value in shown_values:
            print(f"    {path:<{width}} = {value}")
        if len(shown_values) < len(values):
            print(f"    ... {len(values) - len(shown_values)} more (--values lists all)")
    print("  tensors:")
    for t in tensors:
        nbytes = sum(c.nbytes for c in t.chunks)
        print(f"    {t.path:<{width}} {t.dtype.removeprefix('torch.'):<14} {str(list(t.shape)):<20} "
              f"{format_size(nbytes)}")
    if len(tensors) < len(m.tensors):
        print(f"    ... {len(m.tensors) - len(tensors)} more (--tensors lists all)")
    return 0


def _plain_values(skeleton: Any) -> list[tuple[str, str]]:
    """The saved skeleton's plain values (not tensors), by path: dicts and lists of containers are opened,
    a list or tuple of plain values is one value."""
    out: list[tuple[str, str]] = []

    def walk(node: Any, path: tuple[Any, ...]) -> None:
        if isinstance(node, (TensorRef, TensorAlias)):
            return
        if isinstance(node, PerRankMark):
            return walk(node.inner, path[:-1] + (f"{path[-1]}@rank0",) if path else ("@rank0",))
        if isinstance(node, dict) and node:
            for k, v in node.items():
                walk(v, path + (k,))
            return
        if isinstance(node, (list, tuple)) and any(isinstance(v, (dict, list, tuple, TensorRef, TensorAlias,
                                                                    PerRankMark)) for v in node):
            for i, v in enumerate(node):
                walk(v, path + (i,))
            return
        out.append((path_str(path), _short(node)))

    try:
        walk(skeleton, ())
    finally:
        del walk  # a nested function that calls itself is a reference cycle (see tiered_ckpt.state)
    return out


def _short(value: Any, limit: int = 100) -> str:
    if isinstance(value, Pickled):
        return f"<pickled, {len(value.data)} bytes>"
    if isinstance(value, bytes) and len(value) > 32:
        return f"<{len(value)} bytes>"
    text = repr(value)
    return text if len(text) <= limit else text[:limit - 3] + "..."


async def cmd_verify(engine: Engine, args: argparse.Namespace) -> int:
    """Exit 0: every copy intact; 1: damage on a tier (or in the index) where the checkpoint is complete;
    2: nothing to verify (no such step, a job without checkpoints)."""
    statuses = [c async for c in engine.list()]
    if not statuses:
        raise LookupError(f"job {engine.job!r} has no checkpoints to verify{await _jobs_hint(engine)}")
    if args.step is not None:
        steps = ", ".join(str(s.step) for s in statuses)
        statuses = [s for s in statuses if s.step == args.step]
        if not statuses:
            raise LookupError(f"job {engine.job!r} has no checkpoint {args.step} (its checkpoints: {steps})")
    failures = 0
    for status in statuses:
        failures += await _verify_step(engine, status)
    return 1 if failures else 0


async def _verify_step(engine: Engine, status: CheckpointStatus) -> int:
    """Verify one checkpoint on its tiers and in the index, print what was found; the damage counted."""
    from tqdm import tqdm

    from .load.verify import verify, verify_index

    step = status.step
    try:
        m = await engine.read_manifest(step)
    except TieredCkptError as e:
        print(f"step {step}: {e}")
        return 1
    failures = 0
    # the bytes verify reads: every part on each configured tier the checkpoint targets; a bar on a terminal only
    with tqdm(total=m.nbytes * len(engine.io.order(status.tiers)), unit="B", unit_scale=True, desc=f"step {step}",
              file=sys.stderr, disable=None) as bar:
        reports = await verify(engine.io, status, m, bar.update)
    for r in reports:
        state = "complete" if r.complete else "incomplete"
        verdict = "ok" if r.ok else f"{len(r.bad)} bad part(s)"
        print(f"step {step} tier {r.tier} ({state}): {r.parts} parts, {verdict}")
        for line in r.bad:
            print(f"    {line}")
        failures += (not r.ok) and r.complete
    if status.incarnation is not None:  # listed from the tiers' manifests: the index has no record to check
        return failures
    index = await verify_index(engine.index, m)
    if index.unreachable:
        print(f"step {step} index {index.index}: not checked ({index.unreachable})")
        return failures
    verdict = "ok" if index.ok else f"{len(index.bad)} bad record(s)"
    print(f"step {step} index {index.index}: manifest and {index.records - 1} rank record(s), {verdict}")
    for line in index.bad:
        print(f"    {line}")
    return failures + ((not index.ok) and status.is_complete)


async def _jobs_hint(engine: Engine) -> str:
    """"; jobs with checkpoints in <index>: a, b", so a mistyped job name shows; "" when the index can't say."""
    try:
        jobs = await engine.index.jobs()
    except TieredCkptError:
        return ""
    return f"; jobs with checkpoints in {engine.index.identity}: {', '.join(jobs) if jobs else 'none'}"


async def cmd_export(engine: Engine, args: argparse.Namespace) -> int:
    from tqdm import tqdm

    with tqdm(unit="B", unit_scale=True, desc="export", file=sys.stderr, disable=None) as bar:
        def progress(done: int, total: int) -> None:
            bar.total = total
            bar.update(done - bar.n)

        try:
            info = await engine.export(args.output, to=args.to, step=args.step, select=args.select, force=args.force,
                                       progress=progress)
        except TieredCkptError:
            raise
        except (FileExistsError, ValueError) as e:  # an existing PATH, a --select that matches nothing, a dtype
            print(f"tiered-ckpt: {e}", file=sys.stderr)
            return 2
        except OSError as e:  # PATH's folder cannot be made or written (a file in the way, no permission)
            print(f"tiered-ckpt: cannot write {args.output}: {e.strerror or e}"
                  f"{f' ({e.filename})' if e.filename else ''}", file=sys.stderr)
            return 2
    print(f"step {info.step}: {info.tensors} tensors ({format_size(info.nbytes)}) and {info.values} plain values "
          f"-> {info.path} ({info.format})")
    for line in info.skipped:
        print(f"  left out {line}")
    for f in info.fallbacks:
        print(f"  {f.part}: read from a slower tier ({f.tier}: {f.reason})")
    return 0


async def cmd_delete(engine: Engine, args: argparse.Namespace) -> int:
    exclusive = await engine.attach()  # no new incarnation: a trainer that is running is not fenced out
    status = await engine.status(args.step)
    if status is None:
        buried = args.step in await engine.index.buried(engine.job)
        hint = " (its removal was cut short: `tiered-ckpt gc` finishes it)" if buried else ""
        raise LookupError(f"job {engine.job!r} has no checkpoint {args.step}{hint}")
    if in_flight(status, exclusive=exclusive, grace=GRACE):
        print(f"tiered-ckpt: job {engine.job!r} step {args.step} is being saved (it began {_when(status.created)} "
              f"and is not complete on {', '.join(status.incomplete)}); delete it once the save is over",
              file=sys.stderr)
        return 2
    await engine.delete(args.step)
    size = "" if status.nbytes is None else f", {format_size(status.nbytes)}"
    where = ", ".join(engine.io.order(status.tiers)) or "no tier"
    print(f"deleted step {args.step} of job {engine.job!r} ({'complete' if status.is_complete else 'incomplete'}"
          f"{size}) from {where} and the index")
    return 0


async def cmd_gc(engine: Engine, args: argparse.Namespace) -> int:
    from tqdm import tqdm

    with tqdm(unit="op", desc="gc", file=sys.stderr, disable=None, leave=False) as bar:  # a bar on a terminal only
        def progress(done: int, total: int) -> None:
            bar.total = total
            bar.update(done - bar.n)

        report = await engine.gc(dry_run=args.dry_run, grace=args.grace, other_indexes=args.other_indexes,
                                 progress=progress)
    verb = "would remove" if report.dry_run else "removed"
    mode = ("no writer can be running (the job's writer lease was free)" if report.exclusive else
            f"a writer may be running: incomplete saves younger than {_age(report.grace)} are kept")
    print(f"gc of job {engine.job!r}{' (dry run: nothing changed)' if report.dry_run else ''}; {mode}")
    width = max([len(r.name) for r in report.removed] + [10])
    for r in report.removed:
        size = "" if r.nbytes is None else format_size(r.nbytes)
        print(f"  {verb} {r.tier or 'index':<8} {r.name:<{width}} {size:>10}  {r.what}")
    for line in report.kept:
        print(f"  kept {line}")
    freed = report.freed()
    if not report.removed:
        print("  nothing to remove")
    for tier in engine.io:
        count, nbytes, unknown = freed.get(tier, (0, 0, False))
        amount = "size unknown" if unknown and not nbytes else format_size(nbytes) + (" + unknown" if unknown else "")
        print(f"  {tier}: {verb} {count} item(s), {amount}")
    if report.checkpoints:
        print(f"  index: {verb} {len(report.checkpoints)} checkpoint(s): {', '.join(map(str, report.checkpoints))}")
    for line in report.errors:
        print(f"  error: {line}", file=sys.stderr)
    return 1 if report.errors else 0


def _age(seconds: float) -> str:
    return f"{seconds / 3600:g}h" if seconds >= 3600 else f"{seconds / 60:g}min" if seconds >= 60 else f"{seconds:g}s"


if __name__ == "__main__":
    sys.exit(main())
