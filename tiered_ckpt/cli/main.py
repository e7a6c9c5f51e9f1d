"""`tiered-ckpt`: the command line parsed, a command run, its errors turned into one line and an exit status."""
from __future__ import annotations

import argparse
import asyncio
import math
import os
import sys
from pathlib import Path
from typing import Any, Awaitable, Callable

from ..config import load_config
from ..errors import ConfigError, TieredCkptError
from ..lifecycle.gc import GRACE
from ..storage.index import open_index
from ..job_store import JobStore
from .advise import add_arguments as advise_arguments, cmd_advise
from .free import cmd_free
from .commands import (EXIT_OK, EXIT_PROBLEM, EXIT_USAGE, Refused, cmd_delete, cmd_export, cmd_gc, cmd_ls, cmd_show,
                       cmd_verify)
from .text import config_keys, print_keys

DEFAULT_CONFIG = os.environ.get("TIERED_CKPT_CONFIG", "tiers/local.toml")


BENCH_HELP = "benchmark against torch.save, DCP, memcpy and raw disk in one run"


def main(argv: list[str] | None = None) -> int:
    usage = (sys.modules[__package__].__doc__ or "").split("\n\n")[0]  # the package's: the commands in one line
    parser = argparse.ArgumentParser(prog="tiered-ckpt", description=usage)
    config_help = "tier stack TOML (default: $TIERED_CKPT_CONFIG or tiers/local.toml)"
    parser.add_argument("-c", "--config", default=DEFAULT_CONFIG, help=config_help)
    parser.add_argument("--job", default=None, help="override [engine] job")
    sub = parser.add_subparsers(dest="command", required=True)

    def with_config(p: argparse.ArgumentParser, *, json_output: bool = False) -> argparse.ArgumentParser:
        # accepted after the subcommand too (`tiered-ckpt ls -c x.toml`); there, a value wins over one before it
        p.add_argument("-c", "--config", default=argparse.SUPPRESS, help=config_help)
        p.add_argument("--job", default=argparse.SUPPRESS, help="override [engine] job")
        if json_output:
            p.add_argument("--json", action="store_true", help="one JSON document on stdout (docs/operations.md)")
        return p

    with_config(sub.add_parser("ls", help="list checkpoints and the tiers that hold them"), json_output=True)
    show = with_config(sub.add_parser("show", help="describe one checkpoint"), json_output=True)
    show.add_argument("step", type=step_or_name, metavar="STEP|best|latest",
                      help="a step; best: the best complete checkpoint by the tiers' best_metric; latest: the newest "
                           "complete checkpoint (the one load() takes)")
    show.add_argument("--tensors", action="store_true", help="list every tensor")
    show.add_argument("--values", action="store_true", help="list every plain value")
    verify = with_config(sub.add_parser("verify", help="re-read every part on every tier and check checksums"),
                         json_output=True)
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
    delete.add_argument("--dry-run", action="store_true", help="say what would be deleted; delete nothing")
    delete.add_argument("-y", "--yes", action="store_true", help="do not ask (it asks only when stdin is a terminal)")
    gc = with_config(sub.add_parser("gc", help="remove what crashed runs left: incomplete checkpoints, stray "
                                               "folders, temp files, removals cut short (docs/operations.md)"),
                     json_output=True)
    gc.add_argument("--dry-run", action="store_true", help="print what would be removed; change nothing")
    gc.add_argument("--grace", type=duration, default=GRACE, metavar="DURATION",
                    help="when a trainer may be running: keep saves that began less than this long ago, and temp "
                         "files and empty folders younger than this (default 1h; e.g. 90s, 30m, 2h)")
    gc.add_argument("--other-indexes", action="store_true", help="also remove other indexes' folders of this job "
                    "(runs that share the tier's path and job name with their own index)")
    advise = with_config(sub.add_parser("advise", help="how often to save and to which tier, from the job's save "
                                                       "records and the failure rates you give"), json_output=True)
    advise_arguments(advise, duration)
    free = with_config(sub.add_parser("free", help="give back the host memory (RAM) a job holds in the memory tier "
                                                   "on this machine: its copies there and dead processes' staging "
                                                   "buffers (docs/operations.md, *Host memory*)"), json_output=True)
    free.add_argument("--all-jobs", action="store_true", help="every job in this user's memory tier folder")
    free.add_argument("--force", action="store_true", help="also when no other tier holds the newest checkpoint "
                      "(it is lost), and folders this index does not list; never what a live process holds")
    free.add_argument("--dry-run", action="store_true", help="print what would be freed; change nothing")
    free.add_argument("-y", "--yes", action="store_true", help="do not ask (it asks only when stdin is a terminal)")
    agent = sub.add_parser("agent", help="the node agent that drains saves to the slower tiers (`agent`: run it "
                                         "in the foreground; `agent status`: what it drains; docs/operations.md)")
    agent.add_argument("action", nargs="?", choices=["run", "status"], default="run")
    agent.add_argument("--idle", type=float, default=None, metavar="SECONDS",
                       help="exit after this long with nothing to drain and no trainer attached (default 10)")
    agent.add_argument("--json", action="store_true", help="status as one JSON document")
    config = sub.add_parser("config", help="configuration tools")
    config_sub = config.add_subparsers(dest="config_command", metavar="SUBCOMMAND", title="subcommands")
    check = config_sub.add_parser("check", help="validate a tier stack TOML")
    check.add_argument("file")
    # the benchmark's options are parsed by bench/run.py once it is chosen: importing it imports torch
    sub.add_parser("bench", add_help=False, help=f"{BENCH_HELP} (`tiered-ckpt bench --help`: its options)")
    args, rest = parser.parse_known_args(argv)
    if rest and args.command != "bench":
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    if args.command == "config" and args.config_command is None:  # its help, not argparse's internal dest name
        config.print_help(sys.stderr)
        print(f"tiered-ckpt config: error: name a subcommand ({', '.join(config_sub.choices)})", file=sys.stderr)
        return EXIT_USAGE
    try:
        status = _run(args, rest)
        sys.stdout.flush()  # here, where a reader that went away (`| head`) can be told from a failure
        return status
    except BrokenPipeError:
        return _reader_went_away()
    except (TieredCkptError, LookupError, Refused) as e:
        print(f"tiered-ckpt: {e}", file=sys.stderr)
        return EXIT_USAGE
    except OSError as e:  # the index or a tier's folder cannot be read (permissions): no traceback either
        print(f"tiered-ckpt: {e.strerror or e}{f': {e.filename}' if e.filename else ''}", file=sys.stderr)
        return EXIT_USAGE


def _run(args: argparse.Namespace, rest: list[str]) -> int:
    if args.command == "config":
        return config_check(args.file)
    if args.command == "agent":  # no config, no index: the agent learns each job's from the trainers
        from .agent import cmd_agent  # noqa: the CLI module, not the package

        return cmd_agent(args)
    if args.command == "bench":
        from ..bench.run import add_arguments, run_bench

        bench = argparse.ArgumentParser(prog="tiered-ckpt bench", description=BENCH_HELP)
        add_arguments(bench)
        return run_bench(bench.parse_args(rest))
    if args.command == "advise":  # the config and the events log only: no index, no tiers
        return cmd_advise(load_config(args.config, **({"job": args.job} if args.job is not None else {})), args)
    if args.command == "export" and not args.force:  # before the config, the index, the tiers and torch (seconds)
        out = Path(args.output)
        if out.exists() or out.is_symlink():
            raise Refused(f"{out} exists; pass --force to replace it")
    commands: dict[str, Callable[[JobStore, argparse.Namespace], Awaitable[int]]] = {
        "ls": cmd_ls, "show": cmd_show, "verify": cmd_verify, "export": cmd_export, "delete": cmd_delete,
        "gc": cmd_gc, "free": cmd_free}
    return asyncio.run(_with_checkpoints(args, commands[args.command]))


def _reader_went_away() -> int:
    """stdout's reader closed the pipe (`tiered-ckpt ls | head -1`): stop quietly, as the Python docs advise
    (output still buffered would fail again at exit, so stdout points at /dev/null from now on)."""
    try:
        fd = sys.stdout.fileno()
    except (OSError, ValueError):  # not a file (a test's capture): nothing is left to flush at exit
        return EXIT_PROBLEM
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, fd)
    os.close(devnull)
    return EXIT_PROBLEM


async def _with_checkpoints(args: argparse.Namespace,
                            fn: Callable[[JobStore, argparse.Namespace], Awaitable[int]]) -> int:
    overrides: dict[str, Any] = {"job": args.job} if args.job is not None else {}
    read_only = args.command in ("ls", "show", "verify", "export") or getattr(args, "dry_run", False)
    async with JobStore(load_config(args.config, **overrides), read_only=read_only) as checkpoints:
        return await fn(checkpoints, args)


def config_check(path: str) -> int:
    try:
        cfg = load_config(path)
        open_index(cfg.engine.index)  # parses a Redis URL and its options (nothing is connected)
    except ConfigError as e:
        print(f"invalid: {e}", file=sys.stderr)
        return EXIT_USAGE
    print(f"{path}: ok (every effective key, defaults included)")
    print("  [engine]")
    print_keys(config_keys(cfg.engine))
    for t in cfg.tiers:
        print(f"  [[tiers]] {t.name} (kind {t.kind})")
        print_keys([(k, v) for k, v in config_keys(t) if k not in ("name", "kind")] + config_keys(t.options))
    return EXIT_OK


def duration(text: str) -> float:
    """Seconds from "90", "90s", "30m", "2h", "1d"."""
    units = {"s": 1, "m": 60, "h": 3600, "d": 86400}
    try:
        value = float(text[:-1]) * units[text[-1]] if text and text[-1] in units else float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a duration like 90s, 30m or 2h, got {text!r}") from None
    if not math.isfinite(value) or value < 0:  # nan and inf: never a duration
        raise argparse.ArgumentTypeError(f"a duration must be a finite number >= 0, got {text!r}")
    return value


def step_or_name(text: str) -> int | str:
    if text in ("best", "latest"):
        return text
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a step (an integer), best or latest, got {text!r}") from None
