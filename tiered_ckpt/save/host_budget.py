"""`[engine] host_memory`: one figure for the host memory of a machine that the job's checkpointing fits in.

What one rank holds in host memory for a state of S bytes (the largest rank's S, so every rank decides alike):
- staging: `max_inflight` buffers of S (with the memory tier first in the stack, they are its own files);
- each memory tier: `keep_last + keep_best` checkpoints of S, and one more (retention retires the oldest only
  once the next one committed);
- reads: the bounce buffers of loads and of read-backs, `max(2, io_threads)` parts.

The budget is shared evenly by the ranks of the most crowded machine. When the stack as configured does not fit,
the memory tiers keep fewer checkpoints (their `keep_last` lowered, never below 1): retention gives way before
the budget is crossed. When even that does not fit, a ConfigError naming `engine.host_memory` says how much it
needs. A peer tier's Redis server on the same machine is not counted (its own `maxmemory` bounds it).
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import TYPE_CHECKING, Sequence

from ..errors import ConfigError
from ..sizes import format_size
from ..storage.verified_read import BouncePool

if TYPE_CHECKING:
    from ..config import Config


@dataclass(frozen=True)
class HostFit:
    """How the tier stack fits the budget for a state of `state_bytes` per rank."""

    budget: int  # host_memory: the machine's
    ranks: int  # ranks sharing it (those of the most crowded machine)
    state_bytes: int
    keep_last: dict[str, int]  # per memory tier: the checkpoints it keeps within the budget
    lowered: tuple[str, ...]  # memory tiers whose keep_last had to be lowered (or bounded) to fit
    need: int  # this rank's host bytes at that fit

    @property
    def share(self) -> int:
        return self.budget // self.ranks


def ranks_per_machine(hosts: Sequence[str]) -> int:
    """The most ranks any one machine runs (every rank's machine name, as the coordinator gathered them)."""
    return max(Counter(hosts).values(), default=1)


def fit_host_memory(config: Config, state_bytes: int, ranks: int) -> HostFit | None:
    """The memory tiers' keep_last that fits `config.engine.host_memory` for a state of `state_bytes` per rank
    shared by `ranks` ranks of a machine; None without a budget. ConfigError when nothing fits."""
    engine = config.engine
    if engine.host_memory is None:
        return None
    memory = [t for t in config.tiers if t.kind == "memory"]
    share, s = engine.host_memory // ranks, state_bytes
    reads = BouncePool.buffers_for(engine.io_threads) * min(engine.part_size, s)
    extra = sum((t.keep_best or 0) + 1 for t in memory)  # checkpoints beside keep_last: keep_best, the retiring one
    fixed = engine.max_inflight * s + reads + extra * s
    keep = {t.name: t.keep_last for t in memory}
    if s:
        room = (share - fixed) // s  # checkpoints that keep_last may keep, over every memory tier
        unbounded = [n for n, k in keep.items() if k is None]  # a tier that keeps every checkpoint: as many as fit
        bounded = sum(k for k in keep.values() if k is not None)
        for name in unbounded:
            keep[name] = max(1, (room - bounded) // len(unbounded))
        while sum(keep.values()) > room and any(k > 1 for k in keep.values()):  # the largest gives way first
            largest = max(keep, key=lambda n: keep[n])
            keep[largest] -= 1
        need = fixed + sum(keep.values()) * s
        if need > share:
            raise ConfigError(
                f"host_memory {format_size(engine.host_memory)} for this machine's {ranks} rank(s) is "
                f"{format_size(share)} each, but a rank with a state of {format_size(s)} needs {format_size(need)}: "
                f"{engine.max_inflight} staging buffer(s) (max_inflight), "
                + (f"{sum(keep.values()) + extra} checkpoint(s) in the memory "
                   f"tier(s) {', '.join(keep)} at keep_last 1, " if memory else "")
                + f"and {format_size(reads)} of read buffers; raise host_memory, or lower max_inflight"
                + (" or keep_best" if any(t.keep_best for t in memory) else ""),
                key="engine.host_memory", file=config.source)
    else:
        need = reads
    lowered = tuple(t.name for t in memory if t.keep_last is None or keep[t.name] < t.keep_last)
    return HostFit(engine.host_memory, ranks, s, {n: int(k) for n, k in keep.items() if k is not None}, lowered,
                   need)
