"""Work over every tensor done as many short C calls instead of one long one, so a worker thread that does it
lets the event loop run in between.

A thread gives the GIL back only between bytecodes, never inside one C call: `pickle.dumps` of 1M paths holds
it ~0.3 s, `np.asarray` of 3M ints ~70 ms, and the loop (and every other thread) waits that long, even though
the work runs in a thread (docs/benchmarks.md, *Event-loop stalls against the tensor count*). Cut into pieces
of PIECE entries, each call is a few milliseconds.
"""
from __future__ import annotations

import pickle
from typing import Any, Iterator, Sequence

import msgpack
import numpy as np

PIECE = 16384  # entries per C call: ~5 ms for pickling paths, the costliest per entry


def dumps(items: Sequence[Any]) -> bytes:
    """Pickle a list PIECE entries at a time (read back with `loads`)."""
    return pickle.dumps([pickle.dumps(list(items[i:i + PIECE]), protocol=pickle.HIGHEST_PROTOCOL)
                         for i in range(0, len(items), PIECE)], protocol=pickle.HIGHEST_PROTOCOL)


def loads(data: bytes) -> list[Any]:
    """The list `dumps` pickled, unpickled a piece at a time."""
    out: list[Any] = []
    for piece in pickle.loads(data):
        out.extend(pickle.loads(piece))
    return out


def int_array(values: Sequence[int]) -> np.ndarray:
    """np.asarray(values, int64), a piece at a time."""
    if len(values) <= PIECE:
        return np.asarray(values, dtype=np.int64)
    return np.concatenate([np.asarray(values[i:i + PIECE], dtype=np.int64) for i in range(0, len(values), PIECE)])



def distinct(values: Sequence[Any]) -> set[Any]:
    """set(values), a piece at a time (one set() of 1M entries is one C call)."""
    out: set[Any] = set()
    for i in range(0, len(values), PIECE):
        out.update(values[i:i + PIECE])
    return out


def rows(values: np.ndarray) -> Iterator[Any]:
    """values.tolist(), a piece at a time: one tolist() of 1M entries holds the GIL ~30 ms (3M: ~90 ms)."""
    for i in range(0, len(values), PIECE):
        yield from values[i:i + PIECE].tolist()


def to_list(values: np.ndarray) -> list[Any]:
    """values.tolist(), made a piece at a time (see `rows`)."""
    out: list[Any] = []
    for i in range(0, len(values), PIECE):
        out.extend(values[i:i + PIECE].tolist())
    return out


def packb(value: Any) -> bytes:
    """msgpack.packb(value), the same bytes, with each list or tuple of more than PIECE entries packed a piece at a
    time (one packb of 1M paths holds the GIL ~50 ms): the pieces' own array headers are cut, and one header for
    the whole is written before them."""
    out: list[bytes] = []
    _pack(value, msgpack.Packer(autoreset=True), out)
    return b"".join(out)


def _pack(value: Any, packer: msgpack.Packer, out: list[bytes]) -> None:
    if type(value) is dict:
        out.append(packer.pack_map_header(len(value)))
        for k, v in value.items():
            out.append(packer.pack(k))
            _pack(v, packer, out)
    elif type(value) in (list, tuple) and len(value) > PIECE:
        out.append(packer.pack_array_header(len(value)))
        for i in range(0, len(value), PIECE):
            piece = packer.pack(list(value[i:i + PIECE]))
            out.append(piece[_array_header_size(piece[0]):])
    else:
        out.append(packer.pack(value))


def _array_header_size(first: int) -> int:
    """Bytes of the msgpack array header that begins with byte `first`: fixarray, array 16, array 32."""
    if 0x90 <= first <= 0x9F:
        return 1
    return {0xDC: 3, 0xDD: 5}[first]
