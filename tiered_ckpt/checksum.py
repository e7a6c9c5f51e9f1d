"""Checksums of parts, and a sealed envelope for metadata records (manifests, rank records, index records),
so that a flipped bit in a small record is an error naming the copy, never a wrong checkpoint loaded
without a word.

Parts: xxh3 (64 bits, from the `xxhash` package: faster than a memcpy here, 24 GB/s against crc32c's 14)
when it is installed, else crc32c (hardware-accelerated). Both release the GIL on large buffers. The
manifest names the algorithm of its checkpoint, so either kind verifies whatever the default is now.
Seals are always crc32c (small records; a fixed format)."""
from __future__ import annotations

import array
import struct
import sys
from typing import Callable, Iterable, Sequence

import crc32c as _crc32c

from .errors import IntegrityError, TieredCkptError

try:
    import xxhash as _xxhash
except ImportError:  # an optional extra: pip install 'tiered_ckpt[xxhash]'
    _xxhash = None

ALGORITHM = "crc32c"  # of seals, and of parts in checkpoints that predate the choice
CHUNK_SIZE = 1 << 20  # each part's chunks get a digest too (format 4): a reader verifies and copies chunk by
# chunk while the chunk is in cache, instead of a pass over the whole part to verify it and another to copy it
SEAL = b"TCK\x01"  # magic and envelope version; then the body's crc32c (4 bytes, little endian), then the body
Views = Iterable[memoryview | bytes | bytearray]


def _crc32c_of(views: Views) -> int:
    value = 0
    for view in views:
        value = _crc32c.crc32c(view, value)
    return value


def _xxh3_of(views: Views) -> int:
    assert _xxhash is not None
    views = list(views)
    if len(views) == 1:
        return _xxhash.xxh3_64_intdigest(views[0])
    state = _xxhash.xxh3_64()
    for view in views:
        state.update(view)
    return state.intdigest()


_ALGORITHMS: dict[str, Callable[[Views], int]] = {"crc32c": _crc32c_of, "xxh3": _xxh3_of}


def known() -> list[str]:
    """Every algorithm a manifest may name (available here or not)."""
    return list(_ALGORITHMS)


def available() -> list[str]:
    return [name for name in _ALGORITHMS if name != "xxh3" or _xxhash is not None]


def default_algorithm() -> str:
    return "xxh3" if _xxhash is not None else "crc32c"


def resolve(name: str) -> str:
    """The algorithm new checkpoints use for `[engine] checksum` ("auto": the fastest available)."""
    return default_algorithm() if name == "auto" else name


def checksum(views: Views, algorithm: str = ALGORITHM) -> int:
    available_or_raise(algorithm)
    return _ALGORITHMS[algorithm](views)


def part_digests(view: memoryview, algorithm: str, chunk_size: int) -> tuple[int, bytes]:
    """The part's checksum and its chunks' digests (8 bytes each, little endian), one hash per byte: a part cut
    into chunks (format 4) has for checksum the digest of its chunk digests (`of_chunk_digests`); with no
    chunk_size, the digest of its bytes and no chunk digests."""
    available_or_raise(algorithm)
    if not chunk_size:
        return checksum([view], algorithm), b""
    view = memoryview(view).cast("B")
    digests = array.array("Q", [chunk_digest(view[at:at + chunk_size], algorithm)
                                for at in range(0, len(view), chunk_size)])
    sums = _little_endian(digests)
    return of_chunk_digests(sums, algorithm), sums


def of_chunk_digests(chunk_sums: bytes, algorithm: str) -> int:
    """The checksum of a part cut into chunks: the digest of its chunk digests, so that it costs no second pass
    over the part's bytes (a reader that verified every chunk checks the part with 8 bytes a chunk)."""
    return checksum([chunk_sums], algorithm)


def part_checksum(views: Views, algorithm: str, chunk_size: int) -> int:
    """The checksum a record holds for the part made of `views` joined: with chunk_size (format 4), the digest
    of the digests of its chunk_size chunks; without (a part too small to cut, or an older checkpoint), the
    digest of its bytes."""
    if not chunk_size:
        return checksum(views, algorithm)
    available_or_raise(algorithm)
    digests = array.array("Q")
    running, filled = Running(algorithm), 0
    for view in views:
        view = memoryview(view).cast("B")
        at = 0
        while at < len(view):
            take = min(chunk_size - filled, len(view) - at)
            if not filled and take == chunk_size:
                digests.append(chunk_digest(view[at:at + take], algorithm))  # a whole chunk in one view
            else:  # a chunk across views
                running.update(view[at:at + take])
                filled += take
                if filled == chunk_size:
                    digests.append(running.value())
                    running, filled = Running(algorithm), 0
            at += take
    if filled:
        digests.append(running.value())
    return of_chunk_digests(_little_endian(digests), algorithm)


class Running:
    """A digest fed piece by piece, equal to checksum() of the pieces joined."""

    def __init__(self, algorithm: str):
        available_or_raise(algorithm)
        self._xxh3 = _xxhash.xxh3_64() if algorithm == "xxh3" else None  # type: ignore[union-attr]
        self._crc = 0

    def update(self, piece: memoryview | bytes) -> None:
        if self._xxh3 is not None:
            self._xxh3.update(piece)
        else:
            self._crc = _crc32c.crc32c(piece, self._crc)

    def value(self) -> int:
        return self._xxh3.intdigest() if self._xxh3 is not None else self._crc


def chunk_digest(chunk: memoryview | bytes, algorithm: str) -> int:
    return _xxhash.xxh3_64_intdigest(chunk) if algorithm == "xxh3" else _crc32c.crc32c(chunk)  # type: ignore[union-attr]


def _little_endian(values: array.array) -> bytes:
    if sys.byteorder != "little":
        values.byteswap()
    return values.tobytes()


def available_or_raise(algorithm: str) -> None:
    if algorithm not in _ALGORITHMS or (algorithm == "xxh3" and _xxhash is None):
        raise TieredCkptError(f"checksum {algorithm!r} is not available here (available: {available()}); a "
                              f"checkpoint made with xxh3 needs the xxhash package: pip install 'tiered_ckpt[xxhash]'")


def describe(algorithm: str, value: int) -> str:
    return f"{algorithm} {value:#0{18 if algorithm == 'xxh3' else 10}x}"


def seal(body: bytes) -> bytes:
    return SEAL + struct.pack("<I", _crc32c.crc32c(body)) + body


def seal_parts(parts: Sequence[bytes | memoryview]) -> bytes:
    """seal(b"".join(parts)), joined once: the body is not copied again behind its seal."""
    crc = 0
    for part in parts:
        crc = _crc32c.crc32c(part, crc)
    return b"".join([SEAL, struct.pack("<I", crc), *parts])


def unseal(data: bytes, source: str) -> memoryview | None:
    """The body of a sealed record (a view of `data`: a 126 MB manifest is not copied), or None for a record
    written before records were sealed. Raises IntegrityError naming `source` when the body does not match its
    checksum."""
    if not data.startswith(SEAL):
        return None
    if len(data) < len(SEAL) + 4:
        raise IntegrityError(f"{source} is truncated ({len(data)} bytes)")
    (expected,) = struct.unpack_from("<I", data, len(SEAL))
    body = memoryview(data)[len(SEAL) + 4:]
    actual = _crc32c.crc32c(body)
    if actual != expected:
        raise IntegrityError(f"{source} is corrupt: {ALGORITHM} {actual:#010x}, expected {expected:#010x}")
    return body
