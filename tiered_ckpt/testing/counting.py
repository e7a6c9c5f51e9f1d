"""An index that counts the calls made to it: each is one round trip to the store (a Redis command or pipeline,
a file index's thread hop), so a test can assert that a phase's round trips do not grow with the world."""
from __future__ import annotations

from collections import Counter
from typing import Any


class CountingIndex:
    """Every attribute of `inner`, its methods counted per name in `calls`. `get_rank_metas` is passed on only
    when `inner` has it, so a wrapped third-party index keeps its fallback."""

    def __init__(self, inner: Any):
        object.__setattr__(self, "_inner", inner)
        object.__setattr__(self, "calls", Counter())

    def __getattr__(self, name: str) -> Any:
        value = getattr(self._inner, name)
        if not callable(value) or name.startswith("_"):
            return value

        def counted(*args: Any, **kwargs: Any) -> Any:
            self.calls[name] += 1
            return value(*args, **kwargs)
        return counted

    def __setattr__(self, name: str, value: Any) -> None:
        setattr(self._inner, name, value)  # (epoch, set by the engine)

    @property
    def total(self) -> int:
        return sum(self.calls.values())
