"""Checksums of parts, and a sealed envelope for metadata records (manifests, rank records, index records),
so that a flipped bit in a small record is an error naming the copy, never a wrong checkpoint loaded
without a word.

Parts: xxh3 (64 bits, from the `xxhash` package: faster than a memcpy here, 24 GB/s against crc32c's 14)
when it is installed, else crc32c (hardware-accelerated). Both release the GIL on large buffers. The
manifest names the algorithm of its checkpoint, so either kind verifies whatever the default is now.
Seals are always crc32c (small records; a fixed format)."""
from __future__ import annotations

import struct
from typing import Callable, Iterable

import crc32c as _crc32c

from .errors import IntegrityError, TieredCkptError

try:
    import xxhash as _xxhash
except ImportError:  # an optional extra: pip install 'tiered_ckpt[xxhash]'
    _xxhash = None

ALGORITHM = "crc32c"  # of seals, and of parts in checkpoints that predate the choice
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
    fn = _ALGORITHMS.get(algorithm)
    if fn is None or (algorithm == "xxh3" and _xxhash is None):
        raise TieredCkptError(f"checksum {algorithm!r} is not available here (available: {available()}); a "
                              f"checkpoint made with xxh3 needs the xxhash package: pip install 'tiered_ckpt[xxhash]'")
    return fn(views)


def describe(algorithm: str, value: int) -> str:
    return f"{algorithm} {value:#0{18 if algorithm == 'xxh3' else 10}x}"


def seal(body: bytes) -> bytes:
    return SEAL + struct.pack("<I", _crc32c.crc32c(body)) + body


def unseal(data: bytes, source: str) -> bytes | None:
    """The body of a sealed record, or None for a record written before records were sealed. Raises
    IntegrityError naming `source` when the body does not match its checksum."""
    if not data.startswith(SEAL):
        return None
    if len(data) < len(SEAL) + 4:
        raise IntegrityError(f"{source} is truncated ({len(data)} bytes)")
    (expected,) = struct.unpack_from("<I", data, len(SEAL))
    body = data[len(SEAL) + 4:]
    actual = _crc32c.crc32c(body)
    if actual != expected:
        raise IntegrityError(f"{source} is corrupt: {ALGORITHM} {actual:#010x}, expected {expected:#010x}")
    return body
