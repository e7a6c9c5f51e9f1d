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
  `torch.load` of the file will). 0-d tensors that the Lightning plugin keeps as values are tensors again
  (state/scalars.py).

Names are the state's paths joined with "."; `select` keeps one subtree, with names relative to it.
"""
from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from ...errors import IncompleteCheckpoint
from ...lifecycle.busy import BusySteps
from ...state.scalars import values_as_scalars
from ...storage.index import CheckpointStatus
from ...storage.tier_io import TierIO
from ...storage.verified_read import Fallback, ReadLog
from ..catalog import Catalog
from .formats import write_dcp, write_safetensors, write_torch
from .output import check_output
from .reader import TensorReader
from .tree import Leaf, build_tree, items, select_subtree

log = logging.getLogger(__name__)
FORMATS = ("safetensors", "torch", "dcp")


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


async def export(catalog: Catalog, io: TierIO, busy: BusySteps,
                 path: str | os.PathLike[str], *, to: str, step: int | None = None, select: str | None = None,
                 force: bool = False, progress: Callable[[int, int], None] | None = None) -> ExportInfo:
    """Write checkpoint `step` (default: the newest complete one) to `path` in format `to`. `busy` keeps this
    process's retention from removing the step meanwhile. `progress(done, total)` is called with
    bytes of tensor data as they are read."""
    started = time.perf_counter()
    if to not in FORMATS:
        raise ValueError(f"unknown export format {to!r}; choose one of {', '.join(FORMATS)}")
    out = Path(path)
    await io.run_blocking(lambda: check_output(out, directory=to == "dcp", force=force))
    allowed = io.names
    try:  # a reader's pick (it changes nothing in the index), held from retention before the pick ends
        status, removing = await busy.pick_and_hold(lambda: catalog.pick(step, allowed), lambda s: s.step)
    except IncompleteCheckpoint as e:
        complete = [s.step for s in await catalog.statuses() if s.complete & set(allowed)]
        raise IncompleteCheckpoint(f"{e}; complete checkpoints: {complete or 'none'}") from None
    try:
        order = [t for t in io.order(status.complete) if t not in removing]
        if not order:
            raise IncompleteCheckpoint(f"step {status.step} is being removed from {sorted(removing)} (retention: "
                                       f"it is older than what those tiers keep), and no other tier holds it")
        return await _export(catalog, io, status, order, out, to, select, force, progress, started)
    finally:
        busy.end_load(status.step)


async def _export(catalog: Catalog, io: TierIO, status: CheckpointStatus, order: list[str], out: Path, to: str,
                  select: str | None, force: bool, progress: Callable[[int, int], None] | None,
                  started: float) -> ExportInfo:
    info = ExportInfo(status.step, to, str(out))
    manifest = await catalog.read_manifest(status.step, order, status.incarnation)
    tree = await io.run_blocking(build_tree, manifest, info.skipped)
    if select:
        tree = select_subtree(tree, select, manifest.step)
    if not isinstance(tree, (dict, list, tuple)):  # one tensor (or value) selected: keep its full name
        tree = {select or "<root>": tree}
    read_log = ReadLog()

    def reader(uses: list[int]) -> TensorReader:
        return TensorReader(io, manifest, order, uses, read_log, progress)

    try:
        if to == "safetensors":
            await write_safetensors(out, tree, manifest, reader, info, force)
        elif to == "torch":  # 0-d tensors a checkpoint keeps as values (Lightning's scores) are tensors again
            await write_torch(out, values_as_scalars(tree), reader, info, force)
        else:
            await write_dcp(out, tree, reader, info, force)
    finally:
        await io.run_blocking(io.bounce.clear)  # do not hold part-sized buffers after the export
    tensors = [leaf.index for _, leaf in items(tree) if isinstance(leaf, Leaf)]
    info.tensors, info.nbytes = len(tensors), sum(manifest.tensors.nbytes_of(i) for i in tensors)
    info.bytes_by_tier, info.fallbacks = read_log.bytes_by_tier, read_log.fallbacks
    for line in info.skipped:
        log.warning("export of step %d: left out %s", info.step, line)
    if info.fallbacks:
        log.warning("export of step %d: %d part read(s) fell back to a slower tier: %s", info.step,
                    len(info.fallbacks), "; ".join(f"{f.part} on {f.tier}: {f.reason}" for f in info.fallbacks[:5]))
    info.seconds = time.perf_counter() - started
    return info
