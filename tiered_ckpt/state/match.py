"""A caller's state paired with a saved skeleton, for a load: which saved tensor fills which of the caller's
tensors, what is assigned once every rank has read, and the errors that name a mismatch before anything is
read (docs/state.md has the rules).
"""
from __future__ import annotations

import pickle
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Mapping, NamedTuple, Sequence

import torch

from ..errors import StateError
from ..release import by_index, empty
from .skeleton import (PerRank, PerRankMark, Pickled, TensorAlias, TensorRef, _is_stateful, _view_key, any_in_tree,
                       path_str, per_rank_name)


class SavedTensor(NamedTuple):
    """What a load needs to know of one saved tensor: its position in the manifest, dtype and shape. (A
    NamedTuple: made once per tensor a load pairs, in half the time of a frozen dataclass.)"""

    index: int
    dtype: torch.dtype
    shape: tuple[int, ...]


class Targets(Mapping[int, "tuple[str, torch.Tensor]"]):
    """Saved tensor index → (the caller's key, the caller's tensor), kept as two dicts of existing objects: a
    tuple per tensor would be 100k more objects alive through a load's reads, enough to set off a full
    collection of Python's garbage collector (docs/benchmarks.md, many small tensors). Both cut into blocks of
    2**INDEX_SHIFT indexes (a dict of 1M entries grows by resizes that each hold the GIL up to 70 ms, in the
    thread that pairs, and the loop waits as long: release.py)."""

    def __init__(self) -> None:
        self._blocks: dict[int, tuple[dict[int, str], dict[int, torch.Tensor]]] = {}
        self._count = 0

    def put(self, index: int, where: str, tensor: torch.Tensor) -> torch.Tensor | None:
        """Pair `index` with (where, tensor) unless it is paired: then its tensor, and nothing changes."""
        name = by_index(index)
        block = self._blocks.get(name)
        if block is None:
            block = self._blocks[name] = ({}, {})
        held = block[1].get(index)
        if held is None:
            block[0][index] = where
            block[1][index] = tensor
            self._count += 1
        return held

    def __getitem__(self, index: int) -> tuple[str, torch.Tensor]:
        block = self._blocks.get(by_index(index))
        if block is None:
            raise KeyError(index)
        return block[0][index], block[1][index]

    def items(self) -> Iterator[tuple[int, tuple[str, torch.Tensor]]]:  # type: ignore[override]
        for where, tensor in list(self._blocks.values()):
            for index, t in tensor.items():
                yield index, (where[index], t)

    def values(self) -> Iterator[tuple[str, torch.Tensor]]:  # type: ignore[override]
        return (pair for _, pair in self.items())

    def __iter__(self) -> Iterator[int]:
        for _, tensor in list(self._blocks.values()):
            yield from tensor

    def __len__(self) -> int:
        return self._count

    def __contains__(self, index: object) -> bool:
        try:
            block = self._blocks.get(by_index(index))  # type: ignore[arg-type]
        except TypeError:  # (not an integer: no index)
            return False
        return block is not None and index in block[1]

    @property
    def largest_block(self) -> int:
        """The pairings of its largest block: the most that one resize moves."""
        return max((len(t) for _, t in self._blocks.values()), default=0)

    def release(self) -> None:
        """Forget every pairing, a batch at a time (in a thread: 1M entries freed in one go hold the GIL)."""
        while self._blocks:
            _, (where, tensor) = self._blocks.popitem()
            empty(where)
            empty(tensor)
        self._count = 0


@dataclass
class LoadTarget:
    """What one load must do: fill `tensors[index]` (the caller's tensor) from saved tensor `index`, copy
    `ties` (a saved tensor wanted by two targets that do not share storage), then, after every rank read
    its parts, run `assign` (plain values and new objects into the caller's containers) and `finish`
    (load_state_dict calls). No caller tensor is written before the reads start."""

    tensors: Targets = field(default_factory=Targets)
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
        held = self.tensors.put(index, where, tensor)
        if held is not None and _view_key(held) != _view_key(tensor):  # a tie in the target stays filled once
            self.ties.append((held, tensor))

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

    def release(self) -> None:
        """Forget everything it pairs and does, a batch at a time (a load's end, in a thread)."""
        self.tensors.release()
        for held in (self.ties, self.assign, self.finish, self.unexpected, self.asked):
            empty(held)


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
    return Matcher(tensors, allow_pickle=allow_pickle, rank=rank, saved_world=saved_world, others=others,
                   skeleton_of=skeleton_of).run(state, saved)


class Matcher:
    """One pairing of a caller's state with a saved skeleton (see match()): what it found so far lives in
    `target`, the other ranks' skeletons are decoded once, on first need."""

    def __init__(self, tensors: Mapping[str, SavedTensor], *, allow_pickle: bool, rank: int, saved_world: int,
                 others: Sequence[Callable[[], Any]], skeleton_of: Callable[[int], Any] | None):
        self.tensors = tensors
        self.allow_pickle = allow_pickle
        self.rank = rank
        self.saved_world = saved_world
        self.others = others
        self.skeleton_of = skeleton_of
        self.target = LoadTarget()
        self.decoded: list[Any] = []
        self.matched = 0  # keys of the given state found in the checkpoint (an equal value loads as "no change")

    def run(self, state: Any, saved: Any) -> LoadTarget:
        if not (isinstance(state, (dict, list, tuple, torch.Tensor, PerRank)) or _is_stateful(state)):
            # a value at the top cannot be replaced in place: the load would read everything into nothing
            raise StateError(f"load() fills the state it is given in place: a dict, list, tuple, tensor or an "
                             f"object with state_dict()/load_state_dict(), not {type(state).__name__} ({state!r:.60})")
        self.walk(state, saved, (), "skip", False)
        if not self.matched and self.target.empty and isinstance(saved, dict) and saved:
            raise StateError(f"the given state has no key in common with the checkpoint, whose top-level keys are "
                             f"{sorted(map(str, saved))}")
        return self.target

    def other_skeletons(self) -> list[Any]:
        if len(self.decoded) < len(self.others):
            self.decoded.extend(load() for load in self.others[len(self.decoded):])
        return self.decoded

    def find_elsewhere(self, path: tuple[Any, ...]) -> Any:
        for skeleton in self.other_skeletons():
            node = _lookup(skeleton, path)
            if node is not _MISSING and not isinstance(node, PerRankMark):  # another rank's own stays its own
                return node
        return _MISSING

    def saved_tensor(self, name: str, where: str) -> SavedTensor:
        found = self.tensors.get(name)
        if found is None:
            raise StateError(f"tensor {where!r}: the checkpoint has no data for it (saved as {name!r})")
        return found

    def materialize(self, saved_value: Any, path: tuple[Any, ...], per_rank: bool, owner: int | None = None) -> Any:
        """A new value (new CPU tensors, filled by the reads) from the saved one; per-rank tensors are `owner`'s
        (default: this rank's)."""
        owner = self.rank if owner is None else owner
        where = path_str(path)
        if isinstance(saved_value, (TensorRef, TensorAlias)):
            name = saved_value.name if isinstance(saved_value, TensorAlias) else (
                per_rank_name(where, owner) if per_rank else where)
            meta = self.saved_tensor(name, where)
            t = torch.empty(meta.shape, dtype=meta.dtype)
            self.target.add(meta.index, where, t)
            return t
        if isinstance(saved_value, PerRankMark):
            return self.materialize(saved_value.inner, path, True, owner)
        if isinstance(saved_value, dict):
            return {k: self.materialize(v, path + (k,), per_rank, owner) for k, v in saved_value.items()}
        if isinstance(saved_value, (list, tuple)):
            return type(saved_value)(self.materialize(v, path + (i,), per_rank, owner)
                                     for i, v in enumerate(saved_value))
        if isinstance(saved_value, Pickled):
            if not self.allow_pickle:
                raise StateError(f"value at {where!r} was saved with pickle; set allow_pickle = true to load it")
            return pickle.loads(saved_value.data)
        return saved_value

    def set_later(self, container: Any, key: Any, old: Any, new: Any) -> None:
        if new is not old:
            self.target.assign.append(lambda: container.__setitem__(key, new))

    def per_rank_inner(self, saved_value: PerRankMark, where: str) -> Any:
        if self.rank >= self.saved_world:
            raise StateError(f"{where!r} is per-rank and was saved by {self.saved_world} ranks; rank {self.rank} has "
                             f"no saved value (wrap it as tc.PerRank(value, missing=\"keep\") to keep the given "
                             f"value, or missing=<function of the saved ranks' values>; or load without it)")
        return saved_value.inner

    def derive(self, value: PerRank, path: tuple[Any, ...]) -> None:
        """A rank the saved world lacked: `.value` becomes missing(every saved rank's value), once read."""
        saved_values = []
        for r in range(self.saved_world):
            node = _lookup(self.skeleton_of(r), path) if self.skeleton_of is not None else _MISSING
            if not isinstance(node, PerRankMark):
                raise StateError(f"{path_str(path)!r}: saved rank {r} has no per-rank value there, so "
                                 f"PerRank(missing=...) has nothing to derive rank {self.rank}'s from")
            saved_values.append(self.materialize(node.inner, path, True, owner=r))
        derive_value = value.missing
        assert callable(derive_value)
        self.target.assign.append(lambda: setattr(value, "value", derive_value(saved_values)))

    def walk(self, value: Any, saved_value: Any, path: tuple[Any, ...], extra: str, per_rank: bool,
             modes: Mapping[Any, str] = {}) -> Any:  # noqa: B006 (read only)
        """`extra`: what to do with saved keys the caller's dict lacks: "skip" (plain dicts: partial loads),
        "fill" (a stateful object's state: create them, e.g. a fresh optimizer's), "error" (a module's state:
        load_state_dict would refuse them: recorded in `target.unexpected`, an error unless another rank's
        module takes them). `modes`: another `extra` for some keys of this dict (a stateful object's
        strict_keys and own_keys)."""
        where = path_str(path)
        if isinstance(value, PerRank):
            return self._per_rank(value, saved_value, path, extra)
        if isinstance(saved_value, PerRankMark):  # saved per rank, asked for plainly: this rank's own
            return self.walk(value, self.per_rank_inner(saved_value, where), path, extra, True)
        if isinstance(value, torch.Tensor):
            return self._tensor(value, saved_value, where, per_rank)
        if _is_stateful(value) and not isinstance(value, (dict, list, tuple)):
            return self._stateful(value, saved_value, path, per_rank)
        if path and path[-1] == "param_groups" and _is_param_groups(value) and _is_param_groups(saved_value):
            new = self.regroup(value, saved_value, path)
            self.target.assign.append(lambda: _replace_contents(value, new))
            return value
        if extra == "fill" and path and path[-1] == "param_groups" and _is_param_groups(value, int) and \
                _is_param_groups(saved_value, int):  # an optimizer's own state dict
            _check_group_sizes(value, saved_value, where)  # before any byte is read: torch's check, named
        if not _has_tensor(value) and not _holds_tensors(saved_value):
            new = self.materialize(saved_value, path, per_rank)  # a value: replaced whole
            if type(value) in (dict, list) and type(new) is type(value):
                # in place: a caller holding this dict or list (progress = state["progress"]) sees the load
                self.target.assign.append(lambda: _replace_contents(value, new))
                return value
            return new
        if isinstance(value, dict):
            return self._dict(value, saved_value, path, extra, per_rank, modes)
        if isinstance(value, (list, tuple)):
            if not isinstance(saved_value, (list, tuple)) or len(saved_value) != len(value):
                raise StateError(f"{where!r}: the given state has a {type(value).__name__} of length {len(value)}, "
                                 f"the checkpoint has {saved_value!r:.80}")
            items = [self.walk(v, s, path + (i,), extra, per_rank)
                     for i, (v, s) in enumerate(zip(value, saved_value))]
            if isinstance(value, list):
                for i, (old, new) in enumerate(zip(value, items)):
                    self.set_later(value, i, old, new)
                return value
            return type(value)(items) if type(value) is tuple else type(value)(*items)
        return self.materialize(saved_value, path, per_rank)

    def _per_rank(self, value: PerRank, saved_value: Any, path: tuple[Any, ...], extra: str) -> Any:
        where = path_str(path)
        if not isinstance(saved_value, PerRankMark):
            raise StateError(f"{where!r} is PerRank in the given state but was not saved per rank")
        if self.rank >= self.saved_world and value.missing == "keep":
            return value  # the given value stays; nothing is read for it
        if self.rank >= self.saved_world and callable(value.missing):
            self.derive(value, path)
            return value
        new = self.walk(value.value, self.per_rank_inner(saved_value, where), path, extra, True)
        if new is not value.value:
            self.target.assign.append(lambda: setattr(value, "value", new))
        return value

    def _tensor(self, value: torch.Tensor, saved_value: Any, where: str, per_rank: bool) -> torch.Tensor:
        if isinstance(saved_value, TensorAlias):
            name = saved_value.name
        elif isinstance(saved_value, TensorRef):
            name = per_rank_name(where, self.rank) if per_rank else where
        else:
            raise StateError(f"{where!r} is a tensor in the given state but a {type(saved_value).__name__} "
                             f"in the checkpoint")
        meta = self.saved_tensor(name, where)
        if value.shape != meta.shape:  # (torch.Size compares with a tuple as a tuple)
            raise StateError(f"tensor {where!r}: the given state has shape {tuple(value.shape)}, the checkpoint "
                             f"has shape {tuple(meta.shape)}")
        if value.is_meta:
            raise StateError(f"tensor {where!r} is on the meta device: it has no memory to load into "
                             f"(materialize it first, e.g. model.to_empty(device=...))")
        if _overlaps_itself(value):
            raise StateError(f"tensor {where!r} (shape {tuple(value.shape)}, stride {value.stride()}) has elements "
                             f"that share one memory location (an expand()ed or overlapping view): it cannot be "
                             f"loaded into; give a tensor of its own memory (e.g. .clone() it first)")
        # a dtype that differs is cast; detached only where autograd tracks it (no new object per tensor else)
        self.target.add(meta.index, where, value.detach() if value.requires_grad else value)
        return value

    def _stateful(self, value: Any, saved_value: Any, path: tuple[Any, ...], per_rank: bool) -> Any:
        current = value.state_dict()
        # strict_keys: a module's state (TrainState's model); own_keys: state that names every entry the
        # object takes (TrainState's optimizer, initialised by get_state_dict): other entries are not read
        modes = {**dict.fromkeys(getattr(value, "own_keys", ()), "skip"),
                 **dict.fromkeys(getattr(value, "strict_keys", ()), "error")}
        filled = self.walk(current, saved_value, path, "error" if isinstance(value, torch.nn.Module) else "fill",
                           per_rank, modes)
        if not (isinstance(value, torch.nn.Module) and _all_in_place(current, saved_value)):
            self.target.finish.append(lambda v=value, sd=filled: _load_state_dict(v, sd, path))
        return value

    def _dict(self, value: dict[Any, Any], saved_value: Any, path: tuple[Any, ...], extra: str, per_rank: bool,
              modes: Mapping[Any, str]) -> dict[Any, Any]:
        where = path_str(path)
        if not isinstance(saved_value, dict):
            raise StateError(f"{where!r} is a dict in the given state but a {type(saved_value).__name__} "
                             f"in the checkpoint")
        self.matched += sum(1 for k in value if k in saved_value)
        for k in value:
            if k not in saved_value:
                elsewhere = self.find_elsewhere(path + (k,))
                if elsewhere is _MISSING:
                    raise StateError(_missing_key_message(path, k, value, saved_value))
                self.matched += 1
                self.set_later(value, k, value[k], self.walk(value[k], elsewhere, path + (k,), modes.get(k, extra),
                                                             per_rank))
        if extra == "error":  # a module's state: what it lacks is recorded, and what it takes
            self.target.unexpected.extend((where, str(k)) for k in saved_value if k not in value)
            self.target.asked.update(f"{where}.{k}" for k in value)
        for k, v in saved_value.items():
            if k in value:
                self.set_later(value, k, value[k], self.walk(value[k], v, path + (k,), modes.get(k, extra), per_rank))
            elif extra == "fill":
                self.set_later(value, k, None, self.materialize(v, path + (k,), per_rank))
        return value

    def regroup(self, given: list[dict[str, Any]], saved_groups: list[dict[str, Any]],
                path: tuple[Any, ...]) -> list[Any]:
        """An optimizer's param_groups (each naming its parameters): each given group keeps its parameters and
        takes its hyper-parameters from the saved group that holds its first parameter, in this rank's saved
        skeleton or another's (a pipeline stage may hold parameters another stage saved)."""
        candidates = [saved_groups] + [g for g in (_lookup(s, path) for s in self.other_skeletons())
                                       if _is_param_groups(g)]
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
    if local.is_contiguous():  # the common case, decided in C: a contiguous tensor never overlaps itself
        return False
    if any(stride == 0 and size > 1 for size, stride in zip(local.shape, local.stride())):
        return True
    check = getattr(torch, "_debug_has_internal_overlap", None)  # 1: overlaps; 0: no; 2: too hard to tell
    return check is not None and check(local) == 1


def _is_param_groups(value: Any, kind: type = str) -> bool:
    """An optimizer state dict's param_groups: dicts naming their parameters by their fully qualified names
    (`str`, as torch's get_state_dict gives them) or by their index (`int`, as optimizer.state_dict() does)."""
    return isinstance(value, list) and bool(value) and all(
        isinstance(g, dict) and isinstance(g.get("params"), list) and all(type(p) is kind for p in g["params"])
        for g in value)


def _check_group_sizes(given: list[dict[str, Any]], saved: list[dict[str, Any]], where: str) -> None:
    """The optimizer's load_state_dict refuses groups of other sizes, but only after the rest of the state
    (the model's tensors) was loaded: refused here, before any byte is read."""
    given_sizes, saved_sizes = [len(g["params"]) for g in given], [len(g["params"]) for g in saved]
    if given_sizes != saved_sizes:
        raise StateError(f"{where!r}: the optimizer's parameter groups hold {given_sizes} parameters, the saved "
                         f"one's {saved_sizes}: build the optimizer over the same parameters, in the same groups, "
                         f"as the one saved")


def _load_state_dict(obj: Any, state_dict: Any, path: tuple[Any, ...]) -> None:
    """obj.load_state_dict, its refusal named: it runs last, once the tensors are in place."""
    try:
        obj.load_state_dict(state_dict)
    except Exception as e:
        raise StateError(f"{path_str(path)!r}: {type(obj).__name__}.load_state_dict refused the saved state (the "
                         f"tensors were loaded already): {type(e).__name__}: {e}") from e


def _replace_contents(container: Any, new: Any) -> None:
    container.clear()
    container.update(new) if isinstance(container, dict) else container.extend(new)


def _has_tensor(value: Any) -> bool:
    """Whether a caller's value holds a tensor (or an object whose state may: stateful objects count)."""
    return any_in_tree(value, lambda v: isinstance(v, (torch.Tensor, PerRank)) or _is_stateful(v))


def _holds_tensors(saved: Any) -> bool:
    """Whether a saved skeleton's node holds a tensor (a reference, an alias or a per-rank value)."""
    return any_in_tree(saved, lambda v: isinstance(v, (TensorRef, TensorAlias, PerRankMark)))


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
