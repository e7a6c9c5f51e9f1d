"""Work over every tensor done as many short C calls instead of one long one, so a worker thread that does it
lets the event loop run in between.

A thread gives the GIL back only between bytecodes, never inside one C call: `pickle.dumps` of 1M paths holds
it ~0.3 s, `np.asarray` of 3M ints ~70 ms, and the loop (and every other thread) waits that long, even though
the work runs in a thread (docs/benchmarks.md, *Event-loop stalls against the tensor count*). Cut into pieces
of PIECE entries, each call is a few milliseconds.
"""
from __future__ import annotations

import pickle
from typing import Any, Hashable, Iterator, Sequence

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


def hashes(values: Sequence[Hashable]) -> np.ndarray:
    """hash() of each value, as int64, made a piece at a time."""
    out = np.empty(len(values), np.int64)
    for i in range(0, len(values), PIECE):
        piece = values[i:i + PIECE]
        out[i:i + len(piece)] = np.fromiter(map(hash, piece), np.int64, len(piece))
    return out


def all_distinct(values: Sequence[Hashable]) -> bool:
    """len(set(values)) == len(values) without a set of them all (one set of 1M entries grows by resizes that each
    hold the GIL 30-70 ms): their hashes sorted as an array (numpy sorts without the GIL); only values whose
    hashes are equal are compared."""
    hashed = hashes(values)
    order = np.argsort(hashed)  # (any order of equal hashes will do: the default sort, ~4x a stable one here)
    ordered = hashed[order]
    same = np.flatnonzero(ordered[1:] == ordered[:-1])
    if not len(same):
        return True
    alike = np.unique(np.concatenate([same, same + 1]))  # every value in a run of equal hashes
    suspects = [values[int(i)] for i in order[alike]]
    return len(set(suspects)) == len(suspects)


SORT_BYTES = 256 << 20  # the most memory `string_order` gives the fixed-width copy it sorts


def string_order(values: Sequence[str]) -> np.ndarray:
    """np.argsort(np.asarray(values, dtype=object)) (each str's place in sorted order, as indexes), with no call
    that holds the GIL over every entry: an object array's sort compares the strs in one C call (~0.6 s at 1M
    paths, in the planning thread, the loop waiting), where a sort of their UTF-8 bytes as a fixed-width array
    gives the GIL back. UTF-8 keeps the code points' order, so the bytes sort as the strs do; the padding NULs
    would make "a" and "a\\0" equal, so a str that ends in NUL (or a copy over SORT_BYTES) sorts the old way.
    Equal strs may come in either order (a stable sort here; the object sort is not stable)."""
    encoded: list[list[bytes]] = []
    width = 1
    for i in range(0, len(values), PIECE):
        piece = [v.encode("utf-8", "surrogatepass") for v in values[i:i + PIECE]]
        if any(b.endswith(b"\0") for b in piece):
            return np.argsort(np.asarray(values, dtype=object), kind="stable")
        width = max(width, max(map(len, piece), default=1))
        encoded.append(piece)
    if len(values) * width > SORT_BYTES:
        return np.argsort(np.asarray(values, dtype=object), kind="stable")
    flat = np.empty(len(values), dtype=f"S{width}")
    for n, piece in enumerate(encoded):
        flat[n * PIECE:n * PIECE + len(piece)] = piece
        piece.clear()
    return np.argsort(flat, kind="stable")


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
    return b"".join(packed_parts(value))


def packed_parts(value: Any) -> list[bytes | memoryview]:
    """packb's bytes as the pieces they are joined from: a bin value of VIEW bytes or more is one of them as given
    (not copied into the packer's buffer), so a caller that joins them once (checksum.seal_parts) copies a manifest's
    integer columns once, not three times."""
    out: list[bytes | memoryview] = []
    _pack(value, msgpack.Packer(autoreset=True), out)
    return out


def _pack(value: Any, packer: msgpack.Packer, out: list[bytes | memoryview]) -> None:
    kind = type(value)
    if kind is dict:
        out.append(packer.pack_map_header(len(value)))
        for k, v in value.items():
            out.append(packer.pack(k))
            _pack(v, packer, out)
    elif kind in (list, tuple) and len(value) > PIECE:
        out.append(packer.pack_array_header(len(value)))
        for i in range(0, len(value), PIECE):
            piece = packer.pack(list(value[i:i + PIECE]))
            out.append(piece[_array_header_size(piece[0]):])
    elif kind in (list, tuple) and len(value) <= SMALL:  # entry by entry: a long bin inside is not copied
        out.append(packer.pack_array_header(len(value)))
        for v in value:
            _pack(v, packer, out)
    elif kind in (bytes, bytearray, memoryview) and VIEW <= memoryview(value).nbytes < 1 << 32:
        out.append(b"\xc6" + memoryview(value).nbytes.to_bytes(4, "big"))  # bin 32: msgpack's header for it
        out.append(value if kind is not memoryview else value.cast("B"))
    else:
        out.append(packer.pack(value))


def unpackb(data: bytes | memoryview, *, strict_map_key: bool = True, raw: bool = False, views: bool = False) -> Any:
    """msgpack.unpackb(data, strict_map_key=..., raw=...), the same value, with each array or map of more than
    PIECE entries unpacked a piece at a time (one unpackb of a 1M-tensor manifest holds the GIL ~0.1 s): each
    piece is fed to an Unpacker behind a header of its own length. Containers of at most SMALL entries are read
    entry by entry, so a long array inside them is cut too; any other value is one call. Errors are those of
    unpackb: ValueError (incomplete input, a key that strict_map_key refuses, ExtraData), msgpack's
    FormatError and StackError. With `views`, a bin value of VIEW bytes or more is a memoryview of `data`, not a
    copy (the manifest's integer columns: two copies of 126 MB at 10,240 ranks otherwise)."""
    view = memoryview(data).cast("B")
    options = {"strict_map_key": strict_map_key, "raw": raw, "max_buffer_size": len(view) + 16}
    value, end = _unpack(view, 0, options, 0, views)
    if end < len(view):
        raise msgpack.ExtraData(value, bytes(view[end:]))
    return value


SMALL = 64  # entries of a container read one by one (the manifest's own maps, its columns' [width, bytes])
DEPTH = 8  # containers that deep are read one by one; deeper ones whole (msgpack's own limit on nesting holds)
VIEW = 1 << 16  # bin values at least this long come back as views when asked (unpackb's `views`)
_BIN_LENGTH = {0xC4: 1, 0xC5: 2, 0xC6: 4}  # bin 8, 16, 32: the bytes of the length after the type byte


def _unpack(view: memoryview, at: int, options: dict[str, Any], depth: int, views: bool = False) -> tuple[Any, int]:
    """The value that starts at byte `at`, `depth` containers deep, and where it ends."""
    if at >= len(view):
        raise ValueError("Unpack failed: incomplete input")
    if views and view[at] in _BIN_LENGTH:
        found = _bin_view(view, at)
        if found is not None:
            return found
    kind, count, header = _container(view, at)
    if kind is None or SMALL < count <= PIECE or (count <= SMALL and depth >= DEPTH):
        return _one(b"", view, at, options)
    at += header
    if count <= SMALL:  # entry by entry
        if kind == "array":
            items = []
            for _ in range(count):
                item, at = _unpack(view, at, options, depth + 1, views)
                items.append(item)
            return items, at
        out: dict[Any, Any] = {}
        for _ in range(count):
            key, at = _unpack(view, at, options, depth + 1, views)
            if options["strict_map_key"] and type(key) not in (str, bytes):
                raise ValueError(f"{type(key).__name__} is not allowed for map key when strict_map_key=True")
            out[key], at = _unpack(view, at, options, depth + 1, views)
        return out, at
    whole: Any = [] if kind == "array" else {}
    packer, window = msgpack.Packer(), 65536
    for start in range(0, count, PIECE):
        size = min(PIECE, count - start)
        head = packer.pack_array_header(size) if kind == "array" else packer.pack_map_header(size)
        piece, end = _one(head, view, at, options, window)
        window, at = end - at + 4096, end  # (the next piece is likely as long)
        (whole.extend if kind == "array" else whole.update)(piece)
    return whole, at


def _one(head: bytes, view: memoryview, at: int, options: dict[str, Any], window: int = 65536) -> tuple[Any, int]:
    """One value: `head` (a container header, or nothing) and the bytes from `at` on, fed to an Unpacker a
    window at a time until it holds a whole value (one C call unpacks it); and where it ends in `view`."""
    unpacker = msgpack.Unpacker(**options)
    unpacker.feed(head)
    fed = at
    while True:
        if fed >= len(view) and fed > at:
            raise ValueError("Unpack failed: incomplete input")
        unpacker.feed(view[fed:fed + window])
        fed, window = fed + window, window * 2
        try:
            value = unpacker.unpack()
        except msgpack.OutOfData:
            continue
        return value, at + unpacker.tell() - len(head)


def _bin_view(view: memoryview, at: int) -> tuple[memoryview, int] | None:
    """The bin value at `at` as a view, and where it ends, if it is VIEW bytes or longer; else None (`_one`
    reads it, and reports a truncated one as msgpack does)."""
    width = _BIN_LENGTH[view[at]]
    start = at + 1 + width
    if start > len(view):
        return None
    length = int.from_bytes(view[at + 1:start], "big")
    if length < VIEW or start + length > len(view):
        return None
    return view[start:start + length], start + length


def _container(view: memoryview, at: int) -> tuple[str | None, int, int]:
    """("array" or "map", its entry count, its header's bytes) if a container starts at `at`, else (None, 0, 0)."""
    first = view[at]
    if 0x90 <= first <= 0x9F:
        return "array", first & 0x0F, 1
    if 0x80 <= first <= 0x8F:
        return "map", first & 0x0F, 1
    sizes = {0xDC: ("array", 2), 0xDD: ("array", 4), 0xDE: ("map", 2), 0xDF: ("map", 4)}
    if first not in sizes:
        return None, 0, 0
    kind, width = sizes[first]
    if at + 1 + width > len(view):
        raise ValueError("Unpack failed: incomplete input")
    return kind, int.from_bytes(view[at + 1:at + 1 + width], "big"), 1 + width


def _array_header_size(first: int) -> int:
    """Bytes of the msgpack array header that begins with byte `first`: fixarray, array 16, array 32."""
    if 0x90 <= first <= 0x9F:
        return 1
    return {0xDC: 3, 0xDD: 5}[first]
