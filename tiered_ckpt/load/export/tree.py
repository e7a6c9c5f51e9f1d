"""The exported tree: the saved state's structure (rank 0's, with keys only other ranks held merged in), its
tensors as leaves that name their place in the manifest; choosing a subtree (`--select`); walking it."""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ...errors import IntegrityError, StateError
from ...manifest import Manifest
from ...state import PerRankMark, Pickled, SavedName, any_in_tree, decode_skeleton, path_str, saved_tree


@dataclass(frozen=True)
class Leaf:
    """A saved tensor in the export's tree: its position in the manifest."""

    index: int


SKIP = object()  # a value that cannot be exported (pickled): left out
MISSING = object()


def build_tree(manifest: Manifest, skipped: list[str]) -> Any:
    """Rank 0's saved structure, with keys only other ranks held merged in (as a load at world size 1 sees
    it); tensors become Leaf, pickled values SKIP (named in `skipped`). A PerRank entry is rank 0's."""
    by_name = {t.path: i for i, t in enumerate(manifest.tensors)}
    merged = decode_skeleton(manifest.skeleton_of(0))
    for r in range(1, len(manifest.ranks)):
        if manifest.ranks[r].skeleton:
            merged = _merge(merged, decode_skeleton(manifest.skeleton_of(r)))

    def leaf(node: Any, path: tuple[Any, ...]) -> Any:
        if isinstance(node, SavedName):
            if node.name not in by_name:
                raise IntegrityError(f"step {manifest.step}: the manifest has no tensor {node.name!r} for "
                                     f"{path_str(path)!r}")
            return Leaf(by_name[node.name])
        if isinstance(node, Pickled):
            skipped.append(f"{dotted(path)!r} (a pickled value; export cannot unpickle it safely)")
            return SKIP
        return node

    return map_values(saved_tree(merged), leaf)


def map_values(tree: Any, fn: Callable[[Any, tuple[Any, ...]], Any], path: tuple[Any, ...] = ()) -> Any:
    """`tree` with every leaf (a value that is no dict, list or tuple) replaced by fn(leaf, its path)."""
    if isinstance(tree, dict):
        return {k: map_values(v, fn, path + (k,)) for k, v in tree.items()}
    if isinstance(tree, (list, tuple)):
        return type(tree)(map_values(v, fn, path + (i,)) for i, v in enumerate(tree))
    return fn(tree, path)


def _merge(base: Any, other: Any) -> Any:
    """`base` with the dict keys only `other` has (never another rank's PerRank entries)."""
    if isinstance(base, dict) and isinstance(other, dict):
        for k, v in other.items():
            if k not in base:
                if not isinstance(v, PerRankMark):
                    base[k] = v
            else:
                base[k] = _merge(base[k], v)
    elif isinstance(base, (list, tuple)) and isinstance(other, (list, tuple)) and len(base) == len(other):
        return type(base)(_merge(b, o) for b, o in zip(base, other))
    return base


def dotted(path: tuple[Any, ...]) -> str:
    return ".".join(map(str, path))


def select_subtree(tree: Any, prefix: str, step: int) -> Any:
    """The subtree whose names start with `prefix` (+ "."), names relative to it. Keys may hold dots
    themselves (a module's state dict: "0.weight"): `model.0` keeps {"weight", "bias"} of the key
    "0.weight" and "0.bias" under "model"."""
    found = _resolve(tree, prefix, prefix)
    if found is not MISSING:
        return found
    message = f"--select {prefix!r} matches nothing in step {step}"
    parts = prefix.split(".")
    for n in range(len(parts) - 1, 0, -1):  # the longest prefix that names a container: show its keys
        node = _resolve(tree, ".".join(parts[:n]), prefix)
        if isinstance(node, dict) and node:
            keys = sorted(map(str, node))
            more = f" and {len(keys) - 20} more" if len(keys) > 20 else ""
            message += f"; {'.'.join(parts[:n])!r} has keys {keys[:20]}{more}"
            break
    top = sorted(map(str, tree)) if isinstance(tree, dict) else f"a {type(tree).__name__} of {len(tree)}"
    raise StateError(f"{message}; top-level keys: {top}")


def _resolve(node: Any, rest: str, prefix: str) -> Any:
    if rest == "":
        return node
    if isinstance(node, dict):
        results, partial = [], {}
        for k, v in node.items():
            key = str(k)
            if rest == key:
                results.append(v)
            elif rest.startswith(key + "."):
                sub = _resolve(v, rest[len(key) + 1:], prefix)
                if sub is not MISSING:
                    results.append(sub)
            elif key.startswith(rest + "."):
                partial[key[len(rest) + 1:]] = v
        if partial:
            results.append(partial)
        if not results:
            return MISSING
        if len(results) == 1:
            return results[0]
        if all(isinstance(r, dict) for r in results):
            return {k: v for r in results for k, v in r.items()}
        raise StateError(f"--select {prefix!r} is ambiguous: several entries have that name")
    if isinstance(node, (list, tuple)):
        head, _, tail = rest.partition(".")
        if head.isdigit() and int(head) < len(node):
            return _resolve(node[int(head)], tail, prefix)
    return MISSING


def items(tree: Any, path: tuple[Any, ...] = ()) -> list[tuple[str, Any]]:
    """(name, leaf or value) of every leaf, in the tree's order; names join keys with "."."""
    if isinstance(tree, dict):
        return [item for k, v in tree.items() for item in items(v, path + (k,))]
    if isinstance(tree, (list, tuple)):
        return [item for i, v in enumerate(tree) for item in items(v, path + (i,))]
    return [(dotted(path), tree)]


def leaves(tree: Any) -> list[int]:
    """The manifest index of every tensor in the tree, in the tree's order (a tie once per name)."""
    return [leaf.index for _, leaf in items(tree) if isinstance(leaf, Leaf)]


def _has_leaf(node: Any) -> bool:
    return any_in_tree(node, lambda v: isinstance(v, Leaf))


def build(tree: Any, leaf: Callable[[int], Any]) -> Any:
    """`tree` with each Leaf replaced by leaf(index) (the same object for the same index: ties stay ties);
    left-out values are dropped from dicts and None in lists."""
    made: dict[int, Any] = {}

    def walk(node: Any) -> Any:
        if isinstance(node, Leaf):
            if node.index not in made:
                made[node.index] = leaf(node.index)
            return made[node.index]
        if isinstance(node, dict):
            return {k: walk(v) for k, v in node.items() if v is not SKIP}
        if isinstance(node, (list, tuple)):
            return type(node)(None if v is SKIP else walk(v) for v in node)
        return node

    try:
        return walk(tree)
    finally:
        del walk  # a nested function that calls itself is a reference cycle (see tiered_ckpt/state/skeleton.py)


def count_values(node: Any, *, json: bool = False) -> int:
    """How many plain values (leaves that are not tensors) the tree exports (`json`: bytes are not)."""
    if isinstance(node, dict):
        return sum(count_values(v, json=json) for v in node.values())
    if isinstance(node, (list, tuple)):
        return sum(count_values(v, json=json) for v in node)
    return 0 if isinstance(node, Leaf) or node is SKIP or (json and isinstance(node, bytes)) else 1
