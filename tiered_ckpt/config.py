"""TOML (tomllib) → frozen dataclasses. Every error names the file and the key at fault."""
from __future__ import annotations

import dataclasses
import os
import re
import tomllib
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

from .errors import ConfigError
from .sizes import parse_size
from .storage.tiers.registry import driver_class

SIZE = {"size": True}  # field metadata: accept "64MiB"-style strings
# one server, a Redis Cluster, or the master a Sentinel names (storage/redis_connect.py); rediss: with TLS
REDIS_SCHEMES = ("redis://", "rediss://", "unix://", "redis+cluster://", "rediss+cluster://", "redis+sentinel://",
                 "rediss+sentinel://")
INDEX_SCHEMES = ("file://", *REDIS_SCHEMES)
NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")  # fullmatch: no trailing newline slips through


@dataclass(frozen=True)
class EngineConfig:
    job: str = "default"
    index: str = "file://./checkpoints/index"
    part_size: int = field(default=64 * 2**20, metadata=SIZE)
    max_inflight: int = 1
    allow_pickle: bool = False
    adopt: bool = False  # load checkpoints whose manifests name another index (a moved or rebuilt index)
    io_threads: int = 4
    collective_timeout: float = 600.0
    commit_timeout: float = 600.0
    # a memory tier first in the stack (every = 1, keep_last set) is the staging buffer: one copy to safe
    stage_in_memory_tier: bool = True
    checksum: str = "auto"  # of parts in new checkpoints: auto (xxh3 when xxhash is installed), xxh3, crc32c
    # false: ignore torch.distributed's default process group and act as a world of one rank (rank 0 of 1),
    # with no collectives: one process saves the full state (e.g. Lightning's global rank 0), others only load
    distributed: bool = True


@dataclass(frozen=True)
class TierConfig:
    name: str
    kind: str
    keep_last: int | None = None
    every: int = 1
    workers: int = 4
    inflight: int = field(default=256 * 2**20, metadata=SIZE)
    retries: int = 3
    backoff: float = 0.2  # seconds before the first retry; doubled for each next one (at most 10 s), with jitter
    timeout: float = 300.0
    skip_when_behind: bool = True  # a save still waiting for the tier when a newer one arrives is skipped there
    options: Any = None  # the driver's own frozen Options dataclass


@dataclass(frozen=True)
class Config:
    engine: EngineConfig
    tiers: tuple[TierConfig, ...]
    source: str | None = None

    def replace_engine(self, **overrides: Any) -> "Config":
        merged = {f.name: getattr(self.engine, f.name) for f in dataclasses.fields(EngineConfig)}
        unknown = set(overrides) - set(merged)
        if unknown:
            raise ConfigError(f"unknown engine override(s) {sorted(unknown)}", key="engine", file=self.source)
        merged.update(overrides)
        engine = build(EngineConfig, merged, "engine", self.source)
        _check_engine(engine, self.source)
        return dataclasses.replace(self, engine=engine)


def validate_name(value: str, what: str) -> str:
    """Job and tier names become path components and key prefixes: no '/', no '..'."""
    if not isinstance(value, str) or not NAME.fullmatch(value) or ".." in value:
        raise ConfigError(f"{what} {value!r} must be 1-128 of [A-Za-z0-9._-], not starting with '.' or '-'")
    return value


def load_config(path: str | os.PathLike[str], **overrides: Any) -> Config:
    """Read a TOML file into a Config; `overrides` replace `[engine]` keys (e.g. job="gpt")."""
    file = str(path)
    try:
        with open(path, "rb") as f:
            raw = tomllib.load(f)
    except FileNotFoundError:
        raise ConfigError("file not found", file=file) from None
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
    names = [t.name for t in tiers]
    for name in names:
        if names.count(name) > 1:
            raise ConfigError(f"tier name {name!r} is used twice", key="tiers.name", file=source)
    return Config(engine=engine, tiers=tiers, source=source)


def check_config(config: Config) -> None:
    """The checks parse_config makes, for a Config built in code (dataclasses.replace, EngineConfig(...))."""
    _check_engine(config.engine, config.source)
    for tier in config.tiers:
        try:
            validate_name(tier.name, "tier name")
        except ConfigError as e:
            raise ConfigError(str(e), key=f"tiers.{tier.name}.name", file=config.source) from None


def _check_engine(engine: EngineConfig, source: str | None) -> None:
    try:
        validate_name(engine.job, "job")
    except ConfigError as e:
        raise ConfigError(str(e), key="engine.job", file=source) from None
    if not engine.index.startswith(INDEX_SCHEMES):
        raise ConfigError("index must be file://PATH, redis://HOST:PORT/DB, redis+cluster://HOST:PORT[,HOST:PORT...] "
                          "or redis+sentinel://HOST:PORT[,HOST:PORT...]/MASTER/DB", key="engine.index", file=source)
    if engine.part_size < 4096:
        raise ConfigError("part_size must be at least 4KiB", key="engine.part_size", file=source)
    for key in ("max_inflight", "io_threads"):
        if getattr(engine, key) < 1:
            raise ConfigError("must be >= 1", key=f"engine.{key}", file=source)
    for key in ("collective_timeout", "commit_timeout"):
        if not getattr(engine, key) > 0:
            raise ConfigError("must be a positive number of seconds", key=f"engine.{key}", file=source)
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
    options = build(cls.Options, {k: v for k, v in table.items() if k not in common}, where, source)
    tier = build(TierConfig, {k: v for k, v in table.items() if k in common}, where, source)
    if tier.keep_last is not None and tier.keep_last < 1:
        raise ConfigError("must be >= 1 (omit it to keep every checkpoint)", key=f"{where}.keep_last", file=source)
    for key, low in (("every", 1), ("workers", 1), ("retries", 0), ("inflight", 1)):
        if getattr(tier, key) < low:
            raise ConfigError(f"must be >= {low}", key=f"{where}.{key}", file=source)
    if not tier.timeout > 0:
        raise ConfigError("must be a positive number of seconds", key=f"{where}.timeout", file=source)
    return dataclasses.replace(tier, options=options)


def build(cls: type, table: Mapping[str, Any], where: str, source: str | None) -> Any:
    """Type-check `table` against dataclass `cls`; unknown keys and wrong types name the key."""
    fields = {f.name: f for f in dataclasses.fields(cls) if f.name != "options"}
    hints = typing.get_type_hints(cls)
    values: dict[str, Any] = {}
    for key, value in table.items():
        if key not in fields:
            raise ConfigError(f"unknown key (known: {', '.join(sorted(fields))})", key=f"{where}.{key}", file=source)
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
            raise TypeError(f"expected a list, got {type(value).__name__} {value!r}")
        return tuple(_coerce(v, args[0], False) for v in value)
    if hint is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if hint in (str, int, float, bool) and (type(value) is not hint):
        raise TypeError(f"expected {hint.__name__}, got {type(value).__name__} {value!r}")
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
