"""TOML (tomllib) → frozen dataclasses. Every error names the file and the key at fault."""
from __future__ import annotations

import dataclasses
import importlib.util
import math
import os
import re
import tomllib
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

from .errors import ConfigError, redact
from .sizes import format_size, parse_size
from .tier_kinds import driver_class


def bounds(*, size: bool = False, why: str = "", **limits: float) -> dict[str, Any]:
    """Field metadata of a config dataclass (drivers' Options write the same keys as a plain dict): `size`
    accepts "64MiB"-style strings; `min` (inclusive), `above` (exclusive) and `max` bound the number; `why`
    says why in the error. Every float must also be finite (check_ranges)."""
    return {"size": size, "why": why, **limits}


# one server, a Redis Cluster, or the master a Sentinel names (storage/redis_connect.py); rediss: with TLS
REDIS_SCHEMES = ("redis://", "rediss://", "unix://", "redis+cluster://", "rediss+cluster://", "redis+sentinel://",
                 "rediss+sentinel://")
INDEX_SCHEMES = ("file://", *REDIS_SCHEMES)
NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")  # fullmatch: no trailing newline slips through


@dataclass(frozen=True)
class EngineConfig:
    """The `[engine]` table: the job, its index, part size and the engine's limits (docs/configuration.md
    describes every key)."""

    job: str = "default"
    index: str = "file://./checkpoints/index"
    part_size: int = field(default=64 * 2**20, metadata=bounds(size=True, min=4096))
    max_inflight: int = field(default=1, metadata=bounds(min=1))
    # host memory of one machine that the job's checkpointing fits in (save/host_budget.py): staging, the memory
    # tiers' checkpoints (their keep_last gives way) and read buffers of every rank there; None: no budget
    host_memory: int | None = field(default=None, metadata=bounds(size=True, min=1, why="omit it for no budget"))
    allow_pickle: bool = False
    adopt: bool = False  # load checkpoints whose manifests name another index (a moved or rebuilt index)
    io_threads: int = field(default=4, metadata=bounds(min=1))
    # GPU memory per device that saves keep to gather small tensors before one copy to host (save/gather.py); 0: off
    gpu_gather: int = field(default=128 * 2**20, metadata=bounds(size=True, min=0))
    # background work (checksums, tier I/O) runs this much nicer than the process: a contended core goes to
    # training; 0 keeps the process's priority
    background_nice: int = field(default=10, metadata=bounds(min=0, max=19))
    collective_timeout: float = field(default=600.0, metadata=bounds(above=0))
    commit_timeout: float = field(default=600.0, metadata=bounds(above=0))
    # seconds one call to a Redis index may go unanswered (a frozen or overloaded server) before it fails with
    # IndexUnavailable naming the index: the longest a stalled index holds a save, and so the training loop
    index_timeout: float = field(default=10.0, metadata=bounds(above=0))
    # training stops (the next save() raises SaveError) once this many saves in a row committed on no tier at all;
    # a save complete on some tier while others failed is a checkpoint, and training goes on (save/failures.py)
    stop_after_failed_saves: int = field(default=3, metadata=bounds(min=1))
    # a memory tier first in the stack (every = 1, keep_last set) is the staging buffer: one copy to safe
    stage_in_memory_tier: bool = True
    checksum: str = "auto"  # of parts in new checkpoints: auto (xxh3 when xxhash is installed), xxh3, crc32c
    # false: ignore torch.distributed's default process group and act as a world of one rank (rank 0 of 1),
    # with no collectives: one process saves the full state (e.g. Lightning's global rank 0), others only load
    distributed: bool = True
    # when should_save(step) says yes (save/policy.py): every N steps, every T seconds (rank 0's clock), on SIGTERM
    save_every_steps: int | None = field(default=None, metadata=bounds(min=1, why="omit it for no step rule"))
    save_every_seconds: float | None = field(default=None, metadata=bounds(above=0, why="omit it for no time rule"))
    save_on_sigterm: bool = False
    # a load whose newest complete checkpoint is lost (its parts gone from every tier: nodes lost with their memory
    # and disks): "previous" loads the newest older one that can be loaded, and raises CheckpointLost when none can;
    # "error" raises CheckpointLost at once (a person decides); "fresh" is "previous", but where none can be
    # loaded it raises IncompleteCheckpoint, as when nothing was saved, so a program starts fresh unattended. The
    # first save after such a load removes the lost checkpoints, so the run can save their steps again
    on_lost: str = "previous"
    # after a load, rewrite in the background the cache copies (memory tier, peer ring) that node loss took
    heal: bool = True
    # "writer": open() makes this process the job's writer (a second trainer fails there, naming the holder);
    # "reader": it never saves, deletes nor fences (an evaluator beside the trainer); "auto": a reader until its
    # first save
    role: str = "auto"
    # observability (observe/, docs/operations.md): every save, load and removal appended to this file as one line
    # of JSON ("{rank}" in the path: the rank)
    events_log: str | None = None
    # Prometheus metrics served on this port (+ LOCAL_RANK) at metrics_addr; 0: off (needs the extra `prometheus`)
    metrics_port: int = field(default=0, metadata=bounds(min=0, max=65535, why="0 turns the metrics server off"))
    metrics_addr: str = "0.0.0.0"  # the address the metrics server listens on ("127.0.0.1": this machine only)
    # "auto" (default) and "on": once the memory tier (the staging buffer's files) committed a save, the node agent
    # writes and commits the slower tiers, so they complete if the trainer dies (agent/); "auto" falls back to the
    # trainer's own drain where the agent cannot act (no memory tier staging, an index without fencing), "on"
    # refuses to open there; "off": the trainer writes every tier itself
    agent: str = "auto"


@dataclass(frozen=True)
class TierConfig:
    """One `[[tiers]]` entry: the driver (`kind`), its retention and its pipeline's limits; the driver's own
    keys are in `options` (docs/configuration.md, docs/tiers.md)."""

    name: str
    kind: str
    keep_last: int | None = field(default=None, metadata=bounds(min=1, why="omit it to keep every checkpoint"))
    # beside keep_last (lifecycle/rules.py): the keep_best best by metadata[best_metric], and every keep_every-th step
    keep_best: int | None = field(default=None, metadata=bounds(min=1, why="omit it to keep no best checkpoints"))
    best_metric: str | None = None  # a key of the metadata given to save(); required with keep_best
    best_mode: str = "min"  # "min": the lowest value is the best; "max": the highest
    keep_every: int | None = field(default=None, metadata=bounds(min=1, why="omit it to keep no step for ever"))
    every: int = field(default=1, metadata=bounds(min=1))
    workers: int = field(default=4, metadata=bounds(min=1))
    inflight: int = field(default=256 * 2**20, metadata=bounds(size=True, min=1))
    retries: int = field(default=3, metadata=bounds(min=0))
    # seconds before the first retry; doubled for each next one (at most 10 s), with jitter
    backoff: float = field(default=0.2, metadata=bounds(min=0))
    timeout: float = field(default=300.0, metadata=bounds(above=0))
    skip_when_behind: bool = True  # a save still waiting for the tier when a newer one arrives is skipped there
    # a failure of this tier fails the save and stops training (the next save() raises); by default a tier's failure
    # is that tier's alone, while another tier commits the checkpoint
    required: bool = False
    options: Any = None  # the driver's own frozen Options dataclass


@dataclass(frozen=True)
class Config:
    """A whole configuration: the engine's keys and the tiers, fastest first; `source` names the file it came
    from (errors quote it). Build one with `load_config(path)` (or `tiered_ckpt.config.parse_config(dict)`)."""

    engine: EngineConfig
    tiers: tuple[TierConfig, ...]
    source: str | None = None

    def replace_engine(self, **overrides: Any) -> "Config":
        """A copy with some `[engine]` keys replaced, checked as a file's would be."""
        merged = {f.name: getattr(self.engine, f.name) for f in dataclasses.fields(EngineConfig)}
        unknown = set(overrides) - set(merged)
        if unknown:
            raise ConfigError(f"unknown engine override(s) {sorted(unknown)}", key="engine", file=self.source)
        merged.update(overrides)
        engine = build(EngineConfig, merged, "engine", self.source)
        _check_engine(engine, self.source)
        return dataclasses.replace(self, engine=engine)


RESERVED_TIER_NAMES = ("index",)  # a status's `failed` names the index this way (an unreadable record)


def validate_name(value: str, what: str) -> str:
    """Job and tier names become path components and key prefixes: no '/', no '..'."""
    if not isinstance(value, str) or not NAME.fullmatch(value) or ".." in value:
        raise ConfigError(f"{what} {value!r} must be 1-128 of [A-Za-z0-9._-], not starting with '.' or '-'")
    if what == "tier name" and value in RESERVED_TIER_NAMES:
        raise ConfigError(f"{what} {value!r} is reserved (a checkpoint's status names the index so); name the tier "
                          f"otherwise")
    return value


def load_config(path: str | os.PathLike[str], **overrides: Any) -> Config:
    """Read a TOML file into a Config; `overrides` replace `[engine]` keys (e.g. job="gpt")."""
    file = str(path)
    try:
        with open(path, "rb") as f:
            raw = tomllib.load(f)
    except FileNotFoundError:
        raise ConfigError("file not found", file=file) from None
    except IsADirectoryError:
        raise ConfigError("is a directory, not a TOML file", file=file) from None
    except OSError as e:
        raise ConfigError(f"cannot be read: {e.strerror or e}", file=file) from None
    except UnicodeDecodeError as e:
        raise ConfigError(f"is not UTF-8 text (byte {e.start} is {e.object[e.start:e.start + 1]!r}); TOML files are "
                          f"UTF-8", file=file) from None
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"invalid TOML: {e}", file=file) from None
    config = parse_config(raw, source=file)
    return config.replace_engine(**overrides) if overrides else config


def parse_config(raw: Mapping[str, Any], source: str | None = None) -> Config:
    """Build a Config from an already-parsed mapping (the shape of the TOML file)."""
    raw = _expand_env(raw, "", source)
    unknown = set(raw) - {"engine", "tiers"}
    if unknown:
        key = sorted(unknown)[0]
        raise ConfigError("unknown top-level key (expected [engine] and [[tiers]])", key=key, file=source)
    engine_raw = raw.get("engine", {})
    if not isinstance(engine_raw, dict):
        raise ConfigError("must be a table", key="engine", file=source)
    engine = build(EngineConfig, engine_raw, "engine", source)
    _check_engine(engine, source)
    tiers_raw = raw.get("tiers", [])
    if not isinstance(tiers_raw, list) or not tiers_raw:
        raise ConfigError("at least one [[tiers]] table is required", key="tiers", file=source)
    tiers = tuple(_parse_tier(t, i, source) for i, t in enumerate(tiers_raw))
    _check_distinct(tiers, source)
    _check_one_best_metric(tiers, source)
    config = Config(engine=engine, tiers=tiers, source=source)
    _check_host_memory(config)
    return config


def check_config(config: Config) -> None:
    """The checks parse_config makes, for a Config built in code (dataclasses.replace, EngineConfig(...))."""
    _check_engine(config.engine, config.source)
    for tier in config.tiers:
        try:
            validate_name(tier.name, "tier name")
        except ConfigError as e:
            raise ConfigError(str(e), key=f"tiers.{tier.name}.name", file=config.source) from None
        _check_tier(tier, driver_class(tier.kind), f"tiers.{tier.name}", config.source)
    _check_distinct(config.tiers, config.source)
    _check_one_best_metric(config.tiers, config.source)
    _check_host_memory(config)


def _check_distinct(tiers: tuple[TierConfig, ...], source: str | None) -> None:
    """Each tier its own name and its own storage: two tiers writing one folder (or one bucket prefix, one Redis
    key prefix) would each take the other's checkpoints for leftovers, and their retention remove them."""
    names: set[str] = set()
    storages: dict[tuple[object, ...], str] = {}  # where → the tier that keeps its data there
    for tier in tiers:
        if tier.name in names:
            raise ConfigError(f"tier name {tier.name!r} is used twice", key="tiers.name", file=source)
        names.add(tier.name)
        where = _storage_of(tier)
        if where is None:
            continue
        if where in storages:
            raise ConfigError(f"tier {tier.name!r} uses the same storage as tier {storages[where]!r} "
                              f"({_describe_storage(where)}): give each tier its own", key=f"tiers.{tier.name}."
                              f"{'path' if where[0] == 'file' else 'prefix'}", file=source)
        storages[where] = tier.name


def _storage_of(tier: TierConfig) -> tuple[object, ...] | None:
    """Where a tier keeps its data, comparable between tiers (None: a kind this check does not know)."""
    options = tier.options
    if tier.kind in ("memory", "local", "faulty"):
        return "file", os.path.normpath(os.path.abspath(options.path))
    if tier.kind == "redis":
        return "redis", frozenset(options.urls), options.prefix
    if tier.kind == "s3":
        return "s3", options.endpoint_url, options.bucket, options.prefix.strip("/")
    return None


def _describe_storage(where: tuple[object, ...]) -> str:
    if where[0] == "file":
        return f"path {where[1]}"
    if where[0] == "redis":
        return f"Redis {', '.join(sorted(where[1]))} with prefix {where[2]!r}"  # type: ignore[arg-type]
    return f"bucket {where[2]!r} with prefix {where[3]!r}"


def _check_host_memory(config: Config) -> None:
    """A memory tier under a host_memory budget keeps a bounded number of checkpoints: keep_every's grow for ever."""
    if config.engine.host_memory is None:
        return
    for tier in config.tiers:
        if tier.kind == "memory" and tier.keep_every is not None:
            raise ConfigError("a memory tier cannot keep_every while [engine] host_memory is set: those checkpoints "
                              "would grow without bound in RAM; keep them on a disk or S3 tier",
                              key=f"tiers.{tier.name}.keep_every", file=config.source)


ROLES = ("auto", "writer", "reader")
ON_LOST = ("previous", "error", "fresh")
AGENT_MODES = ("auto", "on", "off")


def _check_engine(engine: EngineConfig, source: str | None) -> None:
    check_ranges(engine, "engine", source)
    try:
        validate_name(engine.job, "job")
    except ConfigError as e:
        raise ConfigError(str(e), key="engine.job", file=source) from None
    if not engine.index.startswith(INDEX_SCHEMES):
        raise ConfigError("index must be file://PATH, redis://HOST:PORT/DB, redis+cluster://HOST:PORT[,HOST:PORT...] "
                          "or redis+sentinel://HOST:PORT[,HOST:PORT...]/MASTER/DB", key="engine.index", file=source)
    if engine.index.startswith("file://") and not engine.index.removeprefix("file://").strip():
        raise ConfigError("file:// names no folder (it would be the current one): give file://PATH",
                          key="engine.index", file=source)
    if engine.index.startswith(("redis://", "rediss://")):  # (the rest of the URL is checked as the index opens)
        host_and_path = engine.index.partition("://")[2].rpartition("@")[2].partition("?")[0]
        db = host_and_path.partition("/")[2].strip("/")
        if db and not db.isdigit():  # redis-py would drop it silently: database 0, perhaps another job's index
            raise ConfigError(f"{redact(engine.index)}: the path names the database, a number (/0, /1, ...), not "
                              f"/{db}", key="engine.index", file=source)
    if engine.on_lost not in ON_LOST:
        raise ConfigError(f"on_lost must be one of {', '.join(ON_LOST)}, got {engine.on_lost!r}", key="engine.on_lost",
                          file=source)
    if engine.agent not in AGENT_MODES:
        raise ConfigError(f"agent must be one of {', '.join(AGENT_MODES)}, got {engine.agent!r}", key="engine.agent",
                          file=source)
    if engine.role not in ROLES:
        raise ConfigError(f"role must be one of {', '.join(ROLES)}, got {engine.role!r}", key="engine.role", file=source)
    if engine.events_log is not None and not engine.events_log.strip():
        raise ConfigError("names no file: give a path, or omit it for no events log", key="engine.events_log",
                          file=source)
    if engine.metrics_port and importlib.util.find_spec("prometheus_client") is None:
        raise ConfigError("metrics need the prometheus_client package: pip install -e '.[prometheus]' from a clone "
                          "(or pip install 'prometheus_client>=0.20'); 0 or no metrics_port turns metrics off",
                          key="engine.metrics_port", file=source)
    from .checksum import available

    if engine.checksum != "auto" and engine.checksum not in available():
        raise ConfigError(f"must be auto or one of {available()} (xxh3 needs the xxhash package)",
                          key="engine.checksum", file=source)


def _parse_tier(table: Any, i: int, source: str | None) -> TierConfig:
    where = f"tiers[{i}]"
    if not isinstance(table, dict):
        raise ConfigError("must be a table", key=where, file=source)
    for required in ("name", "kind"):
        if required not in table:
            raise ConfigError("is required", key=f"{where}.{required}", file=source)
    where = f"tiers.{table['name']}"
    try:
        validate_name(table["name"], "tier name")
        cls = driver_class(table["kind"])
    except ConfigError as e:
        raise ConfigError(str(e), key=f"{where}.kind" if "kind" in str(e) else f"{where}.name", file=source) from None
    common = {f.name for f in dataclasses.fields(TierConfig)} - {"options"}
    # an unknown key is named with every key this table accepts: the driver's and those every tier has
    options = build(cls.Options, {k: v for k, v in table.items() if k not in common}, where, source, also=common)
    tier = dataclasses.replace(build(TierConfig, {k: v for k, v in table.items() if k in common}, where, source),
                               options=options)
    _check_tier(tier, cls, where, source)
    return tier


def _check_tier(tier: TierConfig, driver: type, where: str, source: str | None) -> None:
    """The common keys' ranges, the retention rules, the driver's options' ranges, then the driver's own checks
    of its options."""
    check_ranges(tier, where, source)
    _check_retention(tier, where, source)
    if not isinstance(tier.options, getattr(driver, "Options", object)):
        raise ConfigError(f"options must be a {driver.Options.__name__} (the {tier.kind} driver's), got "
                          f"{type(tier.options).__name__}", key=f"{where}.options", file=source)
    if dataclasses.is_dataclass(tier.options):
        check_ranges(tier.options, where, source)
    check_options = getattr(driver, "check_options", None)
    if check_options is not None:
        try:
            check_options(tier.name, tier.options)
        except ConfigError as e:
            raise ConfigError(e.message, key=e.key or where, file=source) from None


def _check_retention(tier: TierConfig, where: str, source: str | None) -> None:
    """keep_best goes with best_metric (each alone means nothing), best_mode is min or max, and the rules beside
    keep_last need keep_last: without it the tier keeps every checkpoint already."""
    if tier.keep_best is not None and tier.best_metric is None:
        raise ConfigError("is required with keep_best: the key of save()'s metadata that ranks checkpoints",
                          key=f"{where}.best_metric", file=source)
    if tier.best_metric is not None and tier.keep_best is None:
        raise ConfigError("needs keep_best (how many of the best checkpoints to keep on this tier)",
                          key=f"{where}.best_metric", file=source)
    if tier.best_metric is not None and not (isinstance(tier.best_metric, str) and tier.best_metric):
        raise ConfigError("must be a non-empty key of save()'s metadata", key=f"{where}.best_metric", file=source)
    if tier.best_mode not in ("min", "max"):
        raise ConfigError(f"must be \"min\" (the lowest value is the best) or \"max\", got {tier.best_mode!r}",
                          key=f"{where}.best_mode", file=source)
    for key in ("keep_best", "keep_every"):
        if getattr(tier, key) is not None and tier.keep_last is None:
            raise ConfigError("needs keep_last: without keep_last the tier keeps every checkpoint already (keep_last "
                              "= 1 keeps only the newest beside the ones this rule keeps)", key=f"{where}.{key}",
                              file=source)


def _check_one_best_metric(tiers: typing.Sequence[TierConfig], source: str | None) -> None:
    """Every tier that keeps the best ones means the same by "best": load(best=True) picks by it."""
    first: TierConfig | None = None
    for tier in tiers:
        if tier.best_metric is None:
            continue
        if first is None:
            first = tier
        elif (tier.best_metric, tier.best_mode) != (first.best_metric, first.best_mode):
            raise ConfigError(f"best_metric {tier.best_metric!r} ({tier.best_mode}) differs from tier {first.name!r}'s "
                              f"{first.best_metric!r} ({first.best_mode}): a job has one metric, by which "
                              f"load(best=True) picks", key=f"tiers.{tier.name}.best_metric", file=source)


def check_ranges(obj: Any, where: str, source: str | None) -> None:
    """Every number of config dataclass `obj` in its range: a float finite (nan and inf are never meant), and
    within the bounds its field's metadata declares (`min`, `above`, `max`). Out of range: a ConfigError
    naming the key, so a zero that would make nothing work (a semaphore of 0, a chunk of 0 bytes) is refused
    before anything runs."""
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            continue
        problem = _out_of_range(value, f.metadata)
        if problem:
            why = f.metadata.get("why")
            raise ConfigError(f"{problem}{f' ({why})' if why else ''}", key=f"{where}.{f.name}", file=source)


def _out_of_range(value: float, meta: Mapping[str, Any]) -> str | None:
    def shown(n: float) -> str:
        if meta.get("size") and n >= 1024:
            return f"{format_size(n).replace('.00 ', ' ')} ({n} bytes)"
        return f"{n:g}" if isinstance(n, float) else str(n)

    if isinstance(value, float) and not math.isfinite(value):
        return f"must be a finite number, got {value}"
    if "min" in meta and value < meta["min"]:
        return f"must be at least {shown(meta['min'])}, got {shown(value)}"
    if "above" in meta and not value > meta["above"]:
        return f"must be more than {shown(meta['above'])}, got {shown(value)}"
    if "max" in meta and value > meta["max"]:
        return f"must be at most {shown(meta['max'])}, got {shown(value)}"
    return None


def build(cls: type, table: Mapping[str, Any], where: str, source: str | None,
          also: typing.Iterable[str] = ()) -> Any:
    """Type-check `table` against dataclass `cls`; unknown keys and wrong types name the key. `also`: keys the
    same table accepts for another dataclass (a tier's common keys beside its driver's), listed as known too."""
    fields = {f.name: f for f in dataclasses.fields(cls) if f.name != "options"}
    hints = typing.get_type_hints(cls)
    values: dict[str, Any] = {}
    for key, value in table.items():
        if key not in fields:
            known = ", ".join(sorted({*fields, *also}))
            raise ConfigError(f"unknown key (known: {known})", key=f"{where}.{key}", file=source)
        try:
            values[key] = _coerce(value, hints[key], fields[key].metadata.get("size", False))
        except (TypeError, ValueError) as e:
            raise ConfigError(str(e), key=f"{where}.{key}", file=source) from None
    missing = [n for n, f in fields.items() if n not in values and _no_default(f)]
    if missing:
        raise ConfigError("is required", key=f"{where}.{missing[0]}", file=source)
    return cls(**values)


def _no_default(f: dataclasses.Field) -> bool:
    return f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING


def _coerce(value: Any, hint: Any, is_size: bool) -> Any:
    args = typing.get_args(hint)
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        hint = next(a for a in args if a is not type(None))
        args = typing.get_args(hint)
    if is_size:
        return parse_size(value)
    origin = typing.get_origin(hint)
    if origin in (tuple, list):
        if not isinstance(value, list):
            raise TypeError(f"expected a list, got {type(value).__name__} {redact(repr(value))}")
        return tuple(_coerce(v, args[0], False) for v in value)
    if hint is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if hint in (str, int, float, bool) and (type(value) is not hint):
        raise TypeError(f"expected {hint.__name__}, got {type(value).__name__} {redact(repr(value))}")
    return value


_ENV = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)\}")


def _expand_env(value: Any, where: str, source: str | None) -> Any:
    """Replace ${VAR} in every string; an unset variable is an error naming the key."""
    if isinstance(value, dict):
        return {k: _expand_env(v, f"{where}.{k}" if where else k, source) for k, v in value.items()}
    if isinstance(value, list):
        return [_expand_env(v, f"{where}[{i}]", source) for i, v in enumerate(value)]
    if isinstance(value, str):
        def sub(m: re.Match[str]) -> str:
            if m.group(1) not in os.environ:
                raise ConfigError(f"environment variable ${{{m.group(1)}}} is not set", key=where, file=source)
            return os.environ[m.group(1)]
        return _ENV.sub(sub, value)
    return value


def index_path(url: str) -> Path:
    """file://./x → Path("./x"); file:///abs → Path("/abs")."""
    return Path(url.removeprefix("file://"))
