"""Conformance suites that any tier driver or index, including a third party's, runs by subclassing.

    from tiered_ckpt.testing import IndexConformance, TierConformance

They need pytest and pytest-asyncio (the `test` extra).
"""
from .index import IndexConformance
from .tiers import TierConformance, payload

__all__ = ["IndexConformance", "TierConformance", "payload"]
