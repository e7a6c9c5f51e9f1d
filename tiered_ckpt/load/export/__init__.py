"""Export one checkpoint as a file other tools read: safetensors, a `torch.save` file, or a DCP directory.

Export is read-only: it picks the checkpoint, reads its manifest and its parts like a load does (every part
through `TierIO.read_verified`: checksum checked, tier by tier fallback) and never fences, commits or
deletes anything, so it may run beside a training job (docs/export.md).

Tensors come out whole, whatever the saving layout: the chunks of a sharded tensor (DTensor, FSDP2, any
world size) are assembled into one full tensor. They are read in groups of about one part's worth of bytes
(or one larger tensor alone), so the memory held is about one full tensor plus a few parts:
- safetensors: the header is written first (every name, dtype and shape is in the manifest), then each
  tensor's bytes in order, group by group; plain values go into the header's metadata as JSON;
- dcp: `torch.distributed.checkpoint.save` plans with placeholder tensors, and each tensor is read when its
  writer asks for it (a small cache keeps the rest of its group);
- torch: one `torch.save` of the nested state, which needs the whole selected state in memory (as
  `torch.load` of the file will).

Names are the state's paths joined with "."; `select` keeps one subtree, with names relative to it.
"""
from __future__ import annotations

import asyncio
import ctypes
import json
import logging
import os
import secrets
import shutil
import struct
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from ...errors import IncompleteCheckpoint, IntegrityError, StateError
from ...layout import PartKey
from ..reads import Reads, part_views
from ...manifest import Manifest, TensorMeta
from ...save.pool import tensor_bytes
from ...state import (
    PerRankMark,
    Pickled,
    TensorAlias,
    TensorRef,
    decode_skeleton,
    path_str,
    per_rank_name,
)
from ...storage.tier_io import Fallback, PartRead, ReadLog

if TYPE_CHECKING:
    from ...engine import Engine

log = logging.getLogger(__name__)
FORMATS = ("safetensors", "torch", "dcp")
VALUES_KEY = "tiered_ckpt.values"  # safetensors metadata: the plain values, as JSON
_MAX_HEADER = 100_000_000  # the largest header safetensors readers accept

# torch dtype → safetensors' name for it (narrowed to what the installed reader knows, when one is installed)
_SAFETENSORS_DTYPES = {
    "float64": "F64", "float32": "F32", "float16": "F16", "bfloat16": "BF16",
    "int64": "I64", "int32": "I32", "int16": "I16", "int8": "I8",
    "uint64": "U64", "uint32": "U32", "uint16": "U16", "uint8": "U8", "bool": "BOOL",
    "float8_e4m3fn": "F8_E4M3", "float8_e5m2": "F8_E5M2", "float8_e4m3fnuz": "F8_E4M3FNUZ",
    "float8_e5m2fnuz": "F8_E5M2FNUZ", "float8_e8m0fnu": "F8_E8M0", "complex64": "C64",
}


@dataclass
class ExportInfo:
    """What an export wrote: the step, the format and path, how many tensors and bytes of tensor data,
    how many plain values, what was left out (and why), and which tiers served the reads."""

    step: int
    format: str
    path: str
    tensors: int = 0
    nbytes: int = 0
    values: int = 0
    skipped: list[str] = field(default_factory=list)
    bytes_by_tier: dict[str, int] = field(default_factory=dict)
    fallbacks: list[Fallback] = field(default_factory=list)
    seconds: float = 0.0


@dataclass(frozen=True)
class _Leaf:
    """A saved tensor in the export's tree: its position in the manifest."""

    index: int


_SKIP = object()  # a value that cannot be exported (pickled): left out
_MISSING = object()


async def export(engine: Engine, path: str | os.PathLike[str], *, to: str, step: int | None = None,
                 select: str | None = None, force: bool = False,
                 progress: Callable[[int, int], None] | None = None) -> ExportInfo:
    """Write checkpoint `step` (default: the newest complete one) to `path` in format `to`. `progress(done,
    total)` is called with bytes of tensor data as they are read."""
    started = time.perf_counter()
    if to not in FORMATS:
        raise ValueError(f"unknown export format {to!r}; choose one of {', '.join(FORMATS)}")
    out = Path(path)
    _check_output(out, directory=to == "dcp", force=force)
    allowed = list(engine.tiers)
    try:
        status = await engine.catalog.pick(step, allowed)  # a reader's pick: changes nothing in the index
    except IncompleteCheckpoint as e:
        complete = [s.step for s in await engine.catalog.statuses() if s.complete & set(allowed)]
        raise IncompleteCheckpoint(f"{e}; complete checkpoints: {complete or 'none'}") from None
    order = engine.io.order(status.complete)
    info = ExportInfo(status.step, to, str(out))
    with engine.retention.busy.loading(status.step):  # this engine's retention must not remove it meanwhile
        manifest = await engine.catalog.read_manifest(status.step, order, status.incarnation)
        tree = _tree(manifest, info.skipped)
        if select:
            tree = _select(tree, select, manifest.step)
        if not isinstance(tree, (dict, list, tuple)):  # one tensor (or value) selected: keep its full name
            tree = {select or "<root>": tree}
        read_log = ReadLog()

        def reader(uses: list[int]) -> _Reader:
            return _Reader(engine, manifest, order, uses, read_log, progress)

        try:
            if to == "safetensors":
                await _write_safetensors(out, tree, manifest, reader, info, force)
            elif to == "torch":
                await _write_torch(out, tree, reader, info, force)
            else:
                await _write_dcp(out, tree, reader, info, force)
        finally:
            engine.io.bounce.clear()  # do not hold part-sized buffers after the export
        tensors = [leaf.index for _, leaf in _items(tree) if isinstance(leaf, _Leaf)]
        info.tensors, info.nbytes = len(tensors), sum(_nbytes(manifest.tensors[i]) for i in tensors)
        info.bytes_by_tier, info.fallbacks = read_log.bytes_by_tier, read_log.fallbacks
    for line in info.skipped:
        log.warning("export of step %d: left out %s", info.step, line)
    if info.fallbacks:
        log.warning("export of step %d: %d part read(s) fell back to a slower tier: %s", info.step,
                    len(info.fallbacks), "; ".join(f"{f.part} on {f.tier}: {f.reason}" for f in info.fallbacks[:5]))
    info.seconds = time.perf_counter() - started
    return info


# -- the tree: the saved state's structure with tensors as leaves -------------------------------------------
def _tree(manifest: Manifest, skipped: list[str]) -> Any:
    """Rank 0's saved structure, with keys only other ranks held merged in (as a load at world size 1 sees
    it); tensors become _Leaf, pickled values _SKIP (named in `skipped`). A PerRank entry is rank 0's."""
    by_name = {t.path: i for i, t in enumerate(manifest.tensors)}
    merged = decode_skeleton(manifest.skeleton_of(0))
    for r in range(1, len(manifest.ranks)):
        if manifest.ranks[r].skeleton:
            merged = _merge(merged, decode_skeleton(manifest.skeleton_of(r)))

    def find(name: str, where: str) -> _Leaf:
        if name not in by_name:
            raise IntegrityError(f"step {manifest.step}: the manifest has no tensor {name!r} for {where!r}")
        return _Leaf(by_name[name])

    def walk(node: Any, path: tuple[Any, ...], per_rank: bool) -> Any:
        where = path_str(path)
        if isinstance(node, TensorRef):
            return find(per_rank_name(where, 0) if per_rank else where, where)
        if isinstance(node, TensorAlias):
            return find(node.name, where)
        if isinstance(node, PerRankMark):
            return walk(node.inner, path, True)
        if isinstance(node, dict):
            return {k: walk(v, path + (k,), per_rank) for k, v in node.items()}
        if isinstance(node, (list, tuple)):
            return type(node)(walk(v, path + (i,), per_rank) for i, v in enumerate(node))
        if isinstance(node, Pickled):
            skipped.append(f"{_dotted(path)!r} (a pickled value; export cannot unpickle it safely)")
            return _SKIP
        return node

    return walk(merged, (), False)


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


def _dotted(path: tuple[Any, ...]) -> str:
    return ".".join(map(str, path))


def _select(tree: Any, prefix: str, step: int) -> Any:
    """The subtree whose names start with `prefix` (+ "."), names relative to it. Keys may hold dots
    themselves (a module's state dict: "0.weight"): `model.0` keeps {"weight", "bias"} of the key
    "0.weight" and "0.bias" under "model"."""
    found = _resolve(tree, prefix, prefix)
    if found is not _MISSING:
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
                if sub is not _MISSING:
                    results.append(sub)
            elif key.startswith(rest + "."):
                partial[key[len(rest) + 1:]] = v
        if partial:
            results.append(partial)
        if not results:
            return _MISSING
        if len(results) == 1:
            return results[0]
        if all(isinstance(r, dict) for r in results):
            return {k: v for r in results for k, v in r.items()}
        raise StateError(f"--select {prefix!r} is ambiguous: several entries have that name")
    if isinstance(node, (list, tuple)):
        head, _, tail = rest.partition(".")
        if head.isdigit() and int(head) < len(node):
            return _resolve(node[int(head)], tail, prefix)
    return _MISSING


def _items(tree: Any, path: tuple[Any, ...] = ()) -> list[tuple[str, Any]]:
    """(name, leaf or value) of every leaf, in the tree's order; names join keys with "."."""
    if isinstance(tree, dict):
        return [item for k, v in tree.items() for item in _items(v, path + (k,))]
    if isinstance(tree, (list, tuple)):
        return [item for i, v in enumerate(tree) for item in _items(v, path + (i,))]
    return [(_dotted(path), tree)]


def _leaves(tree: Any) -> list[int]:
    """The manifest index of every tensor in the tree, in the tree's order (a tie once per name)."""
    return [leaf.index for _, leaf in _items(tree) if isinstance(leaf, _Leaf)]


def _has_leaf(node: Any) -> bool:
    if isinstance(node, _Leaf):
        return True
    if isinstance(node, dict):
        return any(_has_leaf(v) for v in node.values())
    if isinstance(node, (list, tuple)):
        return any(_has_leaf(v) for v in node)
    return False


def _build(tree: Any, leaf: Callable[[int], Any]) -> Any:
    """`tree` with each _Leaf replaced by leaf(index) (the same object for the same index: ties stay ties);
    left-out values are dropped from dicts and None in lists."""
    made: dict[int, Any] = {}

    def walk(node: Any) -> Any:
        if isinstance(node, _Leaf):
            if node.index not in made:
                made[node.index] = leaf(node.index)
            return made[node.index]
        if isinstance(node, dict):
            return {k: walk(v) for k, v in node.items() if v is not _SKIP}
        if isinstance(node, (list, tuple)):
            return type(node)(None if v is _SKIP else walk(v) for v in node)
        return node

    return walk(tree)


def _count_values(node: Any, *, json: bool = False) -> int:
    """How many plain values (leaves that are not tensors) the tree exports (`json`: bytes are not)."""
    if isinstance(node, dict):
        return sum(_count_values(v, json=json) for v in node.values())
    if isinstance(node, (list, tuple)):
        return sum(_count_values(v, json=json) for v in node)
    return 0 if isinstance(node, _Leaf) or node is _SKIP or (json and isinstance(node, bytes)) else 1


# -- reading whole tensors, a group at a time ----------------------------------------------------------------
class _Reader:
    """Hands out full tensors by manifest index; `uses` lists the indices in the order they will be asked
    for, a tie once per name. A tensor not at hand is read together with the next ones of `uses` still to
    come, up to about one part's worth of bytes (so each part is read about once); those wait in a cache of
    at most that size (the oldest are dropped, and read again if they are asked for after all)."""

    def __init__(self, engine: Engine, manifest: Manifest, tiers: list[str], uses: list[int], log: ReadLog,
                 progress: Callable[[int, int], None] | None):
        self.io = engine.io
        self.manifest = manifest
        self.tiers = tiers
        self.log = log
        self.uses: dict[int, int] = {}
        for i in uses:
            self.uses[i] = self.uses.get(i, 0) + 1
        self.order = list(self.uses)  # unique, in first-use order
        self.position = {i: n for n, i in enumerate(self.order)}
        self.budget = manifest.part_size
        self.cache: dict[int, torch.Tensor] = {}
        self.cached = 0
        self.total = sum(_nbytes(manifest.tensors[i]) * n for i, n in self.uses.items())
        self.done = 0
        self.progress = progress
        self._lock = asyncio.Lock()
        self._spans: dict[int, list[tuple[int, int]]] | None = None
        if progress is not None:
            progress(0, self.total)

    async def get(self, index: int) -> torch.Tensor:
        async with self._lock:
            tensor = self.cache.pop(index, None)
            if tensor is None:
                _give_back_freed_memory()
                group = self._group(index)
                tensors = await self._read(group)
                tensor = tensors.pop(index)
                for i, t in tensors.items():
                    self.cache[i] = t
                    self.cached += _nbytes(self.manifest.tensors[i])
            else:
                self.cached -= _nbytes(self.manifest.tensors[index])
            self.uses[index] -= 1
            if self.uses[index] > 0:  # a tie: wanted again under another name
                self.cache[index] = tensor
                self.cached += _nbytes(self.manifest.tensors[index])
            while self.cached > self.budget and self.cache:
                oldest = next(iter(self.cache))
                self.cached -= _nbytes(self.manifest.tensors[oldest])
                del self.cache[oldest]
            self.done += _nbytes(self.manifest.tensors[index])
            if self.progress is not None:
                self.progress(self.done, self.total)
            return tensor

    def _group(self, index: int) -> list[int]:
        group, size = [index], _nbytes(self.manifest.tensors[index])
        for i in self.order[self.position[index] + 1:]:
            if self.uses[i] <= 0 or i in self.cache:
                continue
            n = _nbytes(self.manifest.tensors[i])
            if size + n > self.budget:
                break
            group.append(i)
            size += n
        return group

    async def _read(self, indices: list[int]) -> dict[int, torch.Tensor]:
        tensors = {i: torch.empty(self.manifest.tensors[i].shape, dtype=self.manifest.tensors[i].torch_dtype)
                   for i in indices}
        reads = Reads()
        for i, t in tensors.items():
            _plan_full(reads, self.manifest.tensors[i], t)
        parts = self._parts(reads, indices)
        outcomes = await asyncio.gather(*(self.io.read_verified(p, self.tiers, self.log) for p in parts),
                                        return_exceptions=True)
        failed = [o for o in outcomes if isinstance(o, BaseException)]
        if failed:
            raise failed[0]
        await self.io.run_blocking(reads.finish)
        return tensors


    def _parts(self, reads: Reads, indices: list[int]) -> list[PartRead]:
        """The parts that hold the chunks of these tensors (as loading.parts_to_read finds them, but looking
        only at those parts: it runs once per group, not once per load)."""
        m = self.manifest
        if self._spans is None:  # every rank's (byte offset, nbytes) of non-empty chunks, in stream order
            self._spans = {r.rank: [] for r in m.ranks}
            for t in m.tensors:
                for c in t.chunks:
                    if c.nbytes:
                        self._spans[c.rank].append((c.byte_offset, c.nbytes))
            for spans in self._spans.values():
                spans.sort()
        wanted = sorted({(c.rank, p) for i in indices for c in m.tensors[i].chunks if c.nbytes
                         for p in range(c.byte_offset // m.part_size, (c.byte_offset + c.nbytes - 1) // m.part_size + 1)})
        parts = []
        for rank, p in wanted:
            found = part_views(m, rank, p, self._spans[rank], reads)
            if found is not None:
                key = PartKey(m.job, m.step, rank, p, m.incarnation).path
                parts.append(PartRead(key, found[0], m.part_length(rank, p), m.ranks[rank].checksums[p], found[1],
                                      bounce=True, algorithm=m.checksum))
        return parts


def _give_back_freed_memory() -> None:
    """glibc keeps large freed blocks in its heap (its mmap threshold rises after the first one is freed), so
    without this the RSS of a long export creeps up by whole tensors it no longer holds; elsewhere a no-op."""
    global _malloc_trim
    if _malloc_trim is None:
        try:
            _malloc_trim = ctypes.CDLL(None).malloc_trim
        except (AttributeError, OSError):
            _malloc_trim = False
    if _malloc_trim:
        _malloc_trim(0)


_malloc_trim: Any = None


def _nbytes(meta: TensorMeta) -> int:
    n = meta.torch_dtype.itemsize
    for s in meta.shape:
        n *= s
    return n


def _plan_full(reads: Reads, meta: TensorMeta, full: torch.Tensor) -> None:
    """Where each saved chunk of `meta` goes in the full tensor: straight into its box when that box is
    contiguous memory (any box of a 1-d tensor, Shard(0) boxes), else through a scratch copy of the chunk."""
    covered = 0
    for chunk in meta.chunks:
        elements = 1
        for s in chunk.sizes:
            elements *= s
        covered += elements
        if chunk.nbytes == 0:
            continue
        box = full[tuple(slice(o, o + s) for o, s in zip(chunk.offsets, chunk.sizes))]
        key = (chunk.rank, chunk.byte_offset)
        if box.is_contiguous():
            reads.dests[key] = tensor_bytes(box)
            continue
        scratch = torch.empty(chunk.nbytes, dtype=torch.uint8)
        reads.dests[key] = tensor_bytes(scratch)
        reads.keep.append(scratch)
        reads.copies.append((scratch.view(meta.torch_dtype).view(chunk.sizes), box))
    if covered != full.numel():
        raise IntegrityError(f"tensor {meta.path!r}: the manifest's chunks hold {covered} of its {full.numel()} "
                             f"elements")


# -- output files ----------------------------------------------------------------------------------------------
def _check_output(out: Path, *, directory: bool, force: bool) -> None:
    if not out.exists() and not out.is_symlink():
        return
    if not force:
        raise FileExistsError(f"{out} exists; pass --force (force=True) to replace it")
    if out.is_dir() != directory:
        kind = "a directory" if out.is_dir() else "a file"
        raise FileExistsError(f"{out} exists and is {kind}; not replaced by a {'directory' if directory else 'file'}")


def _temp_path(out: Path) -> Path:
    out.parent.mkdir(parents=True, exist_ok=True)
    return out.parent / f".{out.name}.export-{os.getpid()}-{secrets.token_hex(4)}"


def _publish(tmp: Path, out: Path, force: bool) -> None:
    """Move the finished `tmp` to `out` (a rename: readers see the old one or the whole new one)."""
    _check_output(out, directory=tmp.is_dir(), force=force)  # it may have appeared meanwhile
    if tmp.is_dir() and out.exists():  # a directory cannot be renamed over a non-empty one
        old = _temp_path(out)
        os.rename(out, old)
        os.rename(tmp, out)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(tmp, out)
    fd = os.open(out.parent, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _discard(tmp: Path) -> None:
    if tmp.is_dir():
        shutil.rmtree(tmp, ignore_errors=True)
    else:
        tmp.unlink(missing_ok=True)


# -- safetensors -----------------------------------------------------------------------------------------------
def _safetensors_dtypes() -> dict[str, str]:
    try:
        from safetensors.torch import _TYPES  # what the installed reader can load
    except ImportError:  # not installed (the `export` extra): the file is written all the same
        return dict(_SAFETENSORS_DTYPES)
    known = set(_TYPES)
    return {k: v for k, v in _SAFETENSORS_DTYPES.items() if v in known}


def _jsonable(node: Any, path: tuple[Any, ...], skipped: list[str]) -> Any:
    """The plain values under `node` as JSON-able data, nested as in the state, tensors left out (None in
    a list); bytes are left out and named in `skipped`. _MISSING when nothing is left."""
    if isinstance(node, _Leaf) or node is _SKIP:
        return _MISSING
    if isinstance(node, dict):
        kept = {str(k): _jsonable(v, path + (k,), skipped) for k, v in node.items()}
        kept = {k: v for k, v in kept.items() if v is not _MISSING}
        return kept if kept or not node else _MISSING  # an empty dict is a value; one of tensors only is not
    if isinstance(node, (list, tuple)):
        items = [_jsonable(v, path + (i,), skipped) for i, v in enumerate(node)]
        if node and all(v is _MISSING for v in items):
            return _MISSING
        return [None if v is _MISSING else v for v in items]
    if isinstance(node, bytes):
        skipped.append(f"{_dotted(path)!r} (bytes: the JSON in the safetensors metadata cannot hold them)")
        return _MISSING
    return node


async def _write_safetensors(out: Path, tree: Any, manifest: Manifest, reader: Callable[[list[int]], _Reader],
                             info: ExportInfo, force: bool) -> None:
    """The header first (names, dtypes, shapes and offsets are all in the manifest), then each tensor's bytes
    in the header's order, read a group at a time."""
    dtypes = _safetensors_dtypes()
    entries: list[tuple[str, int]] = []
    for name, leaf in _items(tree):
        if not isinstance(leaf, _Leaf):
            continue
        dtype = manifest.tensors[leaf.index].dtype.removeprefix("torch.")
        if dtype not in dtypes:
            raise StateError(f"tensor {name!r} has dtype {dtype}, which safetensors cannot hold (it holds "
                             f"{', '.join(sorted(dtypes))}); export it --to torch or dcp, or leave it out with "
                             f"--select")
        entries.append((name, leaf.index))
    seen: set[str] = {"__metadata__"}
    for name, _ in entries:
        if name in seen:
            raise StateError(f"two entries have the name {name!r} once keys are joined with '.'; export "
                             f"--to torch or dcp, or pick one subtree with --select")
        seen.add(name)
    # 8-byte dtypes first, then 4, 2 and 1 (the state's order within each): every tensor starts aligned
    entries.sort(key=lambda e: -manifest.tensors[e[1]].torch_dtype.itemsize)
    header: dict[str, Any] = {}
    offset = 0
    for name, index in entries:
        meta, n = manifest.tensors[index], _nbytes(manifest.tensors[index])
        header[name] = {"dtype": dtypes[meta.dtype.removeprefix("torch.")], "shape": list(meta.shape),
                        "data_offsets": [offset, offset + n]}
        offset += n
    metadata = {"format": "pt", "tiered_ckpt.job": manifest.job, "tiered_ckpt.step": str(manifest.step)}
    values = _jsonable(tree, (), info.skipped)
    if values is not _MISSING and values != {}:
        metadata[VALUES_KEY] = json.dumps(values)
        info.values = _count_values(tree, json=True)
    raw = json.dumps({"__metadata__": metadata, **header}, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # the data starts 8-byte aligned
    if len(raw) > _MAX_HEADER:
        raise StateError(f"the safetensors header would be {len(raw)} bytes (readers accept at most "
                         f"{_MAX_HEADER}): too many names or plain values; export a part with --select")
    source = reader([i for _, i in entries])
    tmp = _temp_path(out)
    try:
        f = await asyncio.to_thread(open, tmp, "wb")
        try:
            await asyncio.to_thread(f.write, struct.pack("<Q", len(raw)) + raw)
            for _, index in entries:
                tensor = await source.get(index)
                if tensor.numel():
                    await source.io.run_blocking(f.write, tensor_bytes(tensor))
                del tensor
            await asyncio.to_thread(f.flush)
            await asyncio.to_thread(os.fsync, f.fileno())
        finally:
            f.close()
        _publish(tmp, out, force)
    except BaseException:
        _discard(tmp)
        raise


# -- torch.save ------------------------------------------------------------------------------------------------
async def _write_torch(out: Path, tree: Any, reader: Callable[[list[int]], _Reader], info: ExportInfo,
                       force: bool) -> None:
    """One torch.save of the nested state: every selected tensor is in memory at once."""
    unique = list(dict.fromkeys(_leaves(tree)))
    source = reader(unique)
    tensors = {index: await source.get(index) for index in unique}
    state = _build(tree, tensors.__getitem__)  # a tie is one tensor under two names: torch.save keeps it one
    info.values = _count_values(tree)
    tmp = _temp_path(out)
    try:
        def save() -> None:
            with open(tmp, "wb") as f:
                torch.save(state, f)
                f.flush()
                os.fsync(f.fileno())

        await asyncio.to_thread(save)
        _publish(tmp, out, force)
    except BaseException:
        _discard(tmp)
        raise


# -- torch.distributed.checkpoint ------------------------------------------------------------------------------
async def _write_dcp(out: Path, tree: Any, reader: Callable[[list[int]], _Reader], info: ExportInfo,
                     force: bool) -> None:
    """dcp.save in a thread, without a process group, planned with meta placeholders; the planner reads each
    tensor when the writer asks for its data (DCP orders the writes itself: the reader's cache bounds what
    waits). Plain values are DCP's byte items."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

    if not isinstance(tree, dict):
        raise StateError(f"a DCP checkpoint holds a dict; the exported state is a {type(tree).__name__}: export "
                         f"one entry of it with --select")
    source = reader(_leaves(tree))
    placeholders: dict[int, int] = {}  # id(placeholder) → manifest index

    def placeholder(index: int) -> torch.Tensor:
        meta = source.manifest.tensors[index]
        t = torch.empty(meta.shape, dtype=meta.torch_dtype, device="meta")
        placeholders[id(t)] = index
        return t

    state = _build(tree, placeholder)
    loop = asyncio.get_running_loop()
    failures: list[BaseException] = []

    class StreamingPlanner(DefaultSavePlanner):
        def lookup_object(self, index: Any) -> Any:
            obj = super().lookup_object(index)
            found = placeholders.get(id(obj))
            if found is None:
                return obj  # a plain value
            try:
                return asyncio.run_coroutine_threadsafe(source.get(found), loop).result()
            except BaseException as e:  # DCP wraps it in a CheckpointException: raise the read's own error
                failures.append(e)
                raise

    info.values = _count_values(tree)
    tmp = _temp_path(out)
    try:
        def save() -> None:
            # one file per entry: DCP's writer keeps every tensor of a file until that file is written
            writer = dcp.FileSystemWriter(str(tmp), single_file_per_rank=False, thread_count=1, sync_files=True)
            with warnings.catch_warnings():  # "...assuming the intent is to save in a single process": it is
                warnings.filterwarnings("ignore", "torch.distributed is disabled", UserWarning)
                dcp.save(state, storage_writer=writer, planner=StreamingPlanner(), no_dist=True)

        try:
            await asyncio.to_thread(save)
        except BaseException as e:  # (DCP's CheckpointException is a BaseException)
            if failures:
                raise failures[0] from e
            raise
        _publish(tmp, out, force)
    except BaseException:
        _discard(tmp)
        raise
