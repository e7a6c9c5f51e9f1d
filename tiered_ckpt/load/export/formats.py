"""The three output formats: safetensors (streamed), a torch.save file, a DCP directory (streamed)."""
from __future__ import annotations

import asyncio
import contextlib
import json
import os
import struct
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from ...buffers import tensor_bytes
from ...errors import StateError
from ...manifest import Manifest
from .output import discard, publish, temp_path
from .reader import TensorReader
from .tree import MISSING, SKIP, Leaf, build, count_values, dotted, items, leaves

if TYPE_CHECKING:
    from . import ExportInfo

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

def _safetensors_dtypes() -> dict[str, str]:
    try:
        from safetensors.torch import _TYPES  # what the installed reader can load
    except ImportError:  # not installed (the `export` extra): the file is written all the same
        return dict(_SAFETENSORS_DTYPES)
    known = set(_TYPES)
    return {k: v for k, v in _SAFETENSORS_DTYPES.items() if v in known}


def jsonable(node: Any, path: tuple[Any, ...], skipped: list[str]) -> Any:
    """The plain values under `node` as JSON-able data, nested as in the state, tensors left out (None in
    a list); bytes are left out and named in `skipped`. MISSING when nothing is left."""
    if isinstance(node, Leaf) or node is SKIP:
        return MISSING
    if isinstance(node, dict):
        kept = {str(k): jsonable(v, path + (k,), skipped) for k, v in node.items()}
        kept = {k: v for k, v in kept.items() if v is not MISSING}
        return kept if kept or not node else MISSING  # an empty dict is a value; one of tensors only is not
    if isinstance(node, (list, tuple)):
        items = [jsonable(v, path + (i,), skipped) for i, v in enumerate(node)]
        if node and all(v is MISSING for v in items):
            return MISSING
        return [None if v is MISSING else v for v in items]
    if isinstance(node, bytes):
        skipped.append(f"{dotted(path)!r} (bytes: the JSON in the safetensors metadata cannot hold them)")
        return MISSING
    return node


async def write_safetensors(out: Path, tree: Any, manifest: Manifest, reader: Callable[[list[int]], TensorReader],
                            info: ExportInfo, force: bool) -> None:
    """The header first (names, dtypes, shapes and offsets are all in the manifest), then each tensor's bytes
    in the header's order, read a group at a time."""
    entries, raw = await asyncio.to_thread(_safetensors_header, tree, manifest, info)
    source = reader([i for _, i in entries])
    tmp = await asyncio.to_thread(temp_path, out)
    try:
        f = await asyncio.to_thread(open, tmp, "wb")
        try:
            await asyncio.to_thread(f.write, struct.pack("<Q", len(raw)) + raw)
            for _, index in entries:
                # the thread writes the tensor and drops it: freeing a large tensor on the event loop stalls it
                await source.io.run_blocking(_write_and_drop, f, [await source.get(index)])
            await asyncio.to_thread(f.flush)
            await asyncio.to_thread(os.fsync, f.fileno())
        finally:
            await asyncio.to_thread(f.close)
        await asyncio.to_thread(publish, tmp, out, force)
    except BaseException:
        await asyncio.to_thread(discard, tmp)
        raise


def _write_and_drop(f: Any, holder: list[torch.Tensor]) -> None:
    tensor = holder.pop()
    if tensor.numel():
        f.write(tensor_bytes(tensor))


def _safetensors_header(tree: Any, manifest: Manifest, info: ExportInfo) -> tuple[list[tuple[str, int]], bytes]:
    """(name, manifest index) of every tensor in the file's order, and the header's bytes."""
    dtypes = _safetensors_dtypes()
    entries: list[tuple[str, int]] = []
    for name, leaf in items(tree):
        if not isinstance(leaf, Leaf):
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
        meta, n = manifest.tensors[index], manifest.tensors.nbytes_of(index)
        header[name] = {"dtype": dtypes[meta.dtype.removeprefix("torch.")], "shape": list(meta.shape),
                        "data_offsets": [offset, offset + n]}
        offset += n
    metadata = {"format": "pt", "tiered_ckpt.job": manifest.job, "tiered_ckpt.step": str(manifest.step)}
    values = jsonable(tree, (), info.skipped)
    if values is not MISSING and values != {}:
        metadata[VALUES_KEY] = json.dumps(values)
        info.values = count_values(tree, json=True)
    raw = json.dumps({"__metadata__": metadata, **header}, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # the data starts 8-byte aligned
    if len(raw) > _MAX_HEADER:
        raise StateError(f"the safetensors header would be {len(raw)} bytes (readers accept at most "
                         f"{_MAX_HEADER}): too many names or plain values; export a part with --select")
    return entries, raw


async def write_torch(out: Path, tree: Any, reader: Callable[[list[int]], TensorReader], info: ExportInfo,
                       force: bool) -> None:
    """One torch.save of the nested state: every selected tensor is in memory at once."""
    unique = list(dict.fromkeys(leaves(tree)))
    source = reader(unique)
    tensors = {index: await source.get(index) for index in unique}
    holder = [build(tree, tensors.__getitem__)]  # a tie is one tensor under two names: torch.save keeps it one
    tensors.clear()  # (the state holds them now: the thread below drops the last references)
    info.values = count_values(tree)
    tmp = await asyncio.to_thread(temp_path, out)
    try:
        def save() -> None:
            state = holder.pop()
            with open(tmp, "wb") as f:
                errors: list[OSError] = []
                try:
                    torch.save(state, _Writes(f, errors))
                except RuntimeError as e:  # torch's zip writer turns the file's OSError into its own message
                    raise (errors[0] if errors else e) from e
                f.flush()
                os.fsync(f.fileno())

        await asyncio.to_thread(save)
        await asyncio.to_thread(publish, tmp, out, force)
    except BaseException:
        await asyncio.to_thread(discard, tmp)
        raise


async def write_dcp(out: Path, tree: Any, reader: Callable[[list[int]], TensorReader], info: ExportInfo,
                     force: bool) -> None:
    """dcp.save in a thread, without a process group, planned with meta placeholders; the planner reads each
    tensor when the writer asks for its data (DCP orders the writes itself: the reader's cache bounds what
    waits). Plain values are DCP's byte items."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
    from torch.distributed.checkpoint.filesystem import FileSystem

    class _WatchedFileSystem(FileSystem):
        """DCP's file system, its output streams keeping the OSError of a failed write."""

        def __init__(self, errors: list[OSError]):
            super().__init__()
            self._errors = errors

        @contextlib.contextmanager
        def create_stream(self, path: Any, mode: str) -> Iterator[Any]:
            with super().create_stream(path, mode) as stream:
                yield _Writes(stream, self._errors) if "w" in mode else stream

    if not isinstance(tree, dict):
        raise StateError(f"a DCP checkpoint holds a dict; the exported state is a {type(tree).__name__}: export "
                         f"one entry of it with --select")
    source = reader(leaves(tree))
    placeholders: dict[int, int] = {}  # id(placeholder) → manifest index

    def placeholder(index: int) -> torch.Tensor:
        meta = source.manifest.tensors[index]
        t = torch.empty(meta.shape, dtype=meta.torch_dtype, device="meta")
        placeholders[id(t)] = index
        return t

    state = build(tree, placeholder)
    loop = asyncio.get_running_loop()
    failures: list[BaseException] = []  # the reads' own errors
    write_errors: list[OSError] = []  # those of the output's writes

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

    info.values = count_values(tree)
    tmp = await asyncio.to_thread(temp_path, out)
    try:
        def save() -> None:
            # one file per entry: DCP's writer keeps every tensor of a file until that file is written
            writer = dcp.FileSystemWriter(str(tmp), single_file_per_rank=False, thread_count=1, sync_files=True)
            if isinstance(getattr(writer, "fs", None), FileSystem):  # (where torch keeps it: else, errors as torch's)
                writer.fs = _WatchedFileSystem(write_errors)
            with warnings.catch_warnings():  # "...assuming the intent is to save in a single process": it is
                warnings.filterwarnings("ignore", "torch.distributed is disabled", UserWarning)
                dcp.save(state, storage_writer=writer, planner=StreamingPlanner(), no_dist=True)

        try:
            await asyncio.to_thread(save)
        except BaseException as e:  # (DCP's CheckpointException is a BaseException)
            if failures:
                raise failures[0] from e
            cause = next((f[0] for f in getattr(e, "failures", {}).values() if isinstance(f[0], OSError)), None)
            if cause is not None:  # the output cannot be written (no permission, no such folder): the OSError
                raise cause from e
            if write_errors:  # a write of an output file failed: its zip writer raised a RuntimeError of its own
                raise write_errors[0] from e
            raise
        await asyncio.to_thread(publish, tmp, out, force)
    except BaseException:
        await asyncio.to_thread(discard, tmp)
        raise


class _Writes:
    """A file for torch.save that keeps the OSError of a failed write in `errors` (torch.save reports it as a
    RuntimeError of its zip writer that names neither the file nor the cause)."""

    def __init__(self, f: Any, errors: list[OSError]):
        self._f, self._errors = f, errors

    def write(self, data: Any) -> int:
        try:
            return self._f.write(data)
        except OSError as e:
            self._errors.append(e)
            raise

    def __getattr__(self, name: str) -> Any:
        return getattr(self._f, name)
