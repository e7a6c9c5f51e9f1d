"""How a DCP state dict is laid out in a tiered_ckpt checkpoint, and DCP's Metadata read back from its manifest.

Each rank saves one flat state: every tensor under its fully qualified name (FQN), DTensors as DTensors (the
manifest then records each shard's box in the global tensor, exactly DCP's chunks), and every other value as
DCP stores it, `torch.save` bytes, under `__dcp__/bytes/rank<r>/<fqn>`; DCP's flatten mappings (its
`planner_data`) go under `__dcp__/planner/rank<r>` as JSON. DCP's global Metadata is then a view of the
checkpoint's manifest (tensors, shapes, chunks) and needs no record of its own: it is committed with the data
by the project's commit, and `ls`, `show`, `export`, `verify` and the engine's own `load` see ordinary
tensors.
"""
from __future__ import annotations

import io
import json
from dataclasses import dataclass
from typing import Any, Iterable, Mapping

import torch
from torch.distributed.checkpoint.metadata import (BytesStorageMetadata, ChunkStorageMetadata, Metadata,
                                                   MetadataIndex, StorageMeta, TensorProperties,
                                                   TensorStorageMetadata)

from ..distributed.dtensor import is_dtensor
from ..errors import StateError
from ..manifest import Manifest

PREFIX = "__dcp__"


@dataclass(frozen=True)
class Stored:
    """Where a chunk DCP knows by (fqn, offsets) lies: in the checkpoint's tensor `path`, at `offsets`."""

    path: str
    offsets: tuple[int, ...]


def bytes_path(rank: int, fqn: str) -> str:
    return f"{PREFIX}/bytes/rank{rank}/{fqn}"


def as_bytes_tensor(data: bytes) -> torch.Tensor:
    return torch.frombuffer(bytearray(data), dtype=torch.uint8) if data else torch.empty(0, dtype=torch.uint8)


def serialized(value: Any) -> bytes:
    """A value DCP keeps as bytes, serialized as DCP's planner does (torch.save)."""
    buf = io.BytesIO()
    torch.save(value, buf)
    return buf.getvalue()


def rank_state(values: Iterable[tuple[str, Any]], rank: int, mappings: Mapping[str, Any] | None) -> dict[str, Any]:
    """The state this rank hands the engine: tensors by FQN, other values as bytes (already serialized, an
    io.BytesIO from DCP's planner, or anything torch.save takes)."""
    state: dict[str, Any] = {}
    stored: dict[str, torch.Tensor] = {}
    for fqn, value in values:
        if fqn.startswith(PREFIX):
            raise StateError(f"state key {fqn!r}: keys starting with {PREFIX!r} are tiered_ckpt's own (DCP layout)")
        if type(value).__name__ == "ShardedTensor":
            raise StateError(f"{fqn!r} is a ShardedTensor (FSDP1's sharded state dict): save DTensors (FSDP2) or "
                             f"full tensors")
        if isinstance(value, torch.Tensor):
            state[fqn] = value if is_dtensor(value) else value.detach()
            continue
        data = value.getvalue() if isinstance(value, io.BytesIO) else serialized(value)
        stored[fqn] = as_bytes_tensor(data)
    extra: dict[str, Any] = {}
    if stored:
        extra["bytes"] = {f"rank{rank}": stored}
    if mappings:
        extra["planner"] = {f"rank{rank}": as_bytes_tensor(json.dumps({k: list(v) for k, v in mappings.items()})
                                                           .encode())}
    if extra:
        state[PREFIX] = extra
    return state


def check_whole(fqn: str, item_offsets: Any, item_sizes: Any, size: Any, value: Any) -> None:
    """A tensor DCP plans as one chunk must be a DTensor (its shard is its box) or the whole tensor."""
    if is_dtensor(value):
        return
    if any(item_offsets) or tuple(item_sizes) != tuple(size):
        raise StateError(f"{fqn!r}: the planner wrote a chunk (offsets {tuple(item_offsets)}, sizes "
                         f"{tuple(item_sizes)}) of a plain tensor of shape {tuple(size)}; tiered_ckpt stores whole "
                         f"plain tensors and DTensor shards (use DCP's DefaultSavePlanner)")


def metadata_of(manifest: Manifest, planner_data: dict[str, Any] | None, checkpoint_id: str) -> Metadata:
    """DCP's Metadata of a checkpoint, from its manifest: every tensor with its chunks, every value kept as bytes
    (the lowest rank's, as DCP's deduplication keeps), and `storage_data` saying where each lies."""
    state: dict[str, Any] = {}
    storage: dict[MetadataIndex, Stored] = {}
    byte_owner: dict[str, int] = {}
    bytes_prefix = f"{PREFIX}/bytes/rank"
    for meta in manifest.tensors:
        path = meta.path
        if path.startswith(bytes_prefix):
            rank_text, _, fqn = path[len(bytes_prefix):].partition("/")
            rank = int(rank_text)
            if fqn not in byte_owner or rank < byte_owner[fqn]:
                byte_owner[fqn] = rank
                state[fqn] = BytesStorageMetadata()
                storage[MetadataIndex(fqn)] = Stored(path, ())
            continue
        if path.startswith(PREFIX + "/"):
            continue
        chunks = [ChunkStorageMetadata(offsets=torch.Size(c.offsets), sizes=torch.Size(c.sizes))
                  for c in meta.chunks]
        state[path] = TensorStorageMetadata(properties=TensorProperties(dtype=meta.torch_dtype),
                                            size=torch.Size(meta.shape), chunks=chunks)
        for c in meta.chunks:
            storage[MetadataIndex(path, c.offsets)] = Stored(path, tuple(c.offsets))
    return Metadata(state_dict_metadata=state, planner_data=planner_data, storage_data=storage,
                    storage_meta=StorageMeta(checkpoint_id=checkpoint_id))


def planner_paths(manifest: Manifest) -> list[str]:
    """The paths of the ranks' saved flatten mappings."""
    return [t.path for t in manifest.tensors if t.path.startswith(f"{PREFIX}/planner/")]


def merged_mappings(blobs: Iterable[bytes]) -> dict[str, Any] | None:
    merged: dict[str, Any] = {}
    for blob in blobs:
        merged.update({k: tuple(v) for k, v in json.loads(blob).items()})
    return merged or None
