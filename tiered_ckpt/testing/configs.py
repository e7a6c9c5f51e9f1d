"""One builder of test configurations: a tier stack under a folder from short specs, the engine's keys as keyword
arguments, as a Config, as the TOML file's mapping, or as a TOML file (for the CLI and for child processes).

    stack(tmp_path, "memory", "local", shm=shm_dir)                    # host in shm_dir/host, disk in tmp_path/disk
    stack(tmp_path, {"kind": "memory", "keep_last": 2}, "faulty", job="gpt", index=url)
    write_toml(tmp_path / "c.toml", stack_dict(tmp_path, "cold:local"))

A spec is a kind (`"local"`), `"name:kind"`, or a table of the tier's keys with at least `kind`. What a spec
leaves out: the name (memory → host, local and faulty → disk, redis → peer, s3 → s3), a file tier's `path`
(`<shm>/<name>` for memory, `<root>/<name>` else) and a faulty tier's `control` (`<root>/<name>.faults.json`:
`faults(config)` is its FaultControl). The engine's defaults: job "test", the file index `<root>/index`,
part_size "64KiB". A key set to None, of the engine or of a tier, is left out (the key's own default then).
"""
from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any, Mapping

from ..config import Config, parse_config
from .faults import FaultControl

NAMES = {"memory": "host", "local": "disk", "faulty": "disk", "redis": "peer", "s3": "s3"}
DEFAULT_TIERS = ("memory", "local")

Spec = str | Mapping[str, Any]


def tier_table(spec: Spec, root: str | os.PathLike[str], shm: str | os.PathLike[str] | None = None) -> dict[str, Any]:
    """One `[[tiers]]` table from its spec (the module's docstring says what is filled in)."""
    if isinstance(spec, str):
        name, _, kind = spec.rpartition(":")
        table: dict[str, Any] = {"name": name, "kind": kind} if name else {"kind": kind}
    elif isinstance(spec, Mapping) and "kind" in spec:
        table = dict(spec)
    else:
        raise ValueError(f"tier spec {spec!r}: give a kind, 'name:kind', or a table with a 'kind'")
    table = {k: v for k, v in table.items() if v is not None}  # None: leave the key out (its default)
    kind = table["kind"]
    name = table.setdefault("name", NAMES.get(kind, kind))
    if kind == "memory":
        table.setdefault("path", str(Path(shm if shm is not None else root) / name))
    elif kind in ("local", "faulty"):
        table.setdefault("path", str(Path(root) / name))
    if kind == "faulty":
        table.setdefault("control", str(Path(root) / f"{name}.faults.json"))
    return {"name": table.pop("name"), "kind": table.pop("kind"), **table}  # name and kind first, as files have them


def stack_dict(root: str | os.PathLike[str], *tiers: Spec, shm: str | os.PathLike[str] | None = None,
               **engine: Any) -> dict[str, Any]:
    """The mapping a TOML file of this stack parses to: `[engine]` and `[[tiers]]` (memory + local by default)."""
    keys = {"job": "test", "index": f"file://{root}/index", "part_size": "64KiB", **engine}
    return {"engine": {k: v for k, v in keys.items() if v is not None},
            "tiers": [tier_table(t, root, shm) for t in tiers or DEFAULT_TIERS]}


def stack(root: str | os.PathLike[str], *tiers: Spec, shm: str | os.PathLike[str] | None = None,
          **engine: Any) -> Config:
    """The Config of `stack_dict(...)`, checked as a file's would be."""
    return parse_config(stack_dict(root, *tiers, shm=shm, **engine))


def faults(config: Config | Mapping[str, Any], tier: str = "disk") -> FaultControl:
    """The FaultControl of the faulty tier named `tier` in a Config or a stack_dict."""
    if isinstance(config, Config):
        found = {t.name: getattr(t.options, "control", None) for t in config.tiers}
    else:
        found = {t["name"]: t.get("control") for t in config["tiers"]}
    if found.get(tier) is None:
        raise ValueError(f"no faulty tier named {tier!r} (tiers: {', '.join(found)})")
    return FaultControl(found[tier])


def toml_text(raw: Mapping[str, Any]) -> str:
    """A stack_dict as TOML: `[engine]`, then one `[[tiers]]` table per tier."""
    lines = ["[engine]", *(f"{k} = {_value(v)}" for k, v in raw.get("engine", {}).items())]
    for table in raw["tiers"]:
        lines += ["", "[[tiers]]", *(f"{k} = {_value(v)}" for k, v in table.items())]
    return "\n".join(lines) + "\n"


def write_toml(path: str | os.PathLike[str], raw: Mapping[str, Any]) -> Path:
    """Write a stack_dict as a TOML file at `path`; the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(toml_text(raw))
    return path


def _value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, int):
        return str(v)
    if isinstance(v, float) and math.isfinite(v):
        return repr(v)
    if isinstance(v, (str, os.PathLike)):
        return json.dumps(str(v))  # a TOML basic string: JSON's escapes are TOML's
    if isinstance(v, (list, tuple)):
        return "[" + ", ".join(_value(x) for x in v) + "]"
    raise TypeError(f"{v!r}: no TOML value for a {type(v).__name__} here")
