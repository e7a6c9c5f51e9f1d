"""State ↔ (skeleton, tensors).

The skeleton is the state's nested structure with every tensor replaced by a TensorRef and every object
that has state_dict() replaced by its state dict. It is msgpack-encoded into the manifest (never pickle
unless the user opts in), so plain values such as a learning rate or a step counter round-trip exactly.
Loading walks the caller's state and the saved skeleton together and fills tensors in place.
"""
from __future__ import annotations

import pickle
from dataclasses import dataclass, field
from typing import Any, Callable

import msgpack
import torch

from .errors import StateError

_EXT_TENSOR, _EXT_TUPLE, _EXT_PICKLE = 1, 2, 3
_PLAIN = (type(None), bool, int, float, str, bytes)


@dataclass(frozen=True)
class TensorRef:
    index: int


@dataclass
class Pickled:
    """A value stored with pickle; only created and opened when allow_pickle is set."""

    data: bytes


@dataclass
class FlatState:
    skeleton: Any
    tensors: list[torch.Tensor] = field(default_factory=list)
    paths: list[str] = field(default_factory=list)


def path_str(path: tuple[Any, ...]) -> str:
    return "/".join(map(str, path)) or "<root>"


def check_dtype(t: torch.Tensor, where: str) -> None:
    if t.dtype in _UNSUPPORTED:
        raise StateError(f"tensor {where!r} has dtype {t.dtype}, which tiered_ckpt cannot store as raw bytes")
    if type(t) is not torch.Tensor and type(t) is not torch.nn.Parameter and type(t).__name__ != "DTensor":
        raise StateError(f"tensor {where!r} is a {type(t).__name__}; plain tensors and DTensors are supported")


def _unsupported_dtypes() -> frozenset[torch.dtype]:
    """Sub-byte placeholder dtypes (torch has no copy kernel for them) and quantized dtypes (their
    bytes mean nothing without scale and zero point)."""
    names = [f"{p}int{b}" for p in ("", "u") for b in range(1, 8)]
    names += ["qint8", "quint8", "qint32", "quint4x2", "quint2x4"]
    return frozenset(getattr(torch, n) for n in names if hasattr(torch, n))


_UNSUPPORTED = _unsupported_dtypes()


def flatten(state: Any, *, allow_pickle: bool = False) -> FlatState:
    """Walk `state`; tensors go to FlatState.tensors, the rest into the skeleton. Errors name the key."""
    flat = FlatState(skeleton=None)

    def walk(value: Any, path: tuple[Any, ...]) -> Any:
        if isinstance(value, torch.Tensor):
            where = path_str(path)
            check_dtype(value, where)
            flat.tensors.append(value)  # staging copies under no_grad: no detach needed
            flat.paths.append(where)
            return TensorRef(len(flat.tensors) - 1)
        if isinstance(value, dict):
            for k in value:
                if type(k) not in (str, int):
                    raise StateError(f"key {k!r} under {path_str(path)!r} must be a str or int")
            return {k: walk(v, path + (k,)) for k, v in value.items()}
        if isinstance(value, tuple):
            return tuple(walk(v, path + (i,)) for i, v in enumerate(value))
        if isinstance(value, list):
            return [walk(v, path + (i,)) for i, v in enumerate(value)]
        if _is_stateful(value):
            return walk(value.state_dict(), path)
        if type(value) in _PLAIN:
            if type(value) is int and not -(2**63) <= value < 2**64:
                raise StateError(f"int at {path_str(path)!r} does not fit in 64 bits")
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

    flat.skeleton = walk(state, ())
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
        raise TypeError(f"cannot encode {type(obj)}")

    return msgpack.packb(skeleton, default=default, strict_types=True)


def decode_skeleton(data: bytes) -> Any:
    def ext_hook(code: int, data: bytes) -> Any:
        if code == _EXT_TENSOR:
            return TensorRef(msgpack.unpackb(data))
        if code == _EXT_TUPLE:
            return tuple(msgpack.unpackb(data, ext_hook=ext_hook, strict_map_key=False))
        if code == _EXT_PICKLE:
            return Pickled(data)
        raise StateError(f"unknown msgpack extension type {code} in the manifest")

    return msgpack.unpackb(data, ext_hook=ext_hook, strict_map_key=False)


@dataclass
class LoadTarget:
    """What one load must do: fill `tensors[ref]` from saved tensor `ref`, then run `assign` (plain values
    and new objects into the caller's containers), then `finish` (load_state_dict calls). Nothing in the
    caller's state changes until the reads have succeeded."""

    tensors: dict[int, tuple[str, torch.Tensor]] = field(default_factory=dict)
    assign: list[Callable[[], None]] = field(default_factory=list)
    finish: list[Callable[[], None]] = field(default_factory=list)

    def apply(self) -> None:
        for fn in self.assign:
            fn()
        for fn in self.finish:
            fn()


def match(
    state: Any, saved: Any, *, describe: Callable[[int], tuple[torch.dtype, tuple[int, ...]]], allow_pickle: bool
) -> LoadTarget:
    """Pair the caller's state with the saved skeleton. Tensors the caller has are filled in place; keys
    the caller's plain dicts lack are not loaded (partial loads work); inside a stateful object's state
    dict, values the object lacks (e.g. a fresh optimizer's state) are created and handed to
    load_state_dict. Raises StateError naming the key on any mismatch, before anything is read."""
    target = LoadTarget()

    def materialize(saved_value: Any, path: tuple[Any, ...]) -> Any:
        if isinstance(saved_value, TensorRef):
            dtype, shape = describe(saved_value.index)
            t = torch.empty(shape, dtype=dtype)
            target.tensors[saved_value.index] = (path_str(path), t)
            return t
        if isinstance(saved_value, dict):
            return {k: materialize(v, path + (k,)) for k, v in saved_value.items()}
        if isinstance(saved_value, (list, tuple)):
            return type(saved_value)(materialize(v, path + (i,)) for i, v in enumerate(saved_value))
        if isinstance(saved_value, Pickled):
            if not allow_pickle:
                raise StateError(f"value at {path_str(path)!r} was saved with pickle; set allow_pickle = true to load it")
            return pickle.loads(saved_value.data)
        return saved_value

    def set_later(container: Any, key: Any, old: Any, new: Any) -> None:
        if new is not old:
            target.assign.append(lambda: container.__setitem__(key, new))

    def walk(value: Any, saved_value: Any, path: tuple[Any, ...], fill_missing: bool) -> Any:
        where = path_str(path)
        if isinstance(value, torch.Tensor):
            if not isinstance(saved_value, TensorRef):
                raise StateError(f"{where!r} is a tensor in the given state but a {type(saved_value).__name__} in the checkpoint")
            dtype, shape = describe(saved_value.index)
            if tuple(value.shape) != tuple(shape) or value.dtype != dtype:
                raise StateError(
                    f"tensor {where!r}: the given state has shape {tuple(value.shape)} {value.dtype}, "
                    f"the checkpoint has shape {tuple(shape)} {dtype}")
            target.tensors[saved_value.index] = (where, value.detach())
            return value
        if _is_stateful(value) and not isinstance(value, (dict, list, tuple)):
            current = value.state_dict()
            filled = walk(current, saved_value, path, True)
            if not (isinstance(value, torch.nn.Module) and _all_in_place(current, saved_value)):
                target.finish.append(lambda v=value, sd=filled: v.load_state_dict(sd))
            return value
        if isinstance(value, dict):
            if not isinstance(saved_value, dict):
                raise StateError(f"{where!r} is a dict in the given state but a {type(saved_value).__name__} in the checkpoint")
            missing = [k for k in value if k not in saved_value]
            if missing:
                raise StateError(f"key {path_str(path + (missing[0],))!r} is in the given state but not in the checkpoint")
            for k, v in saved_value.items():
                if k in value:
                    set_later(value, k, value[k], walk(value[k], v, path + (k,), fill_missing))
                elif fill_missing:
                    set_later(value, k, None, materialize(v, path + (k,)))
            return value
        if isinstance(value, (list, tuple)):
            if not isinstance(saved_value, (list, tuple)) or len(saved_value) != len(value):
                raise StateError(f"{where!r}: the given state has a {type(value).__name__} of length {len(value)}, "
                                 f"the checkpoint has {saved_value!r:.80}")
            items = [walk(v, s, path + (i,), fill_missing) for i, (v, s) in enumerate(zip(value, saved_value))]
            if isinstance(value, list):
                for i, (old, new) in enumerate(zip(value, items)):
                    set_later(value, i, old, new)
                return value
            return type(value)(items) if type(value) is tuple else type(value)(*items)
        return materialize(saved_value, path)

    walk(state, saved, (), False)
    return target


def _all_in_place(current: Any, saved: Any) -> bool:
    """True when a module's saved state is exactly its tensors, so filling them in place is the whole load."""
    return (isinstance(current, dict) and isinstance(saved, dict) and current.keys() == saved.keys()
            and all(isinstance(v, torch.Tensor) and isinstance(saved[k], TensorRef) for k, v in current.items()))
