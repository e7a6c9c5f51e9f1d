"""Test doubles and conformance suites for tiered_ckpt and for third-party drivers and indexes.

    from tiered_ckpt.testing import IndexConformance, TierConformance

The suites need pytest and pytest-asyncio (the `test` extra), so they load on first use: the `faulty` tier
(testing/faults.py), a built-in kind a job may name without pytest installed, imports this package too.
"""
from __future__ import annotations

import importlib
from typing import Any

_LAZY = {"IndexConformance": ".index", "TierConformance": ".tiers", "payload": ".tiers"}

__all__ = ["IndexConformance", "TierConformance", "payload"]


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(_LAZY[name], __name__), name)
