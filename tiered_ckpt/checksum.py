"""Part checksums: crc32c (hardware-accelerated; releases the GIL on large buffers)."""
from __future__ import annotations

from typing import Iterable

import crc32c as _crc32c

ALGORITHM = "crc32c"


def checksum(views: Iterable[memoryview | bytes | bytearray]) -> int:
    value = 0
    for view in views:
        value = _crc32c.crc32c(view, value)
    return value
