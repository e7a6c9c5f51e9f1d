"""State ↔ (skeleton, tensors).

The skeleton is the state's nested structure with every tensor replaced by a TensorRef and every object
that has state_dict() replaced by its state dict. It is msgpack-encoded (never pickle unless the user opts
in), so plain values such as a learning rate or a step counter round-trip exactly. Every rank stores its
own skeleton. Loading walks the caller's state and a saved skeleton together and fills tensors in place.

The rules of what comes back (docs/state.md):
- a tensor is saved under its path ("model/layer/weight"); a plain tensor with the same path on several
  ranks is one replicated tensor, written once; `PerRank(x)` saves x under a per-rank name instead;
- entries that share one storage (tied weights) are saved once; the others are aliases of the first;
- a subtree that holds no tensors is a value: load replaces it whole (lists of any length, dicts, None);
- containers that hold tensors are matched strictly, key by key; a saved dtype is cast to the target's.
"""
from __future__ import annotations

import pickle
import threading
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Sequence

import msgpack
import torch

from .errors import StateError

_EXT_TENSOR, _EXT_TUPLE, _EXT_PICKLE, _EXT_ALIAS, _EXT_PER_RANK = 1, 2, 3, 4, 5
_PLAIN = (type(None), bool, int, float, str, bytes)
MAX_DEPTH = 256  # containers inside containers: msgpack (and Python's stack) stop not far above

# A note on reference cycles: the walks in this module are nested functions that call themselves, so each is
# a reference cycle (function -> closure cell -> function) holding everything it closed over. The walks `del`
# their names when done, so that what they saw is freed at once by reference counting: left to the garbage
# collector, a state of 100,000 tensors made full collections of ~0.2-0.4 s (the GIL held throughout).


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
    if type(key) not in (str, int):
        raise StateError(f"key {key!r} under {path_str(path)!r} must be a str or int")
    if type(key) is int and not -(2**63) <= key < 2**64:
        raise StateError(f"key {key} under {path_str(path)!r} does not fit in 64 bits (msgpack stores ints of at "
                         f"most 64 bits); use a str key")
    if type(key) is str:
        _check_text(key, f"key {key!r} under {path_str(path)!r}")


def _check_text(text: str, what: str) -> None:
    """A str the skeleton can store: encodable as UTF-8 (a lone surrogate, e.g. from a bytes.decode with
    errors="surrogateescape", is not)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise StateError(f"{what} holds {text[e.start]!r} at position {e.start}, a lone surrogate that is not valid "
                         f"Unicode and cannot be stored as UTF-8 text; store it as bytes, or clean it (e.g. "
                         f".encode('utf-8', 'surrogateescape'))") from None


def flatten(state: Any, *, allow_pickle: bool = False, rank: int = 0) -> FlatState:
    """Walk `state`; tensors go to FlatState.tensors, the rest into the skeleton. Errors name the key: of a
    value that cannot be stored, and of a container that contains itself (a tree is stored, not a graph)."""
    flat = FlatState(skeleton=None)
    seen: dict[int, int | list[int]] = {}  # address → index (or indexes) in flat.tensors: ties are saved once
    names: set[str] = set()
    open_containers: dict[int, tuple[Any, ...]] = {}  # id → path of each container being walked (a cycle's start)

    def walk(value: Any, path: tuple[Any, ...], per_rank: bool) -> Any:
        if isinstance(value, (dict, list, tuple)):
            if id(value) in open_containers:
                raise StateError(f"{path_str(path)!r} is {path_str(open_containers[id(value)])!r} again: the state "
                                 f"contains itself (a reference cycle), and a checkpoint stores a tree")
            if len(path) >= MAX_DEPTH:
                raise StateError(f"{path_str(path)!r} is nested {len(path)} containers deep; at most {MAX_DEPTH} "
                                 f"can be stored")
            open_containers[id(value)] = path
            try:
                return walk_container(value, path, per_rank)
            finally:
                del open_containers[id(value)]
        return walk_leaf(value, path, per_rank)

    def walk_container(value: Any, path: tuple[Any, ...], per_rank: bool) -> Any:
        if isinstance(value, dict):
            for k in value:
                _check_key(k, path)
            return {k: walk(v, path + (k,), per_rank) for k, v in value.items()}
        if isinstance(value, tuple):
            return tuple(walk(v, path + (i,), per_rank) for i, v in enumerate(value))
        return [walk(v, path + (i,), per_rank) for i, v in enumerate(value)]

    def walk_leaf(value: Any, path: tuple[Any, ...], per_rank: bool) -> Any:
        if isinstance(value, torch.Tensor):
            where = path_str(path)
            check_dtype(value, where)
            name = per_rank_name(where, rank) if per_rank else where
            if name in names:  # e.g. {"a/b": t, "a": {"b": u}} or {0: t, "0": u}: one path for two entries
                raise StateError(f"two entries of the state have the path {where!r}; rename one (paths join keys "
                                 f"with '/', and int and str keys print alike)")
            names.add(name)
            if value.numel():  # (meta tensors were refused above) empty ones may share address 0
                ptr = _data_ptr(value)  # one cheap call per tensor; the full view key only where addresses meet
                earlier = seen.get(ptr)
                if earlier is not None:
                    for other in [earlier] if isinstance(earlier, int) else earlier:
                        if _view_key(flat.tensors[other]) == _view_key(value):
                            return TensorAlias(flat.paths[other])
                    seen[ptr] = ([earlier] if isinstance(earlier, int) else earlier) + [len(flat.tensors)]
                else:
                    seen[ptr] = len(flat.tensors)  # an int: no object per tensor (the common case, no tie)
            flat.tensors.append(value)  # staging copies under no_grad: no detach needed
            flat.paths.append(name)
            return tensor_ref(len(flat.tensors) - 1)
        if isinstance(value, PerRank):
            return PerRankMark(walk(value.value, path, True))
        if _is_stateful(value):
            return walk(value.state_dict(), path, per_rank)
        if type(value) in _PLAIN:
            if type(value) is int and not -(2**63) <= value < 2**64:
                raise StateError(f"int at {path_str(path)!r} does not fit in 64 bits")
            if type(value) is str:
                _check_text(value, f"the string at {path_str(path)!r}")
            return value
        if allow_pickle:
            try:
                return Pickled(pickle.dumps(value, protocol=pickle.HIGHEST_PROTOCOL))
            except Exception as e:
                raise StateError(f"value at {path_str(path)!r} cannot be pickled: {e}") from e
        raise StateError(
            f"value at {path_str(path)!r} has type {type(value).__module__}.{type(value).__qualname__}, which "
            "is not a tensor, a container, a stateful object or a msgpack-able value; convert it, or set "
            "allow_pickle = true in [engine] to store it with pickle")

    try:
        flat.skeleton = walk(state, (), False)
    finally:
        del walk, walk_container, walk_leaf  # see the note on reference cycles at the top
    return flat


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


@dataclass(frozen=True)
class SavedTensor:
    """What a load needs to know of one saved tensor: its position in the manifest, dtype and shape."""

    index: int
    dtype: torch.dtype
    shape: tuple[int, ...]


@dataclass
class LoadTarget:
    """What one load must do: fill `tensors[index]` (the caller's tensor) from saved tensor `index`, copy
    `ties` (a saved tensor wanted by two targets that do not share storage), then, after every rank read
    its parts, run `assign` (plain values and new objects into the caller's containers) and `finish`
    (load_state_dict calls). No caller tensor is written before the reads start."""

    tensors: dict[int, tuple[str, torch.Tensor]] = field(default_factory=dict)
    ties: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)
    assign: list[Callable[[], None]] = field(default_factory=list)
    finish: list[Callable[[], None]] = field(default_factory=list)
    # entries of the checkpoint that a module of the given state lacks, as (module path, entry): not loaded; an
    # error unless another rank's module takes them (pipeline stages: each holds some layers) - Loader decides
    unexpected: list[tuple[str, str]] = field(default_factory=list)
    asked: set[str] = field(default_factory=set)  # the entries this rank's modules take, as "path.entry"

    def unexpected_error(self, taken: set[str] = frozenset()) -> "StateError | None":  # type: ignore[assignment]
        """The error for the unexpected entries no module takes (`taken`: what other ranks' modules take)."""
        left = [(m, e) for m, e in self.unexpected if f"{m}.{e}" not in taken]
        if not left:
            return None
        module = left[0][0]
        entries = sorted({e for m, e in left if m == module})
        return StateError(f"{module!r}: the checkpoint has entries the given module lacks, which its "
                          f"load_state_dict would refuse: {entries[:10]}")

    def add(self, index: int, where: str, tensor: torch.Tensor) -> None:
        if index not in self.tensors:
            self.tensors[index] = (where, tensor)
        elif _view_key(self.tensors[index][1]) != _view_key(tensor):  # a tie in the target stays filled once
            self.ties.append((self.tensors[index][1], tensor))

    def copy_ties(self) -> None:
        with torch.no_grad():
            for src, dst in self.ties:
                dst.copy_(src)

    def apply(self) -> None:
        for fn in self.assign:
            fn()
        for fn in self.finish:
            fn()

    @property
    def empty(self) -> bool:
        return not (self.tensors or self.assign or self.finish)


_MISSING = object()
_WRAPPERS = ("module.", "_orig_mod.")  # DDP / DataParallel, torch.compile


def match(state: Any, saved: Any, *, tensors: Mapping[str, SavedTensor], allow_pickle: bool, rank: int = 0,
          saved_world: int = 1, others: Sequence[Callable[[], Any]] = (),
          skeleton_of: Callable[[int], Any] | None = None) -> LoadTarget:
    """Pair the caller's state with the saved skeleton `saved` (this rank's own, or rank 0's when this rank
    did not exist at save time); `tensors` maps saved names to what was saved. A key the caller has that
    `saved` lacks is looked up in the other ranks' skeletons (`others`, decoded on demand), so a key held
    by one rank only can be loaded by any rank. `skeleton_of(r)`: saved rank r's skeleton, for a PerRank entry
    whose `missing` function derives a new rank's value from every saved rank's. Tensors the caller has are
    filled in place; keys the caller's plain dicts lack are not loaded (partial loads work); inside a stateful
    object's state dict, values the object lacks (a fresh optimizer's state) are created and handed to
    load_state_dict. Raises StateError naming the key on any mismatch, before anything is read."""
    target = LoadTarget()
    decoded: list[Any] = []
    matched = [0]  # keys of the given state found in the checkpoint (an equal value loads as "no change")

    def other_skeletons() -> list[Any]:
        if len(decoded) < len(others):
            decoded.extend(load() for load in others[len(decoded):])
        return decoded

    def find_elsewhere(path: tuple[Any, ...]) -> Any:
        for skeleton in other_skeletons():
            node = _lookup(skeleton, path)
            if node is not _MISSING and not isinstance(node, PerRankMark):  # another rank's own stays its own
                return node
        return _MISSING

    def saved_tensor(name: str, where: str) -> SavedTensor:
        found = tensors.get(name)
        if found is None:
            raise StateError(f"tensor {where!r}: the checkpoint has no data for it (saved as {name!r})")
        return found

    def materialize(saved_value: Any, path: tuple[Any, ...], per_rank: bool, owner: int = rank) -> Any:
        """A new value (new CPU tensors, filled by the reads) from the saved one; per-rank tensors are `owner`'s."""
        where = path_str(path)
        if isinstance(saved_value, (TensorRef, TensorAlias)):
            name = saved_value.name if isinstance(saved_value, TensorAlias) else (
                per_rank_name(where, owner) if per_rank else where)
            meta = saved_tensor(name, where)
            t = torch.empty(meta.shape, dtype=meta.dtype)
            target.add(meta.index, where, t)
            return t
        if isinstance(saved_value, PerRankMark):
            return materialize(saved_value.inner, path, True, owner)
        if isinstance(saved_value, dict):
            return {k: materialize(v, path + (k,), per_rank, owner) for k, v in saved_value.items()}
        if isinstance(saved_value, (list, tuple)):
            return type(saved_value)(materialize(v, path + (i,), per_rank, owner) for i, v in enumerate(saved_value))
        if isinstance(saved_value, Pickled):
            if not allow_pickle:
                raise StateError(f"value at {where!r} was saved with pickle; set allow_pickle = true to load it")
            return pickle.loads(saved_value.data)
        return saved_value

    def set_later(container: Any, key: Any, old: Any, new: Any) -> None:
        if new is not old:
            target.assign.append(lambda: container.__setitem__(key, new))

    def per_rank_inner(saved_value: PerRankMark, where: str) -> Any:
        if rank >= saved_world:
            raise StateError(f"{where!r} is per-rank and was saved by {saved_world} ranks; rank {rank} has no "
                             f"saved value (wrap it as tc.PerRank(value, missing=\"keep\") to keep the given "
                             f"value, or missing=<function of the saved ranks' values>; or load without it)")
        return saved_value.inner

    def derive(value: PerRank, path: tuple[Any, ...]) -> None:
        """A rank the saved world lacked: `.value` becomes missing(every saved rank's value), once read."""
        saved_values = []
        for r in range(saved_world):
            node = _lookup(skeleton_of(r), path) if skeleton_of is not None else _MISSING
            if not isinstance(node, PerRankMark):
                raise StateError(f"{path_str(path)!r}: saved rank {r} has no per-rank value there, so "
                                 f"PerRank(missing=...) has nothing to derive rank {rank}'s from")
            saved_values.append(materialize(node.inner, path, True, owner=r))
        derive_value = value.missing
        assert callable(derive_value)
        target.assign.append(lambda: setattr(value, "value", derive_value(saved_values)))

    def walk(value: Any, saved_value: Any, path: tuple[Any, ...], extra: str, per_rank: bool,
             modes: Mapping[Any, str] = {}) -> Any:  # noqa: B006 (read only)
        """`extra`: what to do with saved keys the caller's dict lacks: "skip" (plain dicts: partial loads),
        "fill" (a stateful object's state: create them, e.g. a fresh optimizer's), "error" (a module's state:
        load_state_dict would refuse them: recorded in `target.unexpected`, an error unless another rank's
        module takes them). `modes`: another `extra` for some keys of this dict (a stateful object's
        strict_keys and own_keys)."""
        where = path_str(path)
        if isinstance(value, PerRank):
            if not isinstance(saved_value, PerRankMark):
                raise StateError(f"{where!r} is PerRank in the given state but was not saved per rank")
            if rank >= saved_world and value.missing == "keep":
                return value  # the given value stays; nothing is read for it
            if rank >= saved_world and callable(value.missing):
                derive(value, path)
                return value
            new = walk(value.value, per_rank_inner(saved_value, where), path, extra, True)
            if new is not value.value:
                target.assign.append(lambda: setattr(value, "value", new))
            return value
        if isinstance(saved_value, PerRankMark):  # saved per rank, asked for plainly: this rank's own
            return walk(value, per_rank_inner(saved_value, where), path, extra, True)
        if isinstance(value, torch.Tensor):
            if isinstance(saved_value, TensorAlias):
                name = saved_value.name
            elif isinstance(saved_value, TensorRef):
                name = per_rank_name(where, rank) if per_rank else where
            else:
                raise StateError(f"{where!r} is a tensor in the given state but a {type(saved_value).__name__} "
                                 f"in the checkpoint")
            meta = saved_tensor(name, where)
            if tuple(value.shape) != tuple(meta.shape):
                raise StateError(f"tensor {where!r}: the given state has shape {tuple(value.shape)}, the checkpoint "
                                 f"has shape {tuple(meta.shape)}")
            if value.device.type == "meta":
                raise StateError(f"tensor {where!r} is on the meta device: it has no memory to load into "
                                 f"(materialize it first, e.g. model.to_empty(device=...))")
            if _overlaps_itself(value):
                raise StateError(f"tensor {where!r} (shape {tuple(value.shape)}, stride {value.stride()}) has elements "
                                 f"that share one memory location (an expand()ed or overlapping view): it cannot be "
                                 f"loaded into; give a tensor of its own memory (e.g. .clone() it first)")
            target.add(meta.index, where, value.detach())  # a dtype that differs is cast
            return value
        if _is_stateful(value) and not isinstance(value, (dict, list, tuple)):
            current = value.state_dict()
            # strict_keys: a module's state (TrainState's model); own_keys: state that names every entry the
            # object takes (TrainState's optimizer, initialised by get_state_dict): other entries are not read
            modes = {**dict.fromkeys(getattr(value, "own_keys", ()), "skip"),
                     **dict.fromkeys(getattr(value, "strict_keys", ()), "error")}
            filled = walk(current, saved_value, path, "error" if isinstance(value, torch.nn.Module) else "fill",
                          per_rank, modes)
            if not (isinstance(value, torch.nn.Module) and _all_in_place(current, saved_value)):
                target.finish.append(lambda v=value, sd=filled: v.load_state_dict(sd))
            return value
        if path and path[-1] == "param_groups" and _is_param_groups(value) and _is_param_groups(saved_value):
            new = regroup(value, saved_value, path)
            target.assign.append(lambda: _replace_contents(value, new))
            return value
        if not _has_tensor(value) and not _holds_tensors(saved_value):
            new = materialize(saved_value, path, per_rank)  # a value: replaced whole
            if type(value) in (dict, list) and type(new) is type(value):
                # in place: a caller holding this dict or list (progress = state["progress"]) sees the load
                target.assign.append(lambda: _replace_contents(value, new))
                return value
            return new
        if isinstance(value, dict):
            if not isinstance(saved_value, dict):
                raise StateError(f"{where!r} is a dict in the given state but a {type(saved_value).__name__} "
                                 f"in the checkpoint")
            matched[0] += sum(1 for k in value if k in saved_value)
            for k in value:
                if k not in saved_value:
                    elsewhere = find_elsewhere(path + (k,))
                    if elsewhere is _MISSING:
                        raise StateError(_missing_key_message(path, k, value, saved_value))
                    matched[0] += 1
                    set_later(value, k, value[k], walk(value[k], elsewhere, path + (k,), modes.get(k, extra),
                                                       per_rank))
            if extra == "error":  # a module's state: what it lacks is recorded, and what it takes
                target.unexpected.extend((where, str(k)) for k in saved_value if k not in value)
                target.asked.update(f"{where}.{k}" for k in value)
            for k, v in saved_value.items():
                if k in value:
                    set_later(value, k, value[k], walk(value[k], v, path + (k,), modes.get(k, extra), per_rank))
                elif extra == "fill":
                    set_later(value, k, None, materialize(v, path + (k,), per_rank))
            return value
        if isinstance(value, (list, tuple)):
            if not isinstance(saved_value, (list, tuple)) or len(saved_value) != len(value):
                raise StateError(f"{where!r}: the given state has a {type(value).__name__} of length {len(value)}, "
                                 f"the checkpoint has {saved_value!r:.80}")
            items = [walk(v, s, path + (i,), extra, per_rank)
                     for i, (v, s) in enumerate(zip(value, saved_value))]
            if isinstance(value, list):
                for i, (old, new) in enumerate(zip(value, items)):
                    set_later(value, i, old, new)
                return value
            return type(value)(items) if type(value) is tuple else type(value)(*items)
        return materialize(saved_value, path, per_rank)

    def regroup(given: list[dict[str, Any]], saved_groups: list[dict[str, Any]], path: tuple[Any, ...]) -> list[Any]:
        """An optimizer's param_groups (each naming its parameters): each given group keeps its parameters and
        takes its hyper-parameters from the saved group that holds its first parameter, in this rank's saved
        skeleton or another's (a pipeline stage may hold parameters another stage saved)."""
        candidates = [saved_groups] + [g for g in (_lookup(s, path) for s in other_skeletons()) if _is_param_groups(g)]
        out = []
        for group in given:
            params = group.get("params") or []
            found = next((g for groups in candidates for g in groups if params and params[0] in g["params"]), None)
            if found is None:
                if not params:
                    out.append(group)
                    continue
                raise StateError(f"{path_str(path)!r}: no saved param group holds parameter {params[0]!r}")
            out.append({**{k: v for k, v in found.items() if k != "params"}, "params": params})
        return out

    try:
        walk(state, saved, (), "skip", False)
    finally:
        del walk, materialize, regroup  # see the note on reference cycles at the top
    if not matched[0] and target.empty and isinstance(saved, dict) and saved:
        raise StateError(f"the given state has no key in common with the checkpoint, whose top-level keys are "
                         f"{sorted(map(str, saved))}")
    return target


def _lookup(skeleton: Any, path: tuple[Any, ...]) -> Any:
    """The node of `skeleton` at `path`, or _MISSING."""
    node = skeleton
    for k in path:
        if isinstance(node, dict) and k in node:
            node = node[k]
        elif isinstance(node, (list, tuple)) and isinstance(k, int) and 0 <= k < len(node):
            node = node[k]
        else:
            return _MISSING
    return node


def _overlaps_itself(t: torch.Tensor) -> bool:
    """Several elements of `t` are one memory location (a stride 0 along a dimension of size > 1, or any other
    overlapping view): writing into it is refused by torch."""
    local = t.to_local() if type(t).__name__ == "DTensor" else t
    if any(stride == 0 and size > 1 for size, stride in zip(local.shape, local.stride())):
        return True
    check = getattr(torch, "_debug_has_internal_overlap", None)  # 1: overlaps; 0: no; 2: too hard to tell
    return check is not None and check(local) == 1


def _is_param_groups(value: Any) -> bool:
    """An optimizer state dict's param_groups as torch's get_state_dict gives them: dicts naming their
    parameters by their fully qualified names."""
    return isinstance(value, list) and bool(value) and all(
        isinstance(g, dict) and isinstance(g.get("params"), list) and all(isinstance(p, str) for p in g["params"])
        for g in value)


def _replace_contents(container: Any, new: Any) -> None:
    container.clear()
    container.update(new) if isinstance(container, dict) else container.extend(new)


def _has_tensor(value: Any) -> bool:
    """Whether a caller's value holds a tensor (or an object whose state may: stateful objects count)."""
    if isinstance(value, (torch.Tensor, PerRank)) or _is_stateful(value):
        return True
    if isinstance(value, dict):
        return any(_has_tensor(v) for v in value.values())
    if isinstance(value, (list, tuple)):
        return any(_has_tensor(v) for v in value)
    return False


def _holds_tensors(saved: Any) -> bool:
    if isinstance(saved, (TensorRef, TensorAlias, PerRankMark)):
        return True
    if isinstance(saved, dict):
        return any(_holds_tensors(v) for v in saved.values())
    if isinstance(saved, (list, tuple)):
        return any(_holds_tensors(v) for v in saved)
    return False


def _missing_key_message(path: tuple[Any, ...], key: Any, given: dict[Any, Any], saved: dict[Any, Any]) -> str:
    message = f"key {path_str(path + (key,))!r} is in the given state but not in the checkpoint"
    if not path:
        message += f" (its top-level keys: {sorted(map(str, saved))})"
    for prefix in _WRAPPERS:
        if isinstance(key, str) and f"{prefix}{key}" in saved:
            return (f"{message}: the checkpoint's keys carry a {prefix!r} prefix (saved from a wrapped model); "
                    f"load into the wrapper, or save the unwrapped model (e.g. model.module)")
        if isinstance(key, str) and key.startswith(prefix) and key[len(prefix):] in saved:
            return (f"{message}: the given state's keys carry a {prefix!r} prefix the checkpoint lacks; load into "
                    f"the unwrapped model (e.g. model.module)")
    return message


def _all_in_place(current: Any, saved: Any) -> bool:
    """True when a module's saved state is exactly its tensors, so filling them in place is the whole load."""
    return (isinstance(current, dict) and isinstance(saved, dict) and current.keys() == saved.keys()
            and all(isinstance(v, torch.Tensor) and isinstance(saved[k], (TensorRef, TensorAlias))
                    for k, v in current.items()))
