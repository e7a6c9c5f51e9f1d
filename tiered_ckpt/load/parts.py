"""A saved part as the read the tiers serve: its key, length and checksums, from the manifest. Its own module
because the reads of a load (reads.py) and the heal after it (heal.py) both build them."""
from __future__ import annotations

from typing import TYPE_CHECKING, Sequence

from ..layout import PartKey
from ..manifest import Manifest
from ..storage.verified_read import PartRead

if TYPE_CHECKING:
    from ..buffers import Sinks


def part_read(manifest: Manifest, rank: int, p: int, views: list[memoryview] | Sinks, targets: tuple[str, ...] = (),
              starts: tuple[int, ...] = (), spans: Sequence[tuple[int, int]] = ()) -> PartRead:
    """Part `p` of saved rank `rank`, read into `views`: its key, length and checksums, from the manifest."""
    key = PartKey(manifest.job, manifest.step, rank, p, manifest.incarnation).path
    return PartRead(key, views, manifest.part_length(rank, p), manifest.ranks[rank].checksums[p], targets,
                    bounce=True, algorithm=manifest.checksum, chunk_size=manifest.chunk_size,
                    chunk_sums=manifest.chunk_sums_of(rank, p), target_starts=starts, spans=spans)
