"""A state → its skeleton and its tensors, for a save: errors name the key of a value that cannot be stored."""
from __future__ import annotations

import pickle
from typing import Any, Callable

import torch

from ..errors import StateError
from .skeleton import (MAX_DEPTH, _PLAIN, _UNSUPPORTED, FlatState, PerRank, PerRankMark, Pickled, TensorAlias, _check_key,
                       _check_text, _data_ptr, _is_stateful, _view_key, check_dtype, path_str, per_rank_name,
                       tensor_ref)

def flatten(state: Any, *, allow_pickle: bool = False, rank: int = 0,
            on_tensor: Callable[[int, torch.Tensor], None] | None = None,
            on_state_dict: Callable[[], None] | None = None) -> FlatState:
    """Walk `state`; tensors go to FlatState.tensors, the rest into the skeleton. Errors name the key: of a
    value that cannot be stored, and of a container that contains itself (a tree is stored, not a graph).
    `on_tensor(index, tensor)` is called as each tensor is added, `on_state_dict()` after each stateful
    object's state_dict() returned (a save launches copies as it walks: save/early.py)."""
    flat = FlatState(skeleton=None)
    seen: dict[int, int | list[int]] = {}  # address → index (or indexes) in flat.tensors: ties are saved once
    names: set[str] = set()
    open_containers: dict[int, tuple[Any, ...]] = {}  # id → path of each container being walked (a cycle's start)

    def walk(value: Any, path: tuple[Any, ...], where: str, per_rank: bool) -> Any:
        # `where` is path_str(path), built a key at a time: joining the whole path again for each of 100k
        # tensors was a fifth of a save's Python time
        if type(value) is torch.Tensor or type(value) is torch.nn.Parameter:  # the common leaf, first
            if value.dtype in _UNSUPPORTED or value.layout is not torch.strided or value.is_nested or value.is_meta:
                check_dtype(value, where or "<root>")  # raises, naming the tensor and what is wrong
            return walk_tensor(value, where or "<root>", per_rank, value.data_ptr())
        if isinstance(value, (dict, list, tuple)):
            if id(value) in open_containers:
                raise StateError(f"{path_str(path)!r} is {path_str(open_containers[id(value)])!r} again: the state "
                                 f"contains itself (a reference cycle), and a checkpoint stores a tree")
            if len(path) >= MAX_DEPTH:
                raise StateError(f"{path_str(path)!r} is nested {len(path)} containers deep; at most {MAX_DEPTH} "
                                 f"can be stored")
            open_containers[id(value)] = path
            try:
                return walk_container(value, path, where, per_rank)
            finally:
                del open_containers[id(value)]
        return walk_leaf(value, path, where, per_rank)

    def walk_container(value: Any, path: tuple[Any, ...], where: str, per_rank: bool) -> Any:
        prefix = where + "/" if path else ""  # (not `if where`: a key "" makes a path whose string is "")
        if isinstance(value, dict):  # each key checked as it is reached: a save's copies start at the first tensor
            out = {}
            for k, v in value.items():
                _check_key(k, path)
                out[k] = walk(v, path + (k,), f"{prefix}{k}", per_rank)
            return out
        if isinstance(value, tuple):
            return tuple(walk(v, path + (i,), f"{prefix}{i}", per_rank) for i, v in enumerate(value))
        return [walk(v, path + (i,), f"{prefix}{i}", per_rank) for i, v in enumerate(value)]

    def walk_tensor(value: torch.Tensor, where: str, per_rank: bool, ptr: int) -> Any:
        """A tensor that check_dtype accepts, whose data is at `ptr`."""
        name = per_rank_name(where, rank) if per_rank else where
        if name in names:  # e.g. {"a/b": t, "a": {"b": u}} or {0: t, "0": u}: one path for two entries
            raise StateError(f"two entries of the state have the path {where!r}; rename one (paths join keys "
                             f"with '/', and int and str keys print alike)")
        names.add(name)
        if ptr:  # (an empty tensor may have none) the full view key only where addresses meet
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
        if on_tensor is not None:
            on_tensor(len(flat.tensors) - 1, value)
        return tensor_ref(len(flat.tensors) - 1)

    def walk_leaf(value: Any, path: tuple[Any, ...], where: str, per_rank: bool) -> Any:
        if isinstance(value, torch.Tensor):  # a subclass (DTensor), or one check_dtype refuses
            check_dtype(value, where or "<root>")
            return walk_tensor(value, where or "<root>", per_rank, _data_ptr(value))
        if isinstance(value, PerRank):
            return PerRankMark(walk(value.value, path, where, True))
        if _is_stateful(value):
            inner = value.state_dict()
            if on_state_dict is not None:
                on_state_dict()
            return walk(inner, path, where, per_rank)
        if type(value) in _PLAIN:
            if type(value) is int and not -(2**63) <= value < 2**64:
                raise StateError(f"int at {path_str(path)!r} does not fit in 64 bits")
            if type(value) is str and not value.isascii():
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
        flat.skeleton = walk(state, (), "", False)
    finally:
        del walk, walk_container, walk_tensor, walk_leaf  # see the note on reference cycles in skeleton.py
    return flat
