"""The manifest a load reads, read once per world: rank 0 reads it and every rank's checksum record from the index
(or the tiers), checks them, and hands them to the other ranks in the broadcast that carries its pick. Each rank
reading them itself cost R records per rank, R^2 per world (22.9 s a rank at 10,240 ranks on Redis)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Sequence

from ..errors import IncompleteCheckpoint, IndexUnavailable, IntegrityError, RankFailed, TierError
from ..manifest import Manifest
from ..state.gc_pause import automatic_gc_paused

if TYPE_CHECKING:
    from ..storage.index import CheckpointStatus
    from ..storage.tier_io import TierIO
    from .catalog import Catalog

_KNOWN = {e.__name__: e for e in (IncompleteCheckpoint, IntegrityError, IndexUnavailable, TierError)}


@dataclass
class SharedManifest:
    """What rank 0's read gave: the manifest with every rank's records (sealed bytes, so damage on the way is
    caught), or its error, which every rank then raises in its load's local work, as when each rank read."""

    data: bytes | None
    error: tuple[str, str] | None = None  # (type name, message)
    local: Manifest | BaseException | None = field(default=None, compare=False)  # rank 0's own: never sent

    def __getstate__(self) -> dict[str, Any]:
        return {"data": self.data, "error": self.error, "local": None}

    @classmethod
    async def read(cls, catalog: Catalog, status: CheckpointStatus, allowed: Sequence[str]) -> SharedManifest:
        """Rank 0: the manifest of the checkpoint picked, from the tiers the load reads it from."""
        order = [n for n in catalog.io.order(status.complete) if n in allowed]
        try:
            manifest = await catalog.read_manifest(status.step, order, status.incarnation)
            with automatic_gc_paused():  # 100k tensors: a tenth of a second of Python, in a thread
                data = await catalog.io.run_blocking(manifest.to_bytes)
        except Exception as e:  # not the pick's failure: raised by every rank's load, after the pick
            return cls(None, (type(e).__name__, str(e)), e)
        return cls(data, None, manifest)

    async def manifest(self, job: str, step: int, io: TierIO) -> Manifest:
        """This rank's copy: rank 0's own, or decoded (in a thread) and checked from what rank 0 sent."""
        if isinstance(self.local, Manifest):
            return self.local
        if isinstance(self.local, BaseException):
            raise self.local
        if self.data is None:
            name, message = self.error or ("", "no manifest")
            raise _KNOWN.get(name, RankFailed)(message if name in _KNOWN else f"rank 0 failed reading the "
                                               f"manifest of step {step}: {name}: {message}")
        source = f"manifest of step {step} from rank 0"
        data = self.data
        with automatic_gc_paused():
            return await io.run_blocking(lambda: Manifest.from_bytes(data, source=source).expect(job, step, source))
