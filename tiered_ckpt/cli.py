"""`tiered-ckpt ls | show STEP | verify [STEP] | export [STEP] --to FORMAT -o PATH | config check FILE | bench`."""
from __future__ import annotations

import argparse
import asyncio
import datetime
import os
import sys
from typing import Any, Awaitable, Callable

from .config import load_config
from .engine import Engine
from .errors import ConfigError, TieredCkptError
from .sizes import format_size

DEFAULT_CONFIG = os.environ.get("TIERED_CKPT_CONFIG", "tiers/local.toml")


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
    show.add_argument("step", type=int)
    show.add_argument("--tensors", action="store_true", help="list every tensor")
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
    config = sub.add_parser("config", help="configuration tools")
    config_sub = config.add_subparsers(dest="config_command", required=True)
    check = config_sub.add_parser("check", help="validate a tier stack TOML")
    check.add_argument("file")
    bench = sub.add_parser("bench", help="benchmark against torch.save, DCP, memcpy and raw disk in one run")
    from .bench.run import add_arguments

    add_arguments(bench)
    args = parser.parse_args(argv)
    try:
        if args.command == "config":
            return config_check(args.file)
        if args.command == "bench":
            from .bench.run import run_bench

            return run_bench(args)
        commands: dict[str, Callable[[Engine, argparse.Namespace], Awaitable[int]]] = {
            "ls": cmd_ls, "show": cmd_show, "verify": cmd_verify, "export": cmd_export}
        return asyncio.run(_with_engine(args, commands[args.command]))
    except (TieredCkptError, LookupError) as e:
        print(f"tiered-ckpt: {e}", file=sys.stderr)
        return 2


async def _with_engine(args: argparse.Namespace, fn: Callable[[Engine, argparse.Namespace], Awaitable[int]]) -> int:
    overrides: dict[str, Any] = {"job": args.job} if args.job else {}
    async with Engine(load_config(args.config, **overrides)) as engine:
        return await fn(engine, args)


def config_check(path: str) -> int:
    try:
        cfg = load_config(path)
    except ConfigError as e:
        print(f"invalid: {e}", file=sys.stderr)
        return 2
    e = cfg.engine
    print(f"{path}: ok\n  job={e.job} index={e.index} part_size={format_size(e.part_size)} max_inflight={e.max_inflight}")
    for t in cfg.tiers:
        keep = "all" if t.keep_last is None else t.keep_last
        print(f"  tier {t.name:<10} kind={t.kind:<7} every={t.every} keep_last={keep} {t.options}")
    return 0


def _when(ts: float) -> str:
    return datetime.datetime.fromtimestamp(ts).strftime("%Y-%m-%d %H:%M:%S") if ts else "?"


async def cmd_ls(engine: Engine, args: argparse.Namespace) -> int:
    rows = [c async for c in engine.list()]
    if not rows:
        print(f"job {engine.job!r}: no checkpoints")
        return 0
    print(f"{'step':>10}  {'created':<19}  {'state':<10}  tiers (* = complete, ! = failed)")
    for c in rows:
        marks = " ".join(f"{t}{'*' if t in c.complete else '!' if t in c.failed else ''}" for t in c.tiers)
        foreign = f"  (foreign: committed to {c.foreign})" if c.foreign else ""
        print(f"{c.step:>10}  {_when(c.created):<19}  {'complete' if c.is_complete else 'incomplete':<10}  {marks}"
              f"{foreign}")
    return 0


async def cmd_show(engine: Engine, args: argparse.Namespace) -> int:
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
    if m.metadata:
        print(f"  metadata: {m.metadata}")
    tensors = m.tensors if args.tensors else m.tensors[:20]
    for t in tensors:
        nbytes = sum(c.nbytes for c in t.chunks)
        print(f"    {t.path:<60} {t.dtype.removeprefix('torch.'):<14} {str(list(t.shape)):<20} {format_size(nbytes)}")
    if len(tensors) < len(m.tensors):
        print(f"    ... {len(m.tensors) - len(tensors)} more (--tensors lists all)")
    return 0


async def cmd_verify(engine: Engine, args: argparse.Namespace) -> int:
    from tqdm import tqdm

    from .verify import verify

    steps = [args.step] if args.step is not None else [c.step async for c in engine.list()]
    failures = 0
    for step in steps:
        try:
            m = await engine.read_manifest(step)
        except TieredCkptError as e:
            print(f"step {step}: {e}")
            failures += 1
            continue
        status = await engine.status(step)
        if status is None:
            raise LookupError(f"job {engine.job!r} has no checkpoint {step}")
        with tqdm(total=m.nbytes * len(engine.tiers), unit="B", unit_scale=True, desc=f"step {step}",
                  file=sys.stderr, disable=None) as bar:
            reports = await verify(engine.io, status, m, bar.update)
        for r in reports:
            state = "complete" if r.complete else "incomplete"
            verdict = "ok" if r.ok else f"{len(r.bad)} bad part(s)"
            print(f"step {step} tier {r.tier} ({state}): {r.parts} parts, {verdict}")
            for line in r.bad:
                print(f"    {line}")
            failures += (not r.ok) and r.complete
    return 1 if failures else 0


async def cmd_export(engine: Engine, args: argparse.Namespace) -> int:
    from tqdm import tqdm

    with tqdm(unit="B", unit_scale=True, desc="export", file=sys.stderr, disable=None) as bar:
        def progress(done: int, total: int) -> None:
            bar.total = total
            bar.update(done - bar.n)

        try:
            info = await engine.export(args.output, to=args.to, step=args.step, select=args.select, force=args.force,
                                       progress=progress)
        except (FileExistsError, ValueError) as e:  # an existing PATH, a --select that matches nothing, a dtype
            print(f"tiered-ckpt: {e}", file=sys.stderr)
            return 2
    print(f"step {info.step}: {info.tensors} tensors ({format_size(info.nbytes)}) and {info.values} plain values "
          f"-> {info.path} ({info.format})")
    for line in info.skipped:
        print(f"  left out {line}")
    for f in info.fallbacks:
        print(f"  {f.part}: read from a slower tier ({f.tier}: {f.reason})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
