"""Hugging Face Trainer: `TieredTrainer`, a `transformers.Trainer` whose checkpoints go through tiered_ckpt
(docs/integrations.md).

    trainer = TieredTrainer(model=model, args=TrainingArguments(output_dir="run1", save_steps=50), ...)
    trainer.train(resume_from_checkpoint=trainer.last_checkpoint() is not None)
    trainer.save_model("run1/final")

Why a subclass and not a callback: a callback sees a save happen but cannot replace it, and on resume the
Trainer restores its position only from a `checkpoint-N` folder it finds on disk (`TrainerState`, then the
batches it skips), so a callback-only integration saves fine and then trains from the start again. The
Trainer's own save and restore hooks are overridden instead:

- `_save_checkpoint` (every rank, at `save_steps`): model, optimizer, scheduler, grad scaler, each rank's RNG
  states (`tc.PerRank`), the data position and the `TrainerState` are saved as engine step `global_step`;
  nothing is written under `output_dir`. Returns once the tensors are staged; the tiers are written in the
  background, and a save that failed there raises at the next save or when `train()` ends.
- `train(resume_from_checkpoint=True | step)`: the newest complete checkpoint (or that step) is loaded. Its
  `TrainerState` is written as `trainer_state.json` into a temporary stand-in folder that is handed to the
  Trainer's own resume path, so the Trainer restores `global_step` and skips the batches already trained
  exactly as it would from a folder of its own; `_load_from_checkpoint`, `_load_optimizer_and_scheduler`,
  `_load_scaler` and `_load_rng_state` read from the tiers when given that folder.
- The data position (epoch, samples into it) is checked on resume against where the Trainer is about to
  skip to: a changed batch size, gradient accumulation or world size would silently train on other data.
- Resuming a run that had already reached `max_steps` trains no further step (the Trainer alone trains one).
- `reserve=True`: right after the first optimizer step (when the optimizer's state exists, so the state has
  the size every save will have), the staging buffers are made (`Engine.reserve`), so the first saves block
  only for their copy; what was made is `trainer.reservation`.

Ranks. Every rank runs the Trainer's loop, so every rank calls save and load (`distributed = true`, the
default): replicated DDP weights are written once, each rank's RNG states are its own.
"""
from __future__ import annotations

import copy
import dataclasses
import hashlib
import json
import logging
import os
import random
import re
import shutil
import sys
import tempfile
from typing import Any

import numpy as np
import torch

try:
    from transformers import Trainer
    from transformers.trainer_callback import ExportableState, TrainerCallback
    from transformers.trainer_utils import get_last_checkpoint
except ImportError as e:  # pragma: no cover - depends on the environment
    raise ImportError("tiered_ckpt.integrations.hf needs transformers >= 5.3 and accelerate: "
                      "pip install 'tiered_ckpt[hf]'") from e

from ..config import Config, load_config
from ..errors import FreshStart, IncompleteCheckpoint
from ..save.reserve import Reservation
from ..state import PerRank
from ..sync import Checkpointer, SyncSaveHandle

log = logging.getLogger(__name__)

METADATA_KEY = "hf"  # the key of the manifest's metadata this integration writes
TRAINER_STATE_NAME = "trainer_state.json"
_CHECKPOINT_FOLDER = re.compile(r"^checkpoint-(\d+)$")


def run_config(output_dir: str | os.PathLike[str], *, shm_root: str | os.PathLike[str] = "/dev/shm",
               memory_keep_last: int = 2, capacity: str = "16GiB", **engine: str | int | float | bool) -> Config:
    """The tiers of one run, keyed by its output directory, so two runs with different directories never see
    each other's checkpoints: the job is `hf-<hash of the directory's absolute path>`, the memory tier is
    `<shm_root>/tiered_ckpt-<job>` (keep_last `memory_keep_last`), the index and the disk tier are under
    `<output_dir>/tiered_ckpt/`. `engine` keys override `[engine]` (e.g. `part_size="8MiB"`). The TOML is
    written to `<output_dir>/tiered_ckpt/tiers.toml`, for the CLI (`tiered-ckpt ls -c ...`)."""
    out = os.path.abspath(os.fspath(output_dir))
    job = "hf-" + hashlib.sha256(out.encode()).hexdigest()[:16]
    shm = os.path.join(os.path.abspath(os.fspath(shm_root)), f"tiered_ckpt-{job}")
    engine = {"job": job, "index": f"file://{out}/tiered_ckpt/index", **engine}
    tiers = [{"name": "host", "kind": "memory", "path": shm, "capacity": capacity, "keep_last": memory_keep_last},
             {"name": "disk", "kind": "local", "path": f"{out}/tiered_ckpt/disk"}]
    lines = [f"# the tiers of the Hugging Face run in {out} (tiered_ckpt.integrations.hf.run_config);",
             "# save_total_limit caps keep_last on every tier at run time", "[engine]"]
    lines += [f"{k} = {_toml_value(v)}" for k, v in engine.items()]
    for tier in tiers:
        lines += ["", "[[tiers]]", *(f"{k} = {_toml_value(v)}" for k, v in tier.items())]
    path = os.path.join(out, "tiered_ckpt", "tiers.toml")
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "w", encoding="utf-8") as f:
        f.write("\n".join(lines) + "\n")
    os.replace(tmp, path)  # every rank writes the same text: atomic, whoever is last
    return load_config(path)


def _toml_value(value: str | int | float | bool) -> str:
    if isinstance(value, (bool, int, float)):
        return json.dumps(value)  # true/false, numbers: TOML spells them as JSON does
    return json.dumps(str(value))  # a basic string; JSON's escapes are TOML's


def cap_keep_last(config: Config, save_total_limit: int | None) -> Config:
    """`save_total_limit` as tier retention: every tier keeps at most that many complete checkpoints (its own
    `keep_last` when smaller)."""
    if save_total_limit is None:
        return config
    if save_total_limit < 1:
        raise ValueError(f"save_total_limit must be at least 1 with tiered checkpoints, not {save_total_limit}")
    return dataclasses.replace(config, tiers=tuple(
        dataclasses.replace(t, keep_last=min(t.keep_last or save_total_limit, save_total_limit)) for t in config.tiers))


@dataclasses.dataclass
class _Resume:
    """A resume in progress: the step, the stand-in folder the Trainer is given, what was loaded up front."""

    step: int
    folder: str
    rng: dict[str, Any] | None  # this rank's RNG states; None when the world size changed (not restorable)
    data: dict[str, Any]


class TieredCheckpointMixin:
    """Saves and resumes a `transformers.Trainer` (or a subclass: `class T(TieredCheckpointMixin, SFTTrainer)`)
    through tiered_ckpt. `tiers`: a TOML path or a `tc.Config`; default `run_config(args.output_dir)`.
    `args.save_total_limit` caps every tier's keep_last (`cap_keep_last`). `reserve`: make the staging
    buffers after the first optimizer step (`trainer.reservation` says what was made)."""

    def __init__(self, *args: Any, tiers: str | os.PathLike[str] | Config | None = None, reserve: bool = False,
                 **kwargs: Any):
        super().__init__(*args, **kwargs)
        self._refuse_unsupported()
        config = (run_config(self.args.output_dir) if tiers is None
                  else tiers if isinstance(tiers, Config) else load_config(tiers))
        if not config.engine.distributed:
            raise ValueError("the Trainer runs its loop on every rank, so every rank saves: leave distributed = true")
        if config.engine.save_on_sigterm:  # its handler would swallow SIGTERM: the Trainer never asks should_save
            raise ValueError("save_on_sigterm is not supported: the Trainer decides when to save (save_steps) and never "
                             "asks should_save, so SIGTERM would be noted and never acted on")
        self.tiers_config: Config = cap_keep_last(config, self.args.save_total_limit)
        self._ckpt: Checkpointer | None = None
        self._pending: list[SyncSaveHandle] = []  # saves not yet observed done
        self._last_saved: int | None = None
        self._resume: _Resume | None = None
        self._updates_per_epoch: int | None = None
        self.reservation: Reservation | None = None  # what reserve=True made, once the first step is done
        if reserve:
            self.add_callback(_ReserveAfterFirstStep(self))

    def _refuse_unsupported(self) -> None:
        args = self.args
        refused = {
            "save_only_model=True (a tiered checkpoint exists to resume from; use trainer.save_model for weights)":
                args.save_only_model,
            "load_best_model_at_end=True (tier retention keeps the newest checkpoints, not the best one)":
                args.load_best_model_at_end,
            "DeepSpeed": getattr(self, "is_deepspeed_enabled", False),
            "FSDP (untested: accelerate runs FSDP only on GPUs; use tc.Engine with tc.TrainState)":
                getattr(self, "is_fsdp_enabled", False),
            f"push_to_hub with hub_strategy={args.hub_strategy!r} (checkpoints are not folders to push)":
                args.push_to_hub and str(getattr(args.hub_strategy, "value", args.hub_strategy)) in (
                    "checkpoint", "all_checkpoints"),
        }
        found = [what for what, on in refused.items() if on]
        if found:
            raise ValueError(f"{type(self).__name__} does not support {'; '.join(found)}")

    # -- the engine ------------------------------------------------------------------------------
    @property
    def checkpointer(self) -> Checkpointer:
        """The open `tc.Checkpointer` (opened on first use on every rank, closed when `train()` ends)."""
        if self._ckpt is None:
            self._ckpt = Checkpointer(self.tiers_config)
        return self._ckpt

    @property
    def job(self) -> str:
        return self.tiers_config.engine.job

    def last_checkpoint(self) -> int | None:
        """The newest complete checkpoint's step (= its `global_step`), or None. Call it on every rank."""
        return max((s.step for s in self.checkpointer.list() if s.is_complete), default=None)

    def close_checkpointer(self, *, raise_errors: bool = True) -> None:
        """Wait until every save is durable on every tier, then close the engine (`train()` does this at its
        end; the next use opens it again)."""
        ckpt, self._ckpt = self._ckpt, None
        self._pending.clear()
        if ckpt is not None:
            ckpt.close(raise_errors=raise_errors)

    # -- train: where to resume from ---------------------------------------------------------------
    def train(self, resume_from_checkpoint: str | bool | int | None = None, trial: Any = None,
              ignore_keys_for_eval: list[str] | None = None, **kwargs: Any) -> Any:
        """`Trainer.train`. `resume_from_checkpoint`: True (the newest complete tiered checkpoint), a step, or
        `"checkpoint-N"` (step N) resume from the tiers; a folder of the Trainer's own (a run begun without
        tiered_ckpt) resumes as the Trainer would, and later saves go to the tiers."""
        if trial is not None:  # trials would save the same steps into one job
            raise ValueError(f"{type(self).__name__} does not support hyper-parameter search")
        try:
            if resume_from_checkpoint is True:
                resume_from_checkpoint = self._resume_newest()
            elif resume_from_checkpoint is not None and resume_from_checkpoint is not False:
                step = self._step_to_resume(resume_from_checkpoint)
                if step is not None:  # else a folder of the Trainer's own, which it resumes from itself
                    self._resume = self._begin_resume(step)
                    resume_from_checkpoint = self._resume.folder
            return super().train(resume_from_checkpoint, trial, ignore_keys_for_eval, **kwargs)
        finally:
            failing = sys.exc_info()[0] is not None
            if self._resume is not None:
                shutil.rmtree(os.path.dirname(self._resume.folder), ignore_errors=True)
                self._resume = None
            self.close_checkpointer(raise_errors=not failing)

    def _resume_newest(self) -> str | bool | None:
        """resume_from_checkpoint=True: the checkpoint a load takes (the newest that can be loaded, every rank
        agreeing, [engine] on_lost applied); the folder to hand the Trainer, None to train from the start (every
        checkpoint lost, with on_lost = "fresh": the first save removes them), or True for the Trainer's own
        checkpoint-N folders (a run begun without tiered_ckpt)."""
        try:
            self._resume = self._begin_resume(None)
            return self._resume.folder
        except FreshStart as e:
            log.warning("training from the start: %s", e)
            return None
        except IncompleteCheckpoint as e:  # nothing saved on the tiers: a run begun with the Trainer's own folders?
            if os.path.isdir(self.args.output_dir) and get_last_checkpoint(self.args.output_dir) is not None:
                return True
            raise ValueError(f"No valid checkpoint found: tiered_ckpt job {self.job!r}: {e}; and output directory "
                             f"{self.args.output_dir} holds no checkpoint-N folder") from None

    def _step_to_resume(self, resume: str | bool | int) -> int | None:
        """The tiered step to resume from, or None for a folder the Trainer saved itself."""
        if resume is True:
            newest = self.last_checkpoint()
            if newest is not None:
                return newest
            if os.path.isdir(self.args.output_dir) and get_last_checkpoint(self.args.output_dir) is not None:
                return None  # the Trainer's own checkpoint-N folders: a run begun without tiered_ckpt
            raise ValueError(f"No valid checkpoint found: tiered_ckpt job {self.job!r} has no complete checkpoint, "
                             f"and output directory {self.args.output_dir} holds no checkpoint-N folder")
        if isinstance(resume, int) and not isinstance(resume, bool):
            step = resume
        else:
            path = os.fspath(resume)
            if os.path.isdir(path):
                return None
            match = _CHECKPOINT_FOLDER.match(os.path.basename(os.path.normpath(path)))
            if match is None:
                raise ValueError(f"resume_from_checkpoint={resume!r}: neither a checkpoint folder nor checkpoint-N "
                                 f"(a step of tiered_ckpt job {self.job!r})")
            step = int(match.group(1))
        newest = self.last_checkpoint()
        if newest is not None and newest > step:
            raise ValueError(f"resume from step {step}: job {self.job!r} has newer checkpoints (up to {newest}) that "
                             f"this run would save over; delete them first (tiered-ckpt delete STEP)")
        return step

    def _begin_resume(self, step: int | None) -> _Resume:
        """Load the plain values of checkpoint `step` (None: the newest a load takes; every rank), and write its
        TrainerState where the Trainer's resume path reads it."""
        ckpt = self.checkpointer
        values: dict[str, Any] = {"trainer": {"state": None, "data": None, "world_size": None}}
        try:
            info = ckpt.load(values, step=step)
        except IncompleteCheckpoint as e:
            if step is None:  # the newest: the caller decides (nothing saved, or on_lost = "fresh")
                raise
            raise ValueError(f"cannot resume from step {step} of job {self.job!r}: {e}") from e
        trainer = values["trainer"]
        rng = None
        if trainer["world_size"] == self.args.world_size:
            wrapped = PerRank(_rng_states())
            ckpt.load({"rng": wrapped}, step=info.step)
            rng = wrapped.value
        else:
            log.warning("checkpoint %d was saved by %s ranks, this run has %d: each rank's RNG states are not "
                        "restored (dropout masks differ from an uninterrupted run)", info.step, trainer["world_size"],
                        self.args.world_size)
        folder = os.path.join(tempfile.mkdtemp(prefix="tiered_ckpt-resume-"), f"checkpoint-{info.step}")
        os.makedirs(folder)
        with open(os.path.join(folder, TRAINER_STATE_NAME), "w", encoding="utf-8") as f:
            f.write(trainer["state"])
        log.info("resuming from tiered_ckpt job %r step %d (tier %s)", self.job, info.step, info.tier)
        return _Resume(info.step, folder, rng, trainer["data"])

    def _ours(self, checkpoint: str | None) -> _Resume | None:
        resume = self._resume
        return resume if resume is not None and checkpoint == resume.folder else None

    # -- the Trainer's restore hooks ---------------------------------------------------------------
    def _load_from_checkpoint(self, resume_from_checkpoint: str, model: torch.nn.Module | None = None) -> None:
        resume = self._ours(resume_from_checkpoint)
        if resume is None:
            return super()._load_from_checkpoint(resume_from_checkpoint, model)
        model = self.accelerator.unwrap_model(self.model if model is None else model)
        self.checkpointer.load({"model": model}, step=resume.step)

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        resume = self._ours(checkpoint)
        if resume is None:
            return super()._load_optimizer_and_scheduler(checkpoint)
        self.checkpointer.load({"optimizer": self.optimizer, "scheduler": self.lr_scheduler}, step=resume.step)

    def _load_scaler(self, checkpoint: str | None) -> None:
        resume = self._ours(checkpoint)
        if resume is None:
            return super()._load_scaler(checkpoint)
        scaler = getattr(self.accelerator, "scaler", None)
        if scaler is not None:
            self.checkpointer.load({"scaler": scaler}, step=resume.step)

    def _load_rng_state(self, checkpoint: str | None) -> None:
        resume = self._ours(checkpoint)
        if resume is None:
            return super()._load_rng_state(checkpoint)
        if resume.rng is not None:
            _set_rng_states(resume.rng)

    def _init_training_state(self, max_steps: int, num_update_steps_per_epoch: int, *args: Any,
                             **kwargs: Any) -> tuple[int, int]:
        self._updates_per_epoch = num_update_steps_per_epoch
        epochs, batches = super()._init_training_state(max_steps, num_update_steps_per_epoch, *args, **kwargs)
        if self._resume is not None and not self.args.ignore_data_skip:
            self._check_data_position(self._resume, epochs, batches)
        return epochs, batches

    def _check_data_position(self, resume: _Resume, epochs: int, batches: int) -> None:
        saved, here = resume.data, self._data_position(epochs, batches)
        if (saved["epoch"], saved["samples"]) != (here["epoch"], here["samples"]):
            raise ValueError(
                f"checkpoint {resume.step} stopped {saved['samples']} samples into epoch {saved['epoch']} "
                f"({saved['batches']} batches of {saved['batch_size']} on {saved['world_size']} ranks), but this run "
                f"would skip to {here['samples']} samples into epoch {here['epoch']} ({here['batches']} batches of "
                f"{here['batch_size']} on {here['world_size']} ranks): keep the batch size, gradient accumulation "
                f"and world size of the saved run, or set ignore_data_skip=True to accept other data")

    def _data_position(self, epochs: int, batches: int) -> dict[str, int]:
        """Where in the data a run is: its epoch and the samples of that epoch already trained on."""
        batch_size, world = int(self._train_batch_size), int(self.args.world_size)
        return {"epoch": epochs, "batches": batches, "batch_size": batch_size, "world_size": world,
                "samples": batches * batch_size * world}

    def _run_epoch(self, *args: Any, **kwargs: Any) -> None:
        if self.state.max_steps > 0 and self.state.global_step >= self.state.max_steps:
            # resumed from the last step: the Trainer would train one step more before checking
            self.control.should_training_stop = True
            return
        return super()._run_epoch(*args, **kwargs)

    # -- the Trainer's save hook --------------------------------------------------------------------
    def _save_checkpoint(self, model: torch.nn.Module, trial: Any) -> None:
        """Save as engine step `global_step` on every rank; returns once the tensors are staged."""
        step = self.state.global_step
        if step == self._last_saved:
            return  # asked twice for one step (the end of training is also the end of an epoch): same state
        self._raise_failed_saves()
        if self.hp_search_backend is None and trial is None:
            self.store_flos()
        self._record_callback_states()
        meta = {"global_step": step, "epoch": self.state.epoch, "world_size": self.args.world_size}
        self._pending.append(self.checkpointer.save(step, self._checkpoint_state(model), metadata={METADATA_KEY: meta}))
        self._last_saved = step

    def _checkpoint_state(self, model: torch.nn.Module) -> dict[str, Any]:
        """What a save at the current step writes (reserve() sizes the buffers by the same)."""
        step = self.state.global_step
        per_epoch = self._updates_per_epoch or 1
        ga = self.args.gradient_accumulation_steps
        data = self._data_position(step // per_epoch, (step % per_epoch) * ga)
        state: dict[str, Any] = {
            "model": self.accelerator.unwrap_model(model),
            "optimizer": self.optimizer,
            "scheduler": self.lr_scheduler,
            "rng": PerRank(_rng_states()),
            "trainer": {"state": _trainer_state_json(self.state), "data": data, "world_size": self.args.world_size},
        }
        scaler = getattr(self.accelerator, "scaler", None)
        if scaler is not None:
            state["scaler"] = scaler
        return state

    def _record_callback_states(self) -> None:
        """As the Trainer does before writing trainer_state.json: the states of stateful callbacks."""
        for cb in [cb for cb in self.callback_handler.callbacks + [self.control] if isinstance(cb, ExportableState)]:
            name, cb_state = cb.__class__.__name__, cb.state()
            if isinstance(self.state.stateful_callbacks.get(name), list):
                self.state.stateful_callbacks[name].append(cb_state)
            else:
                self.state.stateful_callbacks[name] = cb_state

    def _raise_failed_saves(self) -> None:
        """Raise the failure of an earlier save that ended meanwhile (the tiers are written in the background)."""
        done = [h for h in self._pending if h.done()]
        self._pending = [h for h in self._pending if h not in done]
        failures = []
        for handle in done:
            try:
                handle.wait()
            except Exception as e:  # noqa: BLE001 - whatever failed the save
                failures.append(e)
        if failures:
            raise failures[0]

    # -- weights for from_pretrained ------------------------------------------------------------------
    def export_pretrained(self, output_dir: str | os.PathLike[str], step: int | None = None) -> int:
        """Write checkpoint `step` (default: the newest complete one) as a folder `from_pretrained` reads,
        through a copy of the model (the trainer's own is left as it is). Every rank calls it; the main
        process writes. Returns the step."""
        model = copy.deepcopy(self.accelerator.unwrap_model(self.model))
        info = self.checkpointer.load({"model": model}, step=step)
        if self.args.should_save:
            model.save_pretrained(output_dir)
        return info.step


class _ReserveAfterFirstStep(TrainerCallback):
    """reserve=True: once the first optimizer step has made the optimizer's state, every rank makes its staging
    buffers for the state its saves will write."""

    def __init__(self, trainer: TieredCheckpointMixin):
        self.trainer = trainer

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        trainer = self.trainer
        # not before the optimizer's state exists: with fp16 the first steps may be skipped (inf gradients), the
        # same on every rank (the gradients are all-reduced), so every rank reserves at the same step
        if trainer.reservation is None and trainer.optimizer is not None and trainer.optimizer.state:
            trainer.reservation = trainer.checkpointer.reserve(trainer._checkpoint_state(trainer.model_wrapped))


class TieredTrainer(TieredCheckpointMixin, Trainer):
    """`transformers.Trainer` with tiered checkpoints (see the module's docstring)."""


def export_pretrained(model: torch.nn.Module, tiers: str | os.PathLike[str] | Config,
                      output_dir: str | os.PathLike[str], step: int | None = None) -> int:
    """Load the weights of checkpoint `step` (default: the newest complete one) into `model` (a
    `PreTrainedModel` of the trained architecture, e.g. `AutoModelForCausalLM.from_config(config)`) and write
    it with `save_pretrained`: a folder `from_pretrained` reads. One process, outside training. Returns the
    step."""
    config = tiers if isinstance(tiers, Config) else load_config(tiers)
    with Checkpointer(config.replace_engine(distributed=False)) as ckpt:
        info = ckpt.load({"model": model}, step=step)
    model.save_pretrained(output_dir)
    return info.step


def _trainer_state_json(state: Any) -> str:
    """What the Trainer writes to trainer_state.json."""
    return json.dumps(dataclasses.asdict(state), indent=2, sort_keys=True) + "\n"


def _rng_states() -> dict[str, Any]:
    """This process's RNG states, as the Trainer saves them (Python, NumPy, torch CPU and CUDA)."""
    name, keys, pos, has_gauss, cached = np.random.get_state()
    states: dict[str, Any] = {"python": random.getstate(),
                              "numpy": (name, keys.tolist(), int(pos), int(has_gauss), float(cached)),
                              "cpu": torch.get_rng_state()}
    if torch.cuda.is_available():
        states["cuda"] = torch.cuda.get_rng_state_all()
    return states


def _set_rng_states(states: dict[str, Any]) -> None:
    random.setstate(states["python"])
    name, keys, pos, has_gauss, cached = states["numpy"]
    np.random.set_state((name, np.array(keys, dtype=np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(states["cpu"])
    if "cuda" in states and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(states["cuda"])
