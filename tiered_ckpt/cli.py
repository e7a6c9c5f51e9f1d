"""`tiered-ckpt ls | show STEP|best|latest | verify [STEP] | export [STEP] --to FORMAT -o PATH |
delete STEP [--dry-run] [--yes] | gc [--dry-run] | config check FILE | bench`; `--json` on ls, show, verify and gc.

Exit status: 0 ok; 1 the command ran and found or left a problem (damage, something gc could not remove);
2 nothing was done: bad arguments or config, an unknown step, no checkpoints, a refusal. The commands that
list, describe or clean up open the job's tiers and index without the save and load paths, so they start
without importing torch (docs/operations.md, *CLI*)."""
from __future__ import annotations

import argparse
import asyncio
import dataclasses
import datetime
import json
import math
import os
import sys
from typing import TYPE_CHECKING, Any, Awaitable, Callable, NoReturn

from .config import load_config
from .distributed.coordinator import Coordinator
from .errors import ConfigError, TieredCkptError, redact
from .lifecycle.busy import BusySteps
from .lifecycle.gc import GRACE, GcReport, GcScope, collect, in_flight
from .lifecycle.removal import Removal
from .lifecycle.rules import Best
from .lifecycle.writer import Writer
from .load.catalog import Catalog
from .sizes import format_size
from .storage.index import CheckpointStatus, open_index
from .storage.tier_io import TierIO

if TYPE_CHECKING:
    from .config import Config
    from .load.export import ExportInfo
    from .manifest import Manifest

EXIT_OK, EXIT_PROBLEM, EXIT_USAGE = 0, 1, 2  # docs/operations.md, *CLI*
DEFAULT_CONFIG = os.environ.get("TIERED_CKPT_CONFIG", "tiers/local.toml")
UNSET = {"keep_last": "all", "capacity": "unlimited", "keep_best": "none", "best_metric": "none", "keep_every": "none",
         "save_every_steps": "none", "save_every_seconds": "none"}  # what `config check` says of a key left unset
KEY_WIDTH = 40  # `show` aligns keys up to this width; a longer key (Lightning's) overflows its own line only
BENCH_HELP = "benchmark against torch.save, DCP, memcpy and raw disk in one run"


class Refused(Exception):
    """The command will not do what was asked (a step being saved, a question answered no): exit status 2."""


class Checkpoints:
    """One job's checkpoints, opened for the commands: its tiers (TierIO), its index and catalog, and a
    cleaner's writer role (attach, never fence), as Engine.open() wires them, without staging buffers, the
    planner or the load path. One process, one rank, no collectives. Nothing here imports torch: `ls` and
    `gc` start at once; `show`, `verify` and `export` import it when they decode or read tensors."""

    def __init__(self, config: Config):
        self.config = config
        self.job = config.engine.job
        self.coordinator = Coordinator()  # single rank
        self.io = TierIO(config.tiers, config.engine.io_threads, background_nice=config.engine.background_nice)
        self.index = open_index(config.engine.index)
        self.catalog = Catalog(self.job, self.index, self.io, adopt=config.engine.adopt)
        self.busy = BusySteps()
        self.removal = Removal(self.job, self.index, self.io, self.busy, set())
        self.writer = Writer(self.job, self.index, self.coordinator, self.removal)

    async def __aenter__(self) -> "Checkpoints":
        try:
            node, num_nodes = await self.coordinator.node()
            await self.io.open(rank=0, world_size=1, node=node, num_nodes=num_nodes)
            await self.index.open()
        except BaseException:
            self.io.shutdown()
            raise
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.io.close()
        await self.index.close()

    async def list(self) -> list[CheckpointStatus]:
        """Every checkpoint, oldest first, with size and metadata (as Engine.list)."""
        return await self.catalog.with_sizes(await self.catalog.statuses())

    async def status(self, step: int) -> CheckpointStatus | None:
        found = [s for s in await self.catalog.statuses() if s.step == step]
        return (await self.catalog.with_sizes(found))[0] if found else None

    async def latest(self) -> CheckpointStatus:
        """The checkpoint load() takes: the newest complete one that can be loaded."""
        return (await self.catalog.with_sizes([await self.catalog.pick(None, self.io.names)]))[0]

    async def best(self) -> CheckpointStatus:
        """The checkpoint load(best=True) takes (as Engine.best)."""
        return (await self.catalog.with_sizes([await self.catalog.pick(None, self.io.names, self.best_rule())]))[0]

    def best_rule(self) -> Best:
        return Best.required(self.config)

    async def read_manifest(self, step: int, tiers: list[str] | tuple[str, ...] | None = None) -> Manifest:
        return await self.catalog.read_manifest(step, self.io.names if tiers is None else self.io.order(tiers))

    async def attach(self, *, hold: bool = True) -> bool:
        """Become a cleaner (Engine.attach): True when no writer can run meanwhile."""
        return await self.writer.attach(hold=hold)

    async def delete(self, step: int) -> None:
        """Delete checkpoint `step` everywhere; attach() first."""
        await self.removal.delete(step)

    async def gc(self, *, dry_run: bool, grace: float, other_indexes: bool,
                 progress: Callable[[int, int], None]) -> GcReport:
        try:
            return await collect(GcScope(self.job, self.index, self.io, self.busy, self.writer), dry_run, grace=grace,
                                 other_indexes=other_indexes, progress=progress)
        finally:
            await self.writer.detach()

    async def export(self, path: str, *, to: str, step: int | None, select: str | None, force: bool,
                     progress: Callable[[int, int], None]) -> ExportInfo:
        from .load.export import export

        return await export(self.catalog, self.io, self.busy.loading, path, to=to, step=step, select=select,
                            force=force, progress=progress)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="tiered-ckpt", description=__doc__.split("\n\n")[0])
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
    show.add_argument("step", type=_step_or_name, metavar="STEP|best|latest",
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
    gc.add_argument("--grace", type=_duration, default=GRACE, metavar="DURATION",
                    help="when a trainer may be running: keep saves that began less than this long ago, and temp "
                         "files and empty folders younger than this (default 1h; e.g. 90s, 30m, 2h)")
    gc.add_argument("--other-indexes", action="store_true", help="also remove other indexes' folders of this job "
                    "(runs that share the tier's path and job name with their own index)")
    config = sub.add_parser("config", help="configuration tools")
    config_sub = config.add_subparsers(dest="config_command", required=True)
    check = config_sub.add_parser("check", help="validate a tier stack TOML")
    check.add_argument("file")
    # the benchmark's options are parsed by bench/run.py once it is chosen: importing it imports torch
    sub.add_parser("bench", add_help=False, help=f"{BENCH_HELP} (`tiered-ckpt bench --help`: its options)")
    args, rest = parser.parse_known_args(argv)
    if rest and args.command != "bench":
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
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
    if args.command == "bench":
        from .bench.run import add_arguments, run_bench

        bench = argparse.ArgumentParser(prog="tiered-ckpt bench", description=BENCH_HELP)
        add_arguments(bench)
        return run_bench(bench.parse_args(rest))
    commands: dict[str, Callable[[Checkpoints, argparse.Namespace], Awaitable[int]]] = {
        "ls": cmd_ls, "show": cmd_show, "verify": cmd_verify, "export": cmd_export, "delete": cmd_delete,
        "gc": cmd_gc}
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
                            fn: Callable[[Checkpoints, argparse.Namespace], Awaitable[int]]) -> int:
    overrides: dict[str, Any] = {"job": args.job} if args.job else {}
    async with Checkpoints(load_config(args.config, **overrides)) as checkpoints:
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
    _print_keys(_keys(cfg.engine))
    for t in cfg.tiers:
        print(f"  [[tiers]] {t.name} (kind {t.kind})")
        _print_keys([(k, v) for k, v in _keys(t) if k not in ("name", "kind")] + _keys(t.options))
    return EXIT_OK


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


# -- --json --------------------------------------------------------------------------------------------------------
def _print_json(document: dict[str, Any]) -> None:
    """One JSON document on stdout (the schemas: docs/operations.md, *JSON output*)."""
    print(json.dumps(_jsonable(document), indent=2, allow_nan=False))


def _jsonable(value: Any) -> Any:
    """`value` as JSON can hold it: tuples as arrays, keys as strings; a float that is not finite and anything
    else JSON has no type for (bytes, a pickled object) as the text the human output shows."""
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else repr(value)
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    return _short(value, limit=sys.maxsize)


def _status_json(c: CheckpointStatus) -> dict[str, Any]:
    return {"step": c.step, "created": c.created or None, "nbytes": c.nbytes, "complete": c.is_complete,
            "tiers": list(c.tiers), "complete_on": [t for t in c.tiers if t in c.complete], "failed": dict(c.failed),
            "skipped": dict(c.skipped), "foreign": c.foreign, "metadata": c.metadata}


# -- the commands ------------------------------------------------------------------------------------------------
async def cmd_ls(checkpoints: Checkpoints, args: argparse.Namespace) -> int:
    """A job without checkpoints is no error here (an empty list): a script may ask before the first save."""
    rows = await checkpoints.list()
    if args.json:
        _print_json({"job": checkpoints.job, "index": checkpoints.index.identity,
                     "checkpoints": [_status_json(c) for c in rows]})
        return EXIT_OK
    if not rows:
        print(f"job {checkpoints.job!r}: no checkpoints{await _jobs_hint(checkpoints)}")
        return EXIT_OK
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
    return EXIT_OK


def _step_or_name(text: str) -> int | str:
    if text in ("best", "latest"):
        return text
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a step (an integer), best or latest, got {text!r}") from None


async def cmd_show(checkpoints: Checkpoints, args: argparse.Namespace) -> int:
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
    values = _plain_values(m.skeleton_of(0))
    if args.json:
        _print_json({**_status_json(status), "job": m.job, "created": m.created, "format": m.version,
                     "nbytes": m.nbytes, "parts": sum(len(r.checksums) for r in m.ranks), "part_size": m.part_size,
                     "checksum": m.checksum, "world_size": m.world_size, "best": best, "metadata": m.metadata,
                     "values": dict(values),
                     "tensors": [{"path": t.path, "dtype": t.dtype.removeprefix("torch."), "shape": list(t.shape),
                                  "nbytes": sum(c.nbytes for c in t.chunks)} for t in m.tensors]})
        return EXIT_OK
    if headline:
        print(headline)
    print(f"job {m.job!r} step {m.step}  created {_when(m.created)}  format v{m.version}")
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
            print(f"    {str(key):<{width}} = {_short(value)}")
    if values:
        print(f"  values{' (rank 0)' if m.world_size > 1 else ''}:")
        for path, value in shown_values:
            print(f"    {path:<{width}} = {_short(value)}")
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


def _plain_values(skeleton_bytes: bytes) -> list[tuple[str, Any]]:
    """The saved skeleton's plain values (not tensors), by path: dicts and lists of containers are opened,
    a list or tuple of plain values is one value."""
    from .state import PerRankMark, Pickled, TensorAlias, TensorRef, decode_skeleton, path_str  # imports torch

    out: list[tuple[str, Any]] = []

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
        out.append((path_str(path), _PickledValue(len(node.data)) if isinstance(node, Pickled) else node))

    try:
        walk(decode_skeleton(skeleton_bytes), ())
    finally:
        del walk  # a nested function that calls itself is a reference cycle (see tiered_ckpt.state)
    return out


@dataclasses.dataclass(frozen=True)
class _PickledValue:
    """A plain value saved pickled (allow_pickle): shown by its size, never unpickled."""

    nbytes: int

    def __repr__(self) -> str:
        return f"<pickled, {self.nbytes} bytes>"


def _short(value: Any, limit: int = 100) -> str:
    if isinstance(value, bytes) and len(value) > 32:
        return f"<{len(value)} bytes>"
    text = repr(value)
    return text if len(text) <= limit else text[:limit - 3] + "..."


async def cmd_verify(checkpoints: Checkpoints, args: argparse.Namespace) -> int:
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
        _print_json({"job": checkpoints.job, "index": checkpoints.index.identity, "ok": ok, "checkpoints": entries})
    return EXIT_OK if ok else EXIT_PROBLEM


async def _verify_step(checkpoints: Checkpoints, status: CheckpointStatus) -> dict[str, Any]:
    """Verify one checkpoint on its tiers and in the index: its entry of `verify --json`. It is "ok" unless a
    copy is damaged where the checkpoint is complete (bad parts where it is incomplete are only reported)."""
    from tqdm import tqdm

    from .load.verify import verify, verify_index

    step = status.step
    entry: dict[str, Any] = {"step": step, "ok": True, "error": None, "tiers": [], "index": None}
    try:
        m = await checkpoints.read_manifest(step)
    except TieredCkptError as e:
        entry.update(ok=False, error=str(e))
        return entry
    # the bytes verify reads: every part on each configured tier the checkpoint targets; a bar on a terminal only
    with tqdm(total=m.nbytes * len(checkpoints.io.order(status.tiers)), unit="B", unit_scale=True,
              desc=f"step {step}", file=sys.stderr, disable=None) as bar:
        reports = await verify(checkpoints.io, status, m, bar.update)
    entry["tiers"] = [{"tier": r.tier, "complete": r.complete, "parts": r.parts, "ok": r.ok, "bad": list(r.bad)}
                      for r in reports]
    damaged = any(not r.ok and r.complete for r in reports)
    if status.incarnation is None:  # else listed from the tiers' manifests: the index has no record to check
        index = await verify_index(checkpoints.index, m)
        checked = index.unreachable is None
        entry["index"] = {"index": index.index, "checked": checked, "unreachable": index.unreachable,
                          "rank_records": index.records - 1 if checked else None, "ok": index.ok if checked else None,
                          "bad": list(index.bad)}
        damaged = damaged or (not index.ok and status.is_complete)
    entry["ok"] = not damaged
    return entry


def _print_verified(entry: dict[str, Any]) -> None:
    step = entry["step"]
    if entry["error"] is not None:
        print(f"step {step}: {entry['error']}")
        return
    for r in entry["tiers"]:
        verdict = "ok" if r["ok"] else f"{len(r['bad'])} bad part(s)"
        print(f"step {step} tier {r['tier']} ({'complete' if r['complete'] else 'incomplete'}): {r['parts']} parts, "
              f"{verdict}")
        for line in r["bad"]:
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


async def _jobs_hint(checkpoints: Checkpoints) -> str:
    """"; jobs with checkpoints in <index>: a, b", so a mistyped job name shows; "" when the index can't say."""
    try:
        jobs = await checkpoints.index.jobs()
    except TieredCkptError:
        return ""
    return f"; jobs with checkpoints in {checkpoints.index.identity}: {', '.join(jobs) if jobs else 'none'}"


async def cmd_export(checkpoints: Checkpoints, args: argparse.Namespace) -> int:
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


async def cmd_delete(checkpoints: Checkpoints, args: argparse.Namespace) -> int:
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
    await checkpoints.delete(args.step)
    print(f"deleted {_deletion(checkpoints, status)}")
    return EXIT_OK


async def _deletable(checkpoints: Checkpoints, step: int, *, hold: bool) -> CheckpointStatus:
    """The checkpoint `delete STEP` may remove: it exists and no running save may still write it."""
    # first without the lease: taking it writes the job's lease file, which a step or job that does not exist
    # (a mistyped --job, the wrong folder) must not leave behind, as status 2 means nothing was done
    if await checkpoints.status(step) is None:
        await _no_checkpoint(checkpoints, step)
    exclusive = await checkpoints.attach(hold=hold)  # no new incarnation: a running trainer is not fenced out
    status = await checkpoints.status(step)  # again, under the lease: it may have gone meanwhile
    if status is None:
        await _no_checkpoint(checkpoints, step)
    if in_flight(status, exclusive=exclusive, grace=GRACE):
        raise Refused(f"job {checkpoints.job!r} step {step} is being saved (it began {_when(status.created)} and is "
                      f"not complete on {', '.join(status.incomplete)}); delete it once the save is over")
    return status


async def _no_checkpoint(checkpoints: Checkpoints, step: int) -> NoReturn:
    buried = step in await checkpoints.index.buried(checkpoints.job)
    hint = " (its removal was cut short: `tiered-ckpt gc` finishes it)" if buried else ""
    raise LookupError(f"job {checkpoints.job!r} has no checkpoint {step}{hint}")


def _deletion(checkpoints: Checkpoints, status: CheckpointStatus) -> str:
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


async def cmd_gc(checkpoints: Checkpoints, args: argparse.Namespace) -> int:
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
        _print_json({"job": checkpoints.job, "dry_run": report.dry_run, "exclusive": report.exclusive,
                     "grace": report.grace, "removed": [dataclasses.asdict(r) for r in report.removed],
                     "checkpoints": report.checkpoints, "kept": report.kept, "errors": report.errors,
                     "freed": {tier: dict(zip(("items", "nbytes", "unknown_sizes"), freed.get(tier, (0, 0, False))))
                               for tier in checkpoints.io}})
        return EXIT_PROBLEM if report.errors else EXIT_OK
    verb = "would remove" if report.dry_run else "removed"
    mode = ("no writer can be running (the job's writer lease was free)" if report.exclusive else
            f"a writer may be running: incomplete saves younger than {_age(report.grace)} are kept")
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


def _age(seconds: float) -> str:
    return f"{seconds / 3600:g}h" if seconds >= 3600 else f"{seconds / 60:g}min" if seconds >= 60 else f"{seconds:g}s"


if __name__ == "__main__":
    sys.exit(main())
