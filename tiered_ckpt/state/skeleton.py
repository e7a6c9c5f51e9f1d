"""The skeleton of a state and its markers: what a tensor, a tie, a per-rank value and a pickled value become in
it, how it is encoded (msgpack; pickle only when the user opts in) and decoded. Shared by both directions:
flatten.py (saves) and match.py (loads).
"""
from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any, Callable

import msgpack
import torch

from ..errors import StateError

_EXT_TENSOR, _EXT_TUPLE, _EXT_PICKLE, _EXT_ALIAS, _EXT_PER_RANK = 1, 2, 3, 4, 5
_PLAIN = (type(None), bool, int, float, str, bytes)
MAX_DEPTH = 256  # containers inside containers: msgpack (and Python's stack) stop not far above

# A note on reference cycles: the walks in this package that are nested functions calling themselves (here and
# in flatten.py) are each a reference cycle (function -> closure cell -> function) holding everything it closed
# over. They `del` their names when done, so that what they saw is freed at once by reference counting: left
# to the garbage collector, a state of 100,000 tensors made full collections of ~0.2-0.4 s (the GIL held
# throughout). match.py's Matcher is a class for the same reason: its methods make no such cycle.


@dataclass(frozen=True)
class TensorRef:
    index: int


_refs: list[TensorRef] = []
_refs_lock = threading.Lock()
_MAX_SHARED_REF = 1 << 20


def tensor_ref(index: int) -> TensorRef:
    """TensorRef(index), made once per index and shared by every save and load: no new object per tensor each
    time, so fewer full garbage collections (see the note on reference cycles). An index no real state reaches
    (from a damaged manifest) gets an object of its own."""
    if not (type(index) is int and 0 <= index < _MAX_SHARED_REF):
        return TensorRef(index)
    if index >= len(_refs):
        with _refs_lock:  # saves and loads run in worker threads
            _refs.extend(TensorRef(i) for i in range(len(_refs), index + 1))
    return _refs[index]


@dataclass(frozen=True)
class TensorAlias:
    """A tensor that shares its storage with the tensor saved under `name` (tied weights): saved once."""

    name: str


MISSING_POLICIES = ("error", "keep")


@dataclass
class PerRank:
    """Marks a value or a tensor as this rank's own. Each rank's is saved under a per-rank name and given
    back to the same rank. After a load, the loaded value is in `.value` (tensors are filled in place).

    `missing` says what a rank that did not exist at save time (a resume at a larger world size) gets:
    "error" (the default: a StateError naming the key, on every rank), "keep" (the given value stays, nothing
    is read), or a function of the saved ranks' values, `missing(saved) -> value`, with `saved[r]` saved rank
    r's value (tensors as new CPU tensors, state dicts as dicts); what it returns becomes `.value`. Loading
    does not use `missing` on ranks that existed; saving never does."""

    value: Any
    missing: str | Callable[[list[Any]], Any] = "error"

    def __post_init__(self) -> None:
        if not (callable(self.missing) or (isinstance(self.missing, str) and self.missing in MISSING_POLICIES)):
            raise ValueError(f"PerRank(missing=...) must be 'error', 'keep' or a function of the saved ranks' values, "
                             f"got {self.missing!r}")


@dataclass(frozen=True)
class PerRankMark:
    """Skeleton node: the subtree below was wrapped in PerRank."""

    inner: Any


@dataclass
class Pickled:
    """A value stored with pickle; only created and opened when allow_pickle is set."""

    data: bytes


@dataclass(frozen=True)
class SavedName:
    """A tensor in a saved tree (saved_tree): the name it was saved under, which the manifest lists."""

    name: str


@dataclass
class FlatState:
    skeleton: Any
    tensors: list[torch.Tensor] = field(default_factory=list)
    paths: list[str] = field(default_factory=list)


def path_str(path: tuple[Any, ...]) -> str:
    return "/".join(map(str, path)) or "<root>"


def per_rank_name(where: str, rank: int) -> str:
    """The saved name of a PerRank tensor of `rank` at path `where`."""
    return f"{where}@rank{rank}"


def _data_ptr(t: torch.Tensor) -> int:
    return t.to_local().data_ptr() if type(t).__name__ == "DTensor" else t.data_ptr()


def _view_key(t: torch.Tensor) -> tuple[Any, ...]:
    """Identifies one view of one memory: two entries with the same key are the same (tied) tensor. Cheap:
    it runs for every tensor of every save."""
    if type(t).__name__ == "DTensor":
        local = t.to_local()
        return (local.data_ptr(), local.get_device(), local.dtype, local.shape, local.stride(), tuple(t.placements))
    return t.data_ptr(), t.get_device(), t.dtype, t.shape, t.stride()


def check_dtype(t: torch.Tensor, where: str) -> None:
    if t.dtype in _UNSUPPORTED:
        raise StateError(f"tensor {where!r} has dtype {t.dtype}, which tiered_ckpt cannot store as raw bytes")
    if type(t) is not torch.Tensor and type(t) is not torch.nn.Parameter and type(t).__name__ != "DTensor":
        raise StateError(f"tensor {where!r} is a {type(t).__name__}; plain tensors and DTensors are supported")
    if t.layout is not torch.strided or t.is_nested:
        raise StateError(f"tensor {where!r} has layout {t.layout}{' (nested)' if t.is_nested else ''}; only dense "
                         f"(strided) tensors are stored: convert it, e.g. with .to_dense()")
    if t.is_meta:
        raise StateError(f"tensor {where!r} is on the meta device: it has no data to save")


def _unsupported_dtypes() -> frozenset[torch.dtype]:
    """Sub-byte placeholder dtypes (torch has no copy kernel for them) and quantized dtypes (their
    bytes mean nothing without scale and zero point)."""
    names = [f"{p}int{b}" for p in ("", "u") for b in range(1, 8)]
    names += ["qint8", "quint8", "qint32", "quint4x2", "quint2x4"]
    return frozenset(getattr(torch, n) for n in names if hasattr(torch, n))


_UNSUPPORTED = _unsupported_dtypes()


def _check_key(key: Any, path: tuple[Any, ...]) -> None:
    """A dict key the skeleton can store: a str of valid Unicode, or an int of 64 bits."""
    kind = type(key)
    if kind is str:
        if not key.isascii():  # (the message is made only for a key that fails: a state has 100k of them)
            _check_text(key, f"key {key!r} under {path_str(path)!r}")
    elif kind is not int:
        raise StateError(f"key {key!r} under {path_str(path)!r} must be a str or int")
    elif not -(2**63) <= key < 2**64:
        raise StateError(f"key {key} under {path_str(path)!r} does not fit in 64 bits (msgpack stores ints of at "
                         f"most 64 bits); use a str key")


def _check_text(text: str, what: str) -> None:
    """A str the skeleton can store: encodable as UTF-8 (a lone surrogate, e.g. from a bytes.decode with
    errors="surrogateescape", is not)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise StateError(f"{what} holds {text[e.start]!r} at position {e.start}, a lone surrogate that is not valid "
                         f"Unicode and cannot be stored as UTF-8 text; store it as bytes, or clean it (e.g. "
                         f".encode('utf-8', 'surrogateescape'))") from None




def any_in_tree(node: Any, is_leaf: Callable[[Any], bool]) -> bool:
    """Whether some node of the tree (dicts, lists and tuples walked into) is a leaf by `is_leaf`: the one walk
    behind "does this hold a tensor?", whatever a tensor is in that tree (the caller's, a saved marker, an
    export's leaf)."""
    if is_leaf(node):
        return True
    if isinstance(node, dict):
        return any(any_in_tree(v, is_leaf) for v in node.values())
    if isinstance(node, (list, tuple)):
        return any(any_in_tree(v, is_leaf) for v in node)
    return False


def _is_stateful(value: Any) -> bool:
    return callable(getattr(value, "state_dict", None)) and callable(getattr(value, "load_state_dict", None))


def encode_skeleton(skeleton: Any) -> bytes:
    def default(obj: Any) -> Any:
        if isinstance(obj, TensorRef):
            return msgpack.ExtType(_EXT_TENSOR, msgpack.packb(obj.index))
        if isinstance(obj, tuple):
            return msgpack.ExtType(_EXT_TUPLE, msgpack.packb(list(obj), default=default, strict_types=True))
        if isinstance(obj, Pickled):
            return msgpack.ExtType(_EXT_PICKLE, obj.data)
        if isinstance(obj, TensorAlias):
            return msgpack.ExtType(_EXT_ALIAS, obj.name.encode())
        if isinstance(obj, PerRankMark):
            return msgpack.ExtType(_EXT_PER_RANK, msgpack.packb(obj.inner, default=default, strict_types=True))
        raise TypeError(f"cannot encode {type(obj)}")

    try:
        return msgpack.packb(skeleton, default=default, strict_types=True)
    finally:
        del default  # see the note on reference cycles at the top


def decode_skeleton(data: bytes) -> Any:
    def ext_hook(code: int, data: bytes) -> Any:
        if code == _EXT_TENSOR:
            return tensor_ref(msgpack.unpackb(data))
        if code == _EXT_TUPLE:
            return tuple(msgpack.unpackb(data, ext_hook=ext_hook, strict_map_key=False))
        if code == _EXT_PICKLE:
            return Pickled(data)
        if code == _EXT_ALIAS:
            return TensorAlias(data.decode())
        if code == _EXT_PER_RANK:
            return PerRankMark(msgpack.unpackb(data, ext_hook=ext_hook, strict_map_key=False))
        raise StateError(f"unknown msgpack extension type {code} in the manifest")

    try:
        return msgpack.unpackb(data, ext_hook=ext_hook, strict_map_key=False)
    finally:
        del ext_hook  # see the note on reference cycles at the top


def saved_tree(skeleton: Any, rank: int = 0) -> Any:
    """A decoded skeleton as plain containers, for readers that are not a load (export, tools): each tensor
    becomes the SavedName it was saved under (a PerRank entry's: `rank`'s; a tie: the first name), a pickled
    value stays Pickled, plain values stay."""
    def walk(node: Any, path: tuple[Any, ...], per_rank: bool) -> Any:
        if isinstance(node, TensorRef):
            return SavedName(per_rank_name(path_str(path), rank) if per_rank else path_str(path))
        if isinstance(node, TensorAlias):
            return SavedName(node.name)
        if isinstance(node, PerRankMark):
            return walk(node.inner, path, True)
        if isinstance(node, dict):
            return {k: walk(v, path + (k,), per_rank) for k, v in node.items()}
        if isinstance(node, (list, tuple)):
            return type(node)(walk(v, path + (i,), per_rank) for i, v in enumerate(node))
        return node

    try:
        return walk(skeleton, (), False)
    finally:
        del walk  # see the note on reference cycles at the top
