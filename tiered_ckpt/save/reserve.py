"""Engine.reserve: every staging buffer the saves to come will use, made before training starts.

A first save otherwise allocates and populates its staging buffer while training waits (about 0.7 s/GiB), and
each of the first keep_last + 1 saves into the memory tier's files needs one of its own. Reserving makes them
all at set-up, checked first against the memory tier's `capacity` and against the free space of the file
system under it (a tmpfs: what every rank of this machine will make, together), so a stack that cannot hold
its checkpoints fails there, naming the tier and the bytes, instead of with an OOM kill or a SIGBUS later.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field

from ..errors import TierFull
from ..sizes import format_size


@dataclass(frozen=True)
class Reservation:
    """What Engine.reserve made, and the host memory the tier stack's staging holds from now on."""

    state_bytes: int  # this rank's bytes of one checkpoint (one staging buffer)
    made: int  # buffers made now (0: they existed already)
    buffers: int  # staging buffers this rank holds now, free and holding checkpoints
    host_bytes: int  # their bytes: this rank's staging RAM from now on (memory-tier staging: its copies too)
    machine_bytes: int  # the same for every rank on this machine
    tier: str | None  # the memory tier whose files are the buffers (None: anonymous host memory)
    budget: int | None = None  # [engine] host_memory: the machine's budget all this fits in (None: none set)
    keep_last: dict[str, int] = field(default_factory=dict)  # with a budget: what each memory tier keeps within it


def room_error(tier: str, path: str, need: int, ranks: int) -> TierFull | None:
    """TierFull naming the tier when the file system under `path` has less free space than `need` (this
    machine's ranks together), else None."""
    try:
        st = os.statvfs(path)
    except OSError:
        return None  # not made yet, or not a local path: the buffers' own allocation says what is wrong
    free = st.f_bavail * st.f_frsize
    if need <= free:
        return None
    return TierFull(f"reserving staging buffers needs {format_size(need)} on {path} for this machine's {ranks} "
                    f"rank(s), but it has {format_size(free)} free: enlarge it (a tmpfs: mount -o remount,size=...), "
                    f"or lower keep_last or max_inflight", tier=tier)
