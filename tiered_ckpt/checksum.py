"""Checksums: crc32c over each part (hardware-accelerated; releases the GIL on large buffers), and a sealed
envelope for metadata records (manifests, rank records, index records), so that a flipped bit in a small
record is an error naming the copy, never a wrong checkpoint loaded without a word."""
from __future__ import annotations

import struct
from typing import Iterable

import crc32c as _crc32c

from .errors import IntegrityError

ALGORITHM = "crc32c"
SEAL = b"TCK\x01"  # magic and envelope version; then the body's crc32c (4 bytes, little endian), then the body


def checksum(views: Iterable[memoryview | bytes | bytearray]) -> int:
    value = 0
    for view in views:
        value = _crc32c.crc32c(view, value)
    return value


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
