"""PyTorch Lightning: `TieredCheckpointIO`, a `CheckpointIO` plugin that saves Lightning's checkpoints with
tiered_ckpt (docs/integrations.md).

    trainer = Trainer(plugins=[TieredCheckpointIO("tiers/local.toml", job="run1")],
                      callbacks=[ModelCheckpoint(monitor="val_loss", save_top_k=2, save_last=True)])
    trainer.fit(model, ckpt_path="last")

Paths. Lightning names checkpoints by path and asks the file system what exists (ModelCheckpoint's version
counter, `ckpt_path="last"`). Each save is a new engine step (a counter, not the global step: Lightning saves
one global step under two paths with `save_last`, and saves `last.ckpt` again and again); the manifest's
metadata records the path, a random id, the epoch and the global step; and a small JSON *pointer file* is
written at the path (job, step, id), so Lightning's file-system checks see the checkpoint. A load follows the
pointer (and checks the id against the manifest); when the pointer is missing, stale, or names a save that
never completed (a crash), it takes the newest complete checkpoint saved under that path. Saving a path again
keeps the older version until the new one is complete on every tier, then deletes it. Removing a path
removes its pointer, then every checkpoint saved under it, after waiting for a save of it still in flight.

Tiers. ModelCheckpoint decides what is kept, and each save may be one it keeps: every tier gets
`skip_when_behind = false` (a tier that cannot keep up queues saves instead of skipping to the newest).

Ranks. Lightning calls `save_checkpoint`/`remove_checkpoint` on global rank 0 only, with the full state, and
`load_checkpoint` on every rank. So the engine runs with `distributed = false` (always, whatever the
config says): a world of one rank, no collectives. Rank 0 writes; the other ranks only ever read.

Async. `save_checkpoint` returns once the tensors are copied to host buffers; the tiers are written in the
background. A save that failed in the background raises at the next `save_checkpoint` or at `teardown`,
which waits for every save.
"""
from __future__ import annotations

import concurrent.futures
import dataclasses
import json
import logging
import os
import sys
import uuid
import warnings
from typing import Any

import torch

try:
    from lightning.fabric.plugins.io.checkpoint_io import CheckpointIO
    from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO
    from lightning.fabric.utilities.cloud_io import get_filesystem
    from lightning.pytorch.callbacks import Callback
    from lightning_utilities.core.apply_func import apply_to_collection
except ImportError as e:  # pragma: no cover - depends on the environment
    raise ImportError("tiered_ckpt.integrations.lightning needs Lightning >= 2.2: "
                      "pip install 'tiered_ckpt[lightning]'") from e

from ..config import Config, load_config
from ..errors import IncompleteCheckpoint, StateError, TieredCkptError
from ..state import PerRankMark, Pickled, decode_skeleton
from ..save.reserve import Reservation
from ..sync import Checkpointer, SyncSaveHandle
from ..state.scalars import scalars_as_values, values_as_scalars

log = logging.getLogger(__name__)

POINTER_FORMAT = "tiered_ckpt.lightning-pointer"  # the "format" of a pointer file
METADATA_KEY = "lightning"  # the key of the manifest's metadata this plugin writes
_POINTER_MAX = 64 * 1024  # a pointer is a few hundred bytes; a larger file is not one
# A pointer's first two lines, before its JSON, are a pickle GLOBAL opcode: `torch.load(pointer)` then fails with
# an error that quotes them (weights_only=True: "Unsupported global: GLOBAL <line 1>.<line 2>"; weights_only=False:
# "No module named '<line 1>'", so line 1 has no dot), instead of "invalid load key, '{'". Line 2 is the command
# that converts the checkpoint.
POINTER_HINT = "tiered_ckpt pointer file, not a torch save file: load it through TieredCheckpointIO, or convert it"
_HINT_LINE = b"c" + POINTER_HINT.encode() + b"\n"


class TieredCheckpointIO(CheckpointIO):
    """A Lightning `CheckpointIO` that saves through tiered_ckpt.

    `config`: a TOML path or a `tc.Config`; `overrides` replace `[engine]` keys (`job="run1"`,
    `allow_pickle=True`, ...). `distributed` is always false here (see the module's docstring).
    """

    def __init__(self, config: str | os.PathLike[str] | Config, **overrides: Any):
        super().__init__()
        if overrides.get("distributed"):
            raise ValueError("TieredCheckpointIO runs the engine with distributed = false: Lightning saves on global "
                             "rank 0 only, with the full state")
        overrides["distributed"] = False
        config = config.replace_engine(**overrides) if isinstance(config, Config) else load_config(config, **overrides)
        if config.engine.save_on_sigterm:  # its handler would swallow SIGTERM: nothing here asks should_save
            raise ValueError("TieredCheckpointIO does not support save_on_sigterm: ModelCheckpoint decides when to save "
                             "and never asks should_save, so SIGTERM would be noted and never acted on")
        # every save is a checkpoint ModelCheckpoint may keep (a top-k one, then last.ckpt): no tier may skip one
        # to catch up with a newer save
        self.config = dataclasses.replace(config, tiers=tuple(
            dataclasses.replace(t, skip_when_behind=False) for t in config.tiers))
        if not any(t.keep_last is None and t.every == 1 for t in self.config.tiers):
            warnings.warn("no tier keeps every save (each has keep_last, or takes only every N-th save): the engine "
                          "may then delete checkpoints that ModelCheckpoint still keeps (its top-k, last.ckpt); leave "
                          "keep_last unset and every = 1 on at least one tier (e.g. the slowest) and let "
                          "ModelCheckpoint decide", UserWarning, stacklevel=2)
        self._ckpt: Checkpointer | None = None
        self._inflight: dict[int, SyncSaveHandle] = {}  # saves not yet settled (waited for)
        self._supersedes: dict[int, list[int]] = {}  # step → older checkpoints of its path, deleted once it is done
        self._failures: list[BaseException] = []  # background save failures not yet raised
        self._meta: dict[int, dict[str, Any]] = {}  # step → this plugin's metadata of that checkpoint
        self._next_step = 0
        self.reservation: Reservation | None = None  # what reserve() made
        self._deleting: dict[int, concurrent.futures.Future[None]] = {}  # superseded versions being deleted

    @property
    def job(self) -> str:
        return self.config.engine.job

    @property
    def checkpointer(self) -> Checkpointer:
        """The open `tc.Checkpointer` (opened on first use, closed by `teardown`)."""
        if self._ckpt is None:
            self._ckpt = Checkpointer(self.config)
            self._next_step = max(self._next_step, max((s.step for s in self._ckpt.list()), default=-1) + 1)
        return self._ckpt

    # -- CheckpointIO ----------------------------------------------------------------------------
    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Any | None = None) -> None:
        """Stage `checkpoint` as a new step and write the pointer at `path`; the tiers are written in the
        background. Raises a failure of an earlier save first."""
        if storage_options is not None:
            raise TypeError(f"`Trainer.save_checkpoint(..., storage_options=...)` is not supported by "
                            f"{type(self).__name__}")
        self._reap(block=False)
        self._raise_failure()
        key = _key(path)
        ckpt = self.checkpointer
        older = self._versions(key) - self._deleting.keys()  # (one being deleted in the background: not again)
        step = self._new_step()
        meta = {"path": key, "id": uuid.uuid4().hex, "epoch": _int_or_none(checkpoint.get("epoch")),
                "global_step": _int_or_none(checkpoint.get("global_step"))}
        try:
            handle = ckpt.save(step, self._storable(checkpoint), metadata={METADATA_KEY: meta})
        except StateError as e:
            raise _hinted(e, f"Lightning checkpoint {key}") from e
        self._meta[step] = meta
        self._inflight[step] = handle
        self._supersedes[step] = sorted(older)
        self._write_pointer(key, self._export_command(step), {
            "format": POINTER_FORMAT, "version": 1, "job": self.job, "step": step, "id": meta["id"],
            "epoch": meta["epoch"], "global_step": meta["global_step"],
            "note": f"a pointer: the checkpoint is step {step} of tiered_ckpt job {self.job!r} "
                    f"(tiered-ckpt show {step})"})

    def load_checkpoint(self, path: Any, map_location: Any | None = None,
                        weights_only: bool | None = None) -> dict[str, Any]:
        """The checkpoint saved under `path` as a dict of CPU tensors and plain values, moved as `map_location`
        says. A file at `path` that is not a pointer (a checkpoint torch.save wrote) is loaded as Lightning's
        own TorchCheckpointIO would."""
        key = _key(path)
        for step in [s for s in self._inflight if self._meta.get(s, {}).get("path") == key]:
            self._settle(step, block=True)
        exists, pointer = _read_pointer(key)
        if exists and pointer is None:
            return TorchCheckpointIO().load_checkpoint(key, map_location=map_location, weights_only=weights_only)
        ckpt = self.checkpointer
        step = self._resolve(key, pointer)
        if weights_only:
            _refuse_pickled(ckpt, step, key)
        holder = _Holder()
        ckpt.load(holder, step=step)
        state = apply_to_collection(holder.state, _Pickle, lambda p: p.value)
        if "callbacks" in state:
            state["callbacks"] = values_as_scalars(state["callbacks"])
        return _relocate(state, map_location)

    def reserve(self, checkpoint: dict[str, Any]) -> Reservation:
        """Make now the staging buffers that saves of `checkpoint` (a dict as Lightning saves it) will use
        (`Engine.reserve`): the first saves then block only for their copy. `ReserveStaging` calls it once the
        first optimizer step has made the optimizers' state. Sets and returns `self.reservation`."""
        try:
            self.reservation = self.checkpointer.reserve(self._storable(checkpoint))
        except StateError as e:
            raise _hinted(e, "a checkpoint to reserve for") from e
        return self.reservation

    def _storable(self, checkpoint: dict[str, Any]) -> dict[str, Any]:
        """What the engine saves of `checkpoint`: hyper-parameter objects wrapped or refused, and the callbacks'
        0-d tensors as values (state/scalars.py), so every save has the same tensors. A new dict: the
        checkpoint itself is not modified."""
        checkpoint = _wrap_hyperparameter_objects(checkpoint, self.config.engine.allow_pickle)
        if "callbacks" in checkpoint:
            checkpoint = {**checkpoint, "callbacks": scalars_as_values(checkpoint["callbacks"])}
        return checkpoint

    def remove_checkpoint(self, path: Any) -> None:
        """Remove the pointer at `path`, then every checkpoint saved under it (waiting for a save of it that is
        still in flight)."""
        key = _key(path)
        if _is_local(key) and os.path.islink(key):  # save_last="link": the link goes, its target stays
            os.remove(key)
            return
        exists, pointer = _read_pointer(key)
        steps = self._versions(key)
        if pointer is not None and pointer.get("job") == self.job and self._pointed(pointer) is not None:
            steps.add(pointer["step"])
        if exists:  # the pointer first: a crash part-way leaves unreferenced checkpoints, never a dangling pointer
            _remove_file(key)
        for step in sorted(steps):
            if step in self._inflight:
                self._settle(step, block=True)
            self._delete(step)

    def teardown(self) -> None:
        """Wait for every save in flight, retire superseded versions, close the engine. Raises a failed save
        (unless Lightning is already handling an exception)."""
        if self._ckpt is None:
            return
        failing = sys.exc_info()[0] is not None
        try:
            self._reap(block=True)
        finally:
            ckpt, self._ckpt = self._ckpt, None
            try:
                ckpt.close(raise_errors=not failing)
            finally:
                for future in self._deleting.values():  # (not reaped: teardown was interrupted) their loop is gone
                    future.cancel()
                self._deleting.clear()
        if failing:
            self._failures.clear()  # logged in _settle; do not hide the exception Lightning is handling
        else:
            self._raise_failure()

    close = teardown

    # -- lookup ----------------------------------------------------------------------------------
    def step_of(self, path: Any) -> int:
        """The engine step that `load_checkpoint(path)` loads (FileNotFoundError if there is none)."""
        key = _key(path)
        for step in [s for s in self._inflight if self._meta.get(s, {}).get("path") == key]:
            self._settle(step, block=True)
        return self._resolve(key, _read_pointer(key)[1])

    def checkpoints(self) -> dict[str, list[int]]:
        """Path → the complete checkpoints (engine steps, oldest first) saved under it, from the manifests."""
        out: dict[str, list[int]] = {}
        for status in self.checkpointer.list():
            path = self._metadata(status.step).get("path")
            if status.is_complete and isinstance(path, str):
                out.setdefault(path, []).append(status.step)
        return out

    def _resolve(self, key: str, pointer: dict[str, Any] | None) -> int:
        if pointer is not None:
            if pointer.get("job") != self.job:
                raise ValueError(f"{key} points to checkpoint {pointer.get('step')} of job {pointer.get('job')!r}; "
                                 f"this TieredCheckpointIO is configured for job {self.job!r}")
            step = self._pointed(pointer)
            if step is not None:
                return step
        complete = {s.step for s in self.checkpointer.list() if s.is_complete}
        versions = [s for s in sorted(complete) if self._metadata(s).get("path") == key]
        if not versions:
            why = ("no pointer file there" if pointer is None else
                   f"its pointer file names checkpoint {pointer.get('step')}, which no tier holds complete any more")
            raise FileNotFoundError(f"Checkpoint file not found: {key} ({why}, and job {self.job!r} has no complete "
                                    f"checkpoint saved under this path)")
        if pointer is not None:
            log.warning("%s points to checkpoint %s, which is not complete (a save cut short?); loading step %d, the "
                        "newest complete checkpoint saved under this path", key, pointer.get("step"), versions[-1])
        return versions[-1]

    def _pointed(self, pointer: dict[str, Any]) -> int | None:
        """The pointer's step when that checkpoint is complete and is the one the pointer was written for."""
        step = pointer.get("step")
        if type(step) is not int:
            return None
        status = next((s for s in self.checkpointer.list() if s.step == step), None)
        if status is None or not status.is_complete or self._metadata(step).get("id") != pointer.get("id"):
            return None
        return step

    def _versions(self, key: str) -> set[int]:
        """Every checkpoint of the job (complete, incomplete, in flight) saved under `key`."""
        steps = {s.step for s in self.checkpointer.list() if self._metadata(s.step).get("path") == key}
        return steps | {s for s in self._inflight if self._meta.get(s, {}).get("path") == key}

    def _metadata(self, step: int) -> dict[str, Any]:
        if step in self._meta:
            return self._meta[step]
        try:
            manifest = self.checkpointer.read_manifest(step)
        except TieredCkptError:  # no manifest yet (a save in flight elsewhere, or cut short): ask again next time
            return {}
        meta = manifest.metadata.get(METADATA_KEY)
        self._meta[step] = meta if isinstance(meta, dict) else {}
        return self._meta[step]

    # -- saves in flight -------------------------------------------------------------------------
    def _new_step(self) -> int:
        step = self._next_step
        while not any(step % t.every == 0 for t in self.config.tiers):  # a step every tier skips saves nothing
            step += 1
        self._next_step = step + 1
        return step

    def _settle(self, step: int, *, block: bool) -> bool:
        """Observe save `step` if it is done (or wait for it): on success delete the versions it supersedes; on
        failure keep them and remember the error. True once settled."""
        handle = self._inflight.get(step)
        if handle is None:
            return True
        if not block and not handle.done():
            return False
        try:
            handle.wait()
        except Exception as e:  # noqa: BLE001 - whatever failed the save: kept, raised at the next save or teardown
            log.error("the save of %s (step %d) failed: %s", self._meta.get(step, {}).get("path"), step, e)
            self._failures.append(e)
            self._supersedes.pop(step, None)
            return True
        finally:
            self._inflight.pop(step, None)
        for old in self._supersedes.pop(step, []):
            if old in self._deleting:
                continue
            if old in self._inflight:
                self._settle(old, block=True)
            # in the background: deleting a large checkpoint takes a tenth of a second and more, which
            # save_checkpoint would block training for (the next _reap, remove_checkpoint or teardown sees it done)
            self._deleting[old] = self.checkpointer._submit(self.checkpointer.engine.delete(old))
            self._meta.pop(old, None)
        return True

    def _reap(self, *, block: bool) -> None:
        for step in sorted(self._inflight):
            self._settle(step, block=block)
        for old, future in list(self._deleting.items()):
            if not block and not future.done():
                continue
            del self._deleting[old]
            try:
                future.result()
            except IncompleteCheckpoint:
                pass  # already gone
            except Exception as e:  # noqa: BLE001 - a leftover for `tiered-ckpt gc`, not a failed save
                log.warning("the superseded checkpoint %d was not deleted: %s: %s", old, type(e).__name__, e)

    def _delete(self, step: int) -> None:
        """Delete `step` now (remove_checkpoint): a failure is raised. Superseded versions go in the
        background instead (_settle)."""
        try:
            pending = self._deleting.pop(step, None)
            if pending is not None:  # being deleted in the background already: that delete is this one
                try:
                    pending.result()
                    return
                except Exception:  # noqa: BLE001 - it failed: delete it here, where a failure is raised
                    pass
            self.checkpointer.delete(step)
        except IncompleteCheckpoint:
            pass  # already gone
        self._meta.pop(step, None)

    def _raise_failure(self) -> None:
        if self._failures:
            first = self._failures[0]
            self._failures.clear()
            raise first

    def _export_command(self, step: int) -> str:
        """The CLI command that writes checkpoint `step` as a file torch.load reads."""
        config = f" -c {self.config.source}" if self.config.source else " -c TIERS.toml"
        return f"tiered-ckpt export {step} --to torch -o step{step}.pt --job {self.job}{config}"

    def _write_pointer(self, key: str, command: str, data: dict[str, Any]) -> None:
        text = _HINT_LINE.decode() + command.replace("\n", " ") + "\n" + json.dumps(data, indent=1) + "\n"
        if _is_local(key):
            os.makedirs(os.path.dirname(key), exist_ok=True)
            tmp = f"{key}.tmp-{uuid.uuid4().hex[:8]}"
            with open(tmp, "w") as f:
                f.write(text)
            os.replace(tmp, key)  # atomic: Lightning never sees half a pointer
            return
        fs = get_filesystem(key)
        fs.makedirs(os.path.dirname(key), exist_ok=True)
        with fs.open(key, "w") as f:
            f.write(text)

    def __getstate__(self) -> dict[str, Any]:  # ddp_spawn pickles the plugin: the engine is per process
        state = self.__dict__.copy()
        state.update(_ckpt=None, _inflight={}, _supersedes={}, _failures=[], _deleting={})
        return state


class ReserveStaging(Callback):
    """Makes the staging buffers of the Trainer's `TieredCheckpointIO` right after the first optimizer step, when
    the optimizers' state exists and the checkpoint has the size every save will have (`TieredCheckpointIO.reserve`,
    `Engine.reserve`): the first saves then block only for their copy, and a memory tier that cannot hold its
    checkpoints fails there (`TierFull`), not hours later. The checkpoint is built as a save builds it, so the
    `on_save_checkpoint` hooks run once more; weights only where every ModelCheckpoint has
    `save_weights_only=True`. Every rank builds it (a strategy may gather the optimizer state); global rank 0,
    the one that saves, reserves."""

    def __init__(self) -> None:
        self.done = False

    def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
        if stage == "fit" and not isinstance(trainer.strategy.checkpoint_io, TieredCheckpointIO):
            raise ValueError(f"ReserveStaging reserves a TieredCheckpointIO's buffers, but this Trainer's checkpoint_io "
                             f"is a {type(trainer.strategy.checkpoint_io).__name__}: pass "
                             f"plugins=[TieredCheckpointIO(...)] to the Trainer")

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        if self.done or trainer.global_step < 1:  # before the first optimizer step: no optimizer state yet
            return
        self.done = True
        # as trainer.save_checkpoint builds it; weights only when every ModelCheckpoint saves weights only
        callbacks = trainer.checkpoint_callbacks
        weights_only = bool(callbacks) and all(getattr(c, "save_weights_only", False) for c in callbacks)
        checkpoint = trainer._checkpoint_connector.dump_checkpoint(weights_only=weights_only)
        if trainer.is_global_zero:
            reservation = trainer.strategy.checkpoint_io.reserve(checkpoint)
            log.info("reserved %d staging buffer(s) of %d bytes", reservation.made, reservation.state_bytes)


def _hinted(error: StateError, what: str) -> StateError:
    return StateError(f"{what}: {error}. For hyper-parameters that are objects: leave them out with "
                      f"self.save_hyperparameters(ignore=[...]), or store them with pickle by passing "
                      f"allow_pickle=True to TieredCheckpointIO (loading them then runs pickle: only for "
                      f"checkpoints you trust)")


class _Holder:
    """A load target that takes whatever the checkpoint holds: the engine creates every entry that a stateful
    object's state lacks and passes the whole to its load_state_dict (docs/state.md)."""

    def __init__(self) -> None:
        self.state: dict[str, Any] = {}

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.state = state


class _Pickle:
    """A hyper-parameter with state_dict()/load_state_dict() (a module, a metric), stored whole with pickle under
    allow_pickle: the engine would otherwise store its state dict, and the object would come back as a dict."""

    def __init__(self, value: Any):
        self.value = value


_HPARAM_KEYS = ("hyper_parameters", "datamodule_hyper_parameters")


def _wrap_hyperparameter_objects(checkpoint: dict[str, Any], allow_pickle: bool) -> dict[str, Any]:
    """Lightning's hyper-parameters are constructor arguments: an object among them must come back as that
    object. Stateful ones are wrapped in _Pickle (allow_pickle) or refused; other objects are the engine's
    business (pickled under allow_pickle, refused otherwise). The checkpoint itself is not modified."""
    def wrap(value: Any, where: str) -> Any:
        if isinstance(value, dict):
            return {k: wrap(v, f"{where}/{k}") for k, v in value.items()}
        if type(value) in (list, tuple):
            return type(value)(wrap(v, f"{where}/{i}") for i, v in enumerate(value))
        if isinstance(value, torch.Tensor) or not (callable(getattr(value, "state_dict", None))
                                                   and callable(getattr(value, "load_state_dict", None))):
            return value
        if allow_pickle:
            return _Pickle(value)
        raise StateError(f"hyper-parameter {where!r} is a {type(value).__module__}.{type(value).__qualname__}: "
                         f"tiered_ckpt would store its state dict, not the object")

    if not any(k in checkpoint for k in _HPARAM_KEYS):
        return checkpoint
    return {k: wrap(v, k) if k in _HPARAM_KEYS else v for k, v in checkpoint.items()}


def _key(path: Any) -> str:
    """The path as recorded: a local path absolute, its directory's symlinks resolved (as ModelCheckpoint's dirpath
    is), the file name kept (a `save_last="link"` symlink stays itself)."""
    path = os.fspath(path)
    if not _is_local(path):
        return path
    head, name = os.path.split(os.path.abspath(os.path.expanduser(path.removeprefix("file://"))))
    return os.path.join(os.path.realpath(head), name)


def _is_local(path: str) -> bool:
    return "://" not in path or path.startswith("file://")


def _read_pointer(key: str) -> tuple[bool, dict[str, Any] | None]:
    """(a file exists at `key`, the pointer it holds or None when it is not a pointer)."""
    fs = get_filesystem(key)
    if not fs.isfile(key):
        return False, None
    with fs.open(key, "rb") as f:
        head = f.read(_POINTER_MAX + 1)
    if head.startswith(_HINT_LINE):  # the hint and the export command; pointers of earlier releases are JSON only
        head = head.split(b"\n", 2)[2] if head.count(b"\n") >= 2 else b""
    if len(head) > _POINTER_MAX or not head.lstrip().startswith(b"{"):
        return True, None
    try:
        data = json.loads(head)
    except ValueError:
        return True, None
    return True, data if isinstance(data, dict) and data.get("format") == POINTER_FORMAT else None


def _remove_file(key: str) -> None:
    fs = get_filesystem(key)
    try:
        fs.rm(key)
    except FileNotFoundError:
        pass


def _int_or_none(value: Any) -> int | None:
    return value if type(value) is int else None


def _refuse_pickled(ckpt: Checkpointer, step: int, key: str) -> None:
    """weights_only=True: refuse a checkpoint that holds values stored with pickle (allow_pickle = true)."""
    manifest = ckpt.read_manifest(step)
    found = _pickled_path(decode_skeleton(manifest.skeleton_of(0)), ())
    if found is not None:
        raise StateError(f"{key}: weights_only=True, but the checkpoint holds a value stored with pickle at "
                         f"{found!r}; load it with weights_only=False if you trust it")


def _pickled_path(node: Any, path: tuple[Any, ...]) -> str | None:
    if isinstance(node, Pickled):
        return "/".join(map(str, path)) or "<root>"
    if isinstance(node, PerRankMark):
        return _pickled_path(node.inner, path)
    items = node.items() if isinstance(node, dict) else enumerate(node) if isinstance(node, (list, tuple)) else ()
    for k, v in items:
        found = _pickled_path(v, path + (k,))
        if found is not None:
            return found
    return None


def _relocate(state: dict[str, Any], map_location: Any) -> dict[str, Any]:
    """Move the loaded (CPU) tensors as torch.load's `map_location` would move CPU-saved storages."""
    if map_location is None:
        return state
    if isinstance(map_location, (str, torch.device)):
        device: Any = torch.device(map_location)
    elif isinstance(map_location, dict):
        device = torch.device(map_location["cpu"]) if "cpu" in map_location else None
    elif callable(map_location):  # torch.load calls it with each storage and where it was saved ("cpu" here)
        device = getattr(map_location(torch.empty(0).untyped_storage(), "cpu"), "device", None)
    else:
        raise TypeError(f"map_location must be a device, a string, a dict or a function, not {map_location!r}")
    if device is None or torch.device(device).type == "cpu":
        return state
    return apply_to_collection(state, torch.Tensor, lambda t: t.to(device))
