"""The versioned manifest: which tensors, where their bytes are, which checksums. msgpack, never pickle."""
from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import msgpack

from ..checksum import SEAL, seal_parts, unseal
from ..errors import IntegrityError
from ..layout import part_count, part_range
from .tensors import ChunkMeta, TensorMeta, dtype_from_str

if TYPE_CHECKING:
    from .table import TensorTable

__all__ = ["ChunkMeta", "Manifest", "RankMeta", "TensorMeta", "dtype_from_str"]

FORMAT_VERSION = 4  # 2: sealed records (checksummed), per-rank skeletons, the index id; 3: incarnation folders,
# tensors stored as columns (a state of 100k small tensors: 2.4 MB of manifest instead of 12 MB, and fast to code);
# 4: a digest per chunk of each part (chunk_size, chunk_sums), so a part is verified and copied in one pass
READABLE_VERSIONS = (1, 2, 3, 4)
_DECODE_ERRORS = (ValueError, KeyError, TypeError, IndexError, AttributeError, OverflowError,
                  msgpack.UnpackException)
_INCARNATION = re.compile(r"(ix-[0-9a-f]{8}/[0-9a-f]{6,})?")


def _blob(value: object) -> bytes:
    """A bytes field as stored (never bytes(n) of a number: that would allocate n bytes); a view of the
    record's bytes (a long one, unpacked with `views`) copied, so the field does not hold the record."""
    if isinstance(value, memoryview):
        return value.tobytes()
    if not isinstance(value, bytes):
        raise TypeError(f"expected bytes, got {type(value).__name__}")
    return value


def _owned(value: Any) -> Any:
    """`value` (metadata as unpacked with `views`) with every memoryview in it copied to bytes."""
    if isinstance(value, memoryview):
        return value.tobytes()
    if isinstance(value, dict):
        return {k: _owned(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_owned(v) for v in value]
    return value


def _body(data: bytes, source: str) -> bytes | memoryview:
    """A record's msgpack body: checked against its seal, or (format 1) as written, unsealed."""
    body = unseal(data, source)
    return data if body is None else body


def _check_sealed(data: bytes, version: object, source: str) -> None:
    """After _body: a record of a format that is always sealed must have been (its body was checked then)."""
    if version != 1 and not data.startswith(SEAL):
        raise IntegrityError(f"{source}: a format {version!r} record must be sealed (its seal is damaged)")


@dataclass(frozen=True)
class RankMeta:
    """One rank's packed stream. The manifest (written by rank 0) leaves `checksums` and `skeleton` empty;
    each rank stores its own in a rank record, since only that rank computed them."""

    rank: int
    nbytes: int
    checksums: tuple[int, ...] = ()
    skeleton: bytes = b""  # this rank's state structure and plain values (empty in format 1)
    chunk_sums: bytes = b""  # 8 bytes (little endian) per chunk of every part, in order (format 4; empty before)
    host: str = ""  # the machine that wrote this rank's parts (empty before this release)

    def to_bytes(self) -> bytes:
        """Sealed msgpack; the skeleton and digests (tens of MB at a million tensors) copied once, into the record
        (not deep-copied, then into the packer's buffer, then behind the seal: GIL-holding copies of fresh memory)."""
        from .pieces import packed_parts  # (numpy: see Manifest.__post_init__)

        body = {"version": FORMAT_VERSION, **{f.name: getattr(self, f.name) for f in dataclasses.fields(self)}}
        return seal_parts(packed_parts(body))

    def expect(self, rank: int, source: str) -> "RankMeta":
        """This record, if it is the one of `rank` that `source` lists; else IntegrityError."""
        if self.rank != rank:
            raise IntegrityError(f"{source} is listed as rank {rank}'s checksum record but is rank {self.rank}'s")
        return self

    @classmethod
    def from_bytes(cls, data: bytes, *, source: str) -> "RankMeta":
        try:
            raw = msgpack.unpackb(_body(data, source))
            version = raw.pop("version", None)
            if version not in READABLE_VERSIONS:
                raise ValueError(f"unknown format version {version!r}")
            _check_sealed(data, version, source)
            return cls(int(raw["rank"]), int(raw["nbytes"]), tuple(map(int, raw["checksums"])),
                       _blob(raw.get("skeleton", b"")), _blob(raw.get("chunk_sums", b"")), str(raw.get("host", "")))
        except IntegrityError:
            raise
        except _DECODE_ERRORS as e:
            raise IntegrityError(f"{source} is not a valid rank record: {type(e).__name__}: {e}") from e


@dataclass(frozen=True)
class Manifest:
    job: str
    step: int
    world_size: int
    part_size: int
    checksum: str
    tensors: TensorTable  # given as any sequence of TensorMeta, kept as columns (table.py)
    ranks: tuple[RankMeta, ...]
    skeleton: bytes
    created: float
    metadata: dict[str, Any] = dataclasses.field(default_factory=dict)
    version: int = FORMAT_VERSION
    index: str = ""  # the index this checkpoint was committed to (its identity; "" in format 1)
    incarnation: str = ""  # the folder its keys are under (layout.incarnation_dir; "" before format 3)
    chunk_size: int = 0  # the parts' chunks that have a digest of their own (0: none, before format 4)

    def __post_init__(self) -> None:
        from .table import TensorTable  # numpy: not for the commands that only list checkpoints

        if not isinstance(self.tensors, TensorTable):
            object.__setattr__(self, "tensors", TensorTable.from_metas(self.tensors))

    @property
    def nbytes(self) -> int:
        return sum(r.nbytes for r in self.ranks)

    def with_checksums(self, records: dict[int, RankMeta]) -> "Manifest":
        ranks = []
        for r in self.ranks:
            record = records[r.rank]
            if record.nbytes != r.nbytes or len(record.checksums) != part_count(r.nbytes, self.part_size):
                raise IntegrityError(f"rank {r.rank}'s checksum record does not match the manifest")
            if self.chunk_size and len(record.chunk_sums) != 8 * self._chunks_before(r.nbytes, len(record.checksums)):
                raise IntegrityError(f"rank {r.rank}'s checksum record has {len(record.chunk_sums) // 8} chunk "
                                     f"digests, not one per chunk of {self.chunk_size} bytes")
            ranks.append(record)
        return dataclasses.replace(self, ranks=tuple(ranks))

    def _chunks_before(self, nbytes: int, part: int) -> int:
        """How many chunks the parts before `part` of a stream of `nbytes` have."""
        full, chunks_per_part = part * self.part_size, part_count(self.part_size, self.chunk_size)
        if full <= nbytes:
            return part * chunks_per_part
        last = nbytes - (part - 1) * self.part_size  # (the last part is shorter)
        return (part - 1) * chunks_per_part + part_count(last, self.chunk_size)

    def chunk_sums_of(self, rank: int, part: int) -> bytes:
        """The chunk digests of one part (empty before format 4)."""
        if not self.chunk_size:
            return b""
        record = self.ranks[rank]
        a, b = self._chunks_before(record.nbytes, part), self._chunks_before(record.nbytes, part + 1)
        return record.chunk_sums[8 * a:8 * b]

    def expect(self, job: str, step: int, source: str, *, incarnation: str | None = None) -> "Manifest":
        """This manifest, if it is the one `source` lists (job, step, and the folder it was read from); else
        IntegrityError: a renamed folder or a copied record must never serve one step's bytes as another's."""
        if self.job != job or self.step != step:
            raise IntegrityError(f"{source} is listed as job {job!r} step {step} but is the manifest of job "
                                 f"{self.job!r} step {self.step}")
        if incarnation is not None and self.incarnation != incarnation:
            raise IntegrityError(f"{source} lies in folder {incarnation!r} but names folder {self.incarnation!r}")
        return self

    def skeleton_of(self, rank: int) -> bytes:
        """Rank `rank`'s skeleton (format 1 kept rank 0's only, in the manifest)."""
        return self.ranks[rank].skeleton or self.skeleton

    def part_length(self, rank: int, index: int) -> int:
        start, end = part_range(self.ranks[rank].nbytes, self.part_size, index)
        return end - start

    def _checked(self, source: str) -> "Manifest":
        """What the rest of the library relies on, checked once: a sealed record can still be one that a bug
        or a hand wrote wrong, and it must fail here, naming the record, not deep inside a load."""
        from ..checksum import known

        def need(ok: bool, what: str) -> None:
            if not ok:
                raise IntegrityError(f"{source} is not a valid manifest: {what}")

        ints = (self.world_size, self.part_size, self.step)
        need(all(type(v) is int for v in ints) and self.world_size >= 1 and self.part_size >= 1 and self.step >= 0,
             f"world_size {self.world_size!r}, part_size {self.part_size!r}, step {self.step!r}")
        need(isinstance(self.checksum, str) and self.checksum in known(), f"checksum {self.checksum!r}")
        need([r.rank for r in self.ranks] == list(range(self.world_size)), "ranks do not match world_size")
        need(all(type(r.nbytes) is int and r.nbytes >= 0 for r in self.ranks), "a rank's nbytes")
        need(isinstance(self.incarnation, str) and _INCARNATION.fullmatch(self.incarnation) is not None,
             f"incarnation {self.incarnation!r}")
        need(type(self.chunk_size) is int and self.chunk_size >= 0 and (
            not self.chunk_size or self.part_size % self.chunk_size == 0), f"chunk_size {self.chunk_size!r}")
        need(_distinct(self.tensors.paths), "a tensor path is listed twice")
        wrong = self.tensors.check([r.nbytes for r in self.ranks])
        need(wrong is None, str(wrong))
        return self

    def to_bytes(self) -> bytes:
        body = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        body["tensors"] = self.tensors.columns()
        body["ranks"] = [{"rank": r.rank, "nbytes": r.nbytes, "checksums": list(r.checksums), "skeleton": r.skeleton,
                          "chunk_sums": r.chunk_sums, "host": r.host} for r in self.ranks]
        body["version"] = FORMAT_VERSION
        from .pieces import packed_parts  # (numpy: see __post_init__)

        return seal_parts(packed_parts(body))  # msgpack.packb's bytes, the path column a piece at a time (pieces.py)

    @classmethod
    def from_bytes(cls, data: bytes, *, source: str = "manifest") -> "Manifest":
        try:
            from .pieces import unpackb  # (numpy: see __post_init__)

            if not isinstance(data, bytes):  # (the table keeps views of it: it must not change under them)
                data = bytes(data)
            # msgpack.unpackb's value, a piece at a time; the tensors' long columns as views of `data`, which the
            # table keeps as stored (table.py: no copy of the chunk columns at all)
            raw = unpackb(_body(data, source), strict_map_key=False, views=True)
            if raw.get("version") not in READABLE_VERSIONS:
                raise IntegrityError(f"{source}: format version {raw.get('version')!r}, this library reads "
                                     f"{', '.join(map(str, READABLE_VERSIONS))}")
            _check_sealed(data, raw["version"], source)
            raw["tensors"] = _tensors(raw["tensors"])
            raw["ranks"] = tuple(RankMeta(r["rank"], r["nbytes"], tuple(r["checksums"]), _blob(r.get("skeleton", b"")),
                                          _blob(r.get("chunk_sums", b"")), str(r.get("host", ""))) for r in raw["ranks"])
            raw["skeleton"] = _blob(raw.get("skeleton", b""))
            if not isinstance(raw.get("metadata", {}), dict):
                raise TypeError("metadata is not a map")
            if "metadata" in raw:
                raw["metadata"] = _owned(raw["metadata"])
            return cls(**raw)._checked(source)
        except IntegrityError:
            raise
        except _DECODE_ERRORS as e:
            raise IntegrityError(f"{source} is not a valid manifest: {type(e).__name__}: {e}") from e


def _distinct(paths: list[str]) -> bool:
    """No path twice, without a set of 1M paths (its growth holds the GIL for tenths of a second in all, up to
    70 ms a step, and a thread that checks a read manifest would stall the event loop as long): pieces.py."""
    from .pieces import all_distinct  # (numpy: see __post_init__)
    return all_distinct(paths)


def _tensors(raw: Any) -> TensorTable:
    """The manifest's tensors: columns (format 3 and later) or a map per tensor (formats 1 and 2)."""
    from .table import TensorTable

    if isinstance(raw, dict):
        return TensorTable.from_columns(raw)
    return TensorTable.from_rows((t["path"], t["dtype"], t["shape"],
                                  [(c["offsets"], c["sizes"], c["rank"], c["byte_offset"], c["nbytes"])
                                   for c in t["chunks"]]) for t in raw)
