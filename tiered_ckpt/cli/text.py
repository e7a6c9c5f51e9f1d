"""What the commands print: config keys, sizes, times, plain values, and the JSON documents of `--json`."""
from __future__ import annotations

import dataclasses
import time
import json
import math
import sys
from typing import Any, Collection

from ..errors import redact
from ..sizes import format_size
from ..storage.index import CheckpointStatus

UNSET = {"keep_last": "all", "capacity": "unlimited", "keep_best": "none", "best_metric": "none", "keep_every": "none",
         "save_every_steps": "none", "save_every_seconds": "none"}  # what `config check` says of a key left unset


KEY_WIDTH = 40  # `show` aligns keys up to this width; a longer key (Lightning's) overflows its own line only


def config_keys(obj: Any) -> list[tuple[str, str]]:
    """A config dataclass's keys and values as the TOML would say them: sizes human, secrets hidden."""
    out = []
    for f in dataclasses.fields(obj):
        if f.name == "options":
            continue
        value = getattr(obj, f.name)
        if f.metadata.get("size") and value is not None:
            text = f"{human(value)} ({value} bytes)"
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


def print_keys(items: list[tuple[str, str]]) -> None:
    width = max((len(k) for k, _ in items), default=0)
    for key, text in items:
        print(f"    {key:<{width}} = {text}")


def human(n: int) -> str:
    """format_size, without decimals when the value is a whole number of its unit ("64 MiB", "1.50 GiB")."""
    text = format_size(n)
    return text.replace(".00 ", " ")


def local_time(ts: float) -> str:
    """Local time with its zone."""
    if not ts:
        return "?"
    local = time.localtime(ts)  # (a tenth of datetime's cost: `ls` prints ten thousand of these)
    return time.strftime("%Y-%m-%d %H:%M:%S ", local) + (time.strftime("%Z", local) or time.strftime("%z", local))


LONG_LIST = 100  # a top-level list longer than this is written one compact item a line


def print_json(document: dict[str, Any], *, ready: Collection[str] = ()) -> None:
    """One JSON document on stdout (the schemas: docs/operations.md, *JSON output*), indented; but the items of
    a long top-level list (`ls` of ten thousand checkpoints, a gc report) one a line, each compact: Python's
    indenting encoder is pure Python (0.8 s for `ls` of 10,000 checkpoints), the compact one is C. The lists
    under the keys `ready` hold items already made `jsonable` (status_json's): not walked again."""
    parts = []
    for key, value in document.items():
        value = value if key in ready else jsonable(value)
        if isinstance(value, list) and len(value) > LONG_LIST:
            items = ",\n".join(f"    {json.dumps(item, allow_nan=False)}" for item in value)
            parts.append(f"  {json.dumps(key)}: [\n{items}\n  ]")
        else:
            parts.append(f"  {json.dumps(key)}: " + json.dumps(value, indent=2, allow_nan=False).replace("\n", "\n  "))
    sys.stdout.write("{\n" + ",\n".join(parts) + "\n}\n" if parts else "{}\n")


def jsonable(value: Any) -> Any:
    """`value` as JSON can hold it: tuples as arrays, keys as strings; a float that is not finite and anything
    else JSON has no type for (bytes, a pickled object) as the text the human output shows."""
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else repr(value)
    if isinstance(value, dict):
        return {str(k): jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [jsonable(v) for v in value]
    return short(value, limit=sys.maxsize)


def status_json(c: CheckpointStatus) -> dict[str, Any]:
    """A checkpoint's entry of `ls --json`, ready for JSON (`jsonable`: its metadata and time are walked, the
    rest is of JSON's types already: ten thousand of these are written at once)."""
    return {"step": c.step, "created": jsonable(c.created or None), "nbytes": c.nbytes, "complete": c.is_complete,
            "tiers": list(c.tiers), "complete_on": [t for t in c.tiers if t in c.complete],
            "failed": {str(k): str(v) for k, v in c.failed.items()},
            "skipped": {str(k): v for k, v in c.skipped.items()}, "foreign": c.foreign,
            "metadata": jsonable(c.metadata)}


def plain_values(skeleton_bytes: bytes) -> list[tuple[str, Any]]:
    """The saved skeleton's plain values (not tensors), by path: dicts and lists of containers are opened,
    a list or tuple of plain values is one value."""
    from ..state import PerRankMark, Pickled, TensorAlias, TensorRef, decode_skeleton, path_str  # imports torch

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
        out.append((path_str(path), PickledValue(len(node.data)) if isinstance(node, Pickled) else node))

    try:
        walk(decode_skeleton(skeleton_bytes), ())
    finally:
        del walk  # a nested function that calls itself is a reference cycle (see tiered_ckpt/state/skeleton.py)
    return out


@dataclasses.dataclass(frozen=True)
class PickledValue:
    """A plain value saved pickled (allow_pickle): shown by its size, never unpickled."""

    nbytes: int

    def __repr__(self) -> str:
        return f"<pickled, {self.nbytes} bytes>"


def short(value: Any, limit: int = 100) -> str:
    if isinstance(value, bytes) and len(value) > 32:
        return f"<{len(value)} bytes>"
    text = repr(value)
    return text if len(text) <= limit else text[:limit - 3] + "..."


def age(seconds: float) -> str:
    return f"{seconds / 3600:g}h" if seconds >= 3600 else f"{seconds / 60:g}min" if seconds >= 60 else f"{seconds:g}s"
