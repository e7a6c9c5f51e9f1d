"""Tier kind name → driver class. Built-in kinds load lazily (by name: this module imports no driver, so the
config, in the base, and storage/tier_io.py both use it); third parties register the entry point
group `tiered_ckpt.tiers` (name = kind, value = "module:Class")."""
from __future__ import annotations

import importlib
from importlib.metadata import entry_points

from .errors import ConfigError

BUILTIN = {
    "memory": "tiered_ckpt.storage.tiers.memory:MemoryTier",
    "local": "tiered_ckpt.storage.tiers.local:LocalTier",
    "redis": "tiered_ckpt.storage.tiers.redis_peer:RedisPeerTier",
    "s3": "tiered_ckpt.storage.tiers.s3:S3Tier",
    # a test double that users may also run fault drills with (docs/tiers.md): `local` plus injected faults
    "faulty": "tiered_ckpt.testing.faults:FaultyTier",
}


def known_kinds() -> list[str]:
    return sorted(set(BUILTIN) | {ep.name for ep in entry_points(group="tiered_ckpt.tiers")})


def driver_class(kind: object) -> type:
    if not isinstance(kind, str):
        raise ConfigError(f"tier kind must be a string, got {kind!r}")
    target = BUILTIN.get(kind)
    if target is None:
        eps = [ep for ep in entry_points(group="tiered_ckpt.tiers") if ep.name == kind]
        if not eps:
            raise ConfigError(f"unknown tier kind {kind!r} (known: {', '.join(known_kinds())})")
        return eps[0].load()
    module, _, cls = target.partition(":")
    return getattr(importlib.import_module(module), cls)
