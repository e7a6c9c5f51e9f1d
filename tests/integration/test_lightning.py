"""tiered_ckpt.integrations.lightning with real Lightning Trainers on CPU: ModelCheckpoint top-k and save_last
keep what they keep with torch.save, loads give the dicts torch.save would, resume from "last" is exact,
removing or re-saving a path while its save is in flight works, hyper-parameter objects are refused or
pickled as configured, and DDP with two processes saves and resumes (docs/integrations.md)."""
from __future__ import annotations

import asyncio
import datetime
import json
import os
import signal
import subprocess
import sys
import threading
import time
import tomllib
from pathlib import Path
from typing import Any

import lightning as L  # the `test` extra installs it
import pytest
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint

import tiered_ckpt as tc
from tiered_ckpt.integrations.lightning import ReserveStaging, TieredCheckpointIO
from tiered_ckpt.save import plan as plan_module
from tiered_ckpt.save.pool import StagingPool
from tiered_ckpt.testing import configs

from .lightning_script import Record, TinyModule, loader, weights

SCRIPT = Path(__file__).with_name("lightning_script.py")


def write_toml(tmp_path: Path, shm_dir: Path, host: str = "", disk: str = "local", **engine: Any) -> Path:
    """tiers.toml: host (256 MiB, and the memory tier's keys in the TOML lines `host`) and disk (of kind `disk`);
    `[engine]` keys as keywords."""
    memory = {"kind": "memory", "capacity": "256MiB", **tomllib.loads(host)}
    return configs.write_toml(tmp_path / "tiers.toml", configs.stack_dict(tmp_path, memory, disk, shm=shm_dir,
                                                                          job="lit", **engine))


def fit(ckpt_dir: Path, io: TieredCheckpointIO | None, epochs: int, ckpt_path: str | None = None,
        callbacks: tuple = (), save_last: bool | str = True,
        save_top_k: int = 2) -> tuple[L.Trainer, TinyModule, ModelCheckpoint]:
    torch.manual_seed(0)
    module = TinyModule()
    mc = ModelCheckpoint(dirpath=ckpt_dir, monitor="score", mode="min", save_top_k=save_top_k, save_last=save_last)
    trainer = L.Trainer(max_epochs=epochs, accelerator="cpu", devices=1, plugins=[io] if io else None,
                        callbacks=[mc, *callbacks], logger=False, enable_progress_bar=False,
                        enable_model_summary=False, limit_val_batches=1)
    trainer.fit(module, loader(), loader(), ckpt_path=ckpt_path)
    return trainer, module, mc


def engine_paths(config: Path) -> list[str]:
    """Read without the plugin: the path recorded with each checkpoint of the job (each must be complete on
    every tier: ModelCheckpoint counts on each checkpoint it keeps, so no tier may skip one)."""
    with tc.Checkpointer.from_toml(config) as ckpt:
        statuses = ckpt.list()
        assert all(s.complete == {"host", "disk"} for s in statuses), statuses
        return sorted(ckpt.read_manifest(s.step).metadata["lightning"]["path"] for s in statuses)


def assert_same(got: Any, expected: Any, got_dir: str, expected_dir: str, where: str = "") -> None:
    """Equal, with the expected run's directory in strings read as the other run's."""
    if isinstance(expected, torch.Tensor):
        assert isinstance(got, torch.Tensor) and got.dtype == expected.dtype, where
        assert torch.equal(got, expected), where
    elif isinstance(expected, dict):
        assert isinstance(got, dict), where
        keys = [k.replace(expected_dir, got_dir) if isinstance(k, str) else k for k in expected]
        assert list(got) == keys, where
        for k, key in zip(expected, keys):
            assert_same(got[key], expected[k], got_dir, expected_dir, f"{where}/{key}")
    elif isinstance(expected, (list, tuple)):
        assert type(got) is type(expected) and len(got) == len(expected), where
        for i, (g, e) in enumerate(zip(got, expected)):
            assert_same(g, e, got_dir, expected_dir, f"{where}/{i}")
    elif isinstance(expected, str):
        assert got == expected.replace(expected_dir, got_dir), where
    else:
        assert type(got) is type(expected) and got == expected, where


def test_model_checkpoint_keeps_and_loads_what_it_does_with_torch_save(tmp_path, shm_dir):
    config = write_toml(tmp_path, shm_dir)
    stock_dir, tiered_dir = Path(os.path.realpath(tmp_path / "stock")), Path(os.path.realpath(tmp_path / "tiered"))
    _, _, stock = fit(stock_dir, None, epochs=5)
    io = TieredCheckpointIO(config)
    removed: list[str] = []
    remove = io.remove_checkpoint
    io.remove_checkpoint = lambda path: (removed.append(os.path.basename(path)), remove(path))[1]  # type: ignore
    trainer, _, tiered = fit(tiered_dir, io, epochs=5)

    kept = sorted(os.path.basename(p) for p in [*tiered.best_k_models, tiered.last_model_path])
    assert kept == sorted(os.path.basename(p) for p in [*stock.best_k_models, stock.last_model_path])
    assert kept == ["epoch=2-step=18.ckpt", "epoch=4-step=30.ckpt", "last.ckpt"]
    assert sorted(removed) == ["epoch=0-step=6.ckpt", "epoch=1-step=12.ckpt"]  # top-k pushed them out
    assert sorted(os.listdir(tiered_dir)) == sorted(os.listdir(stock_dir)) == kept  # one pointer per kept path
    # last.ckpt was saved 3 times and 2 paths were removed: the engine holds exactly the 3 kept checkpoints
    assert engine_paths(config) == [str(tiered_dir / name) for name in kept]

    for name in kept:  # the dict Lightning gets back is the one torch.save wrote, value for value
        expected = torch.load(stock_dir / name, weights_only=False)
        got = io.load_checkpoint(tiered_dir / name)
        assert_same(got, expected, str(tiered_dir), str(stock_dir), name)
    assert got["global_step"] == trainer.global_step == 30
    io.teardown()


def test_resume_from_last_is_exact(tmp_path, shm_dir):
    config = write_toml(tmp_path, shm_dir)
    ckpt_dir = Path(os.path.realpath(tmp_path / "ckpt"))
    first, first_module, _ = fit(ckpt_dir, TieredCheckpointIO(config), epochs=5)  # epoch 4 saved last.ckpt

    record = Record()
    io = TieredCheckpointIO(config)  # as in a new process: nothing in memory
    resumed, module, mc = fit(ckpt_dir, io, epochs=7, ckpt_path="last", callbacks=(record,))
    assert record.at_start == {"global_step": 30, "epoch": 5, "weights": weights(first_module)}
    assert first.global_step == 30 and resumed.global_step == 42

    _, straight, _ = fit(tmp_path / "straight", None, epochs=7)  # optimizer momentum, lr schedule, data order
    assert weights(module) == weights(straight)
    # epoch 6 pushed out epoch 2, saved by the first run: removed through its pointer and manifest
    assert sorted(os.path.basename(p) for p in mc.best_k_models) == ["epoch=4-step=30.ckpt", "epoch=6-step=42.ckpt"]
    assert engine_paths(config) == sorted([*mc.best_k_models, mc.last_model_path])
    resumed.validate(module, loader(), ckpt_path="best", verbose=False)  # epoch 4's score is the best
    assert weights(module) == weights(first_module)


def test_save_last_link_resumes_and_removing_the_link_keeps_its_target(tmp_path, shm_dir):
    config = write_toml(tmp_path, shm_dir)
    ckpt_dir = Path(os.path.realpath(tmp_path / "ckpt"))
    _, first_module, mc = fit(ckpt_dir, TieredCheckpointIO(config), epochs=5, save_last="link")
    last = ckpt_dir / "last.ckpt"
    assert os.readlink(last) == "epoch=4-step=30.ckpt"  # a symlink to the newest top-k pointer, no save of its own
    assert engine_paths(config) == sorted(mc.best_k_models)

    record = Record()
    fit(ckpt_dir, TieredCheckpointIO(config), epochs=6, ckpt_path="last", callbacks=(record,), save_last="link")
    assert record.at_start == {"global_step": 30, "epoch": 5, "weights": weights(first_module)}

    link = ckpt_dir / "link.ckpt"  # (the resumed run's on_train_end saved a real last.ckpt over the link)
    os.symlink("epoch=4-step=30.ckpt", link)
    io = TieredCheckpointIO(config)
    assert io.load_checkpoint(link)["global_step"] == 30
    io.remove_checkpoint(link)
    assert not os.path.lexists(link) and (ckpt_dir / "epoch=4-step=30.ckpt").exists()
    assert str(ckpt_dir / "epoch=4-step=30.ckpt") in engine_paths(config)
    io.teardown()


def test_remove_and_resave_while_saves_are_in_flight(tmp_path, shm_dir):
    config = write_toml(tmp_path, shm_dir, disk="faulty")
    ckpt_dir = Path(os.path.realpath(tmp_path / "ckpt"))
    io = TieredCheckpointIO(config)
    disk = configs.faults(tc.load_config(config))
    disk.inject("stall")  # the disk holds every write until cleared (a disk far slower than the saves)

    def state(value: float, step: int) -> dict[str, Any]:
        return {"state_dict": {"w": torch.full((64 * 1024,), value)}, "global_step": step, "epoch": 0}

    gone = ckpt_dir / "gone.ckpt"
    io.save_checkpoint(state(1.0, 3), gone)
    assert not any(s.is_complete for s in io.checkpointer.list())  # still being written
    threading.Timer(0.5, disk.clear).start()  # the disk comes back while remove_checkpoint waits
    io.remove_checkpoint(gone)  # waits for the save, then deletes it (no CheckpointExists)
    disk.inject("stall", seconds=1.0)  # slow, no longer stopped: a second a write (it held them 60 s before)
    assert io.checkpointer.list() == [] and not gone.exists()

    # save_last: one global step under two paths; then last.ckpt saved again, before the first save is done
    best, other, last = ckpt_dir / "best.ckpt", ckpt_dir / "other.ckpt", ckpt_dir / "last.ckpt"
    io.save_checkpoint(state(1.0, 3), best)
    io.save_checkpoint(state(1.0, 3), other)  # waits for its turn on the slow disk: must not be skipped there
    io.save_checkpoint(state(1.0, 3), last)
    io.save_checkpoint(state(2.0, 6), last)
    disk.clear()
    assert io.load_checkpoint(best)["global_step"] == 3
    loaded = io.load_checkpoint(last)
    assert loaded["global_step"] == 6 and torch.all(loaded["state_dict"]["w"] == 2.0)
    io.teardown()
    assert engine_paths(config) == [str(best), str(last), str(other)]  # the older last.ckpt was retired

    os.remove(last)  # a lost pointer: the manifests still say which checkpoint was saved under that path
    assert TieredCheckpointIO(config).load_checkpoint(last)["global_step"] == 6

    io = TieredCheckpointIO(config)
    assert io.load_checkpoint(best, map_location="meta")["state_dict"]["w"].device.type == "meta"
    assert io.load_checkpoint(best, map_location=lambda s, loc: s)["state_dict"]["w"].device.type == "cpu"
    plain = tmp_path / "plain.ckpt"  # a checkpoint torch.save wrote (before switching to tiered_ckpt)
    torch.save({"global_step": 1, "w": torch.ones(2)}, plain)
    assert io.load_checkpoint(plain)["global_step"] == 1
    with pytest.raises(FileNotFoundError, match="no pointer file"):
        io.load_checkpoint(ckpt_dir / "never.ckpt")
    io.teardown()


def test_torch_load_of_a_pointer_names_the_command_that_converts_it(tmp_path, shm_dir):
    """A user who torch.loads a pointer (`torch.load("last.ckpt")`, `Module.load_from_checkpoint`) gets an error
    quoting the pointer's first lines: what the file is, and the `tiered-ckpt export` command that writes the
    checkpoint as a torch.save file. That command works as printed; the plugin still reads the pointer, and
    reads pointers of earlier releases (JSON only)."""
    config = write_toml(tmp_path, shm_dir)
    io = TieredCheckpointIO(config)
    last = tmp_path / "last.ckpt"
    score = torch.tensor(0.25, dtype=torch.float64)  # kept as a value in the skeleton: a tensor again in the file
    io.save_checkpoint({"state_dict": {"w": torch.arange(4.0)}, "global_step": 7,
                        "callbacks": {"ModelCheckpoint": {"best_model_score": score}}}, last)
    io.teardown()

    with pytest.raises(Exception) as default:  # weights_only=True, torch's default
        torch.load(last)
    assert type(default.value).__name__ == "UnpicklingError"
    message = str(default.value)
    assert "tiered_ckpt pointer file, not a torch save file" in message
    command = message.split("GLOBAL ")[1].split(".tiered-ckpt export ")[1].split(" was not an allowed global")[0]
    assert command == f"0 --to torch -o step0.pt --job lit -c {config}"
    with pytest.raises(ModuleNotFoundError, match="tiered_ckpt pointer file, not a torch save file"):
        torch.load(last, weights_only=False)

    export = subprocess.run([sys.executable, "-m", "tiered_ckpt.cli", "export", *command.split()], cwd=tmp_path,
                            capture_output=True, text=True, timeout=120)
    assert export.returncode == 0, export.stderr
    exported = torch.load(tmp_path / "step0.pt", weights_only=True)
    assert exported["global_step"] == 7 and torch.equal(exported["state_dict"]["w"], torch.arange(4.0))
    exported_score = exported["callbacks"]["ModelCheckpoint"]["best_model_score"]
    assert exported_score.dtype == torch.float64 and torch.equal(exported_score, score)

    assert TieredCheckpointIO(config).load_checkpoint(last)["global_step"] == 7
    earlier = last.read_bytes().split(b"\n", 2)[2]  # the JSON alone: a pointer an earlier release wrote
    assert earlier.startswith(b"{")
    last.write_bytes(earlier)
    assert TieredCheckpointIO(config).load_checkpoint(last)["global_step"] == 7


def test_hyperparameter_objects_are_refused_unless_pickle_is_allowed(tmp_path, shm_dir):
    config = write_toml(tmp_path, shm_dir)
    path = Path(os.path.realpath(tmp_path / "ckpt" / "a.ckpt"))
    checkpoint = {"state_dict": {"w": torch.ones(3)},
                  "hyper_parameters": {"lr": 0.1, "act": torch.nn.ReLU(), "when": datetime.date(2024, 1, 2)}}

    io = TieredCheckpointIO(config, job="strict")
    with pytest.raises(tc.StateError, match=r"hyper_parameters/act.*save_hyperparameters\(ignore"):
        io.save_checkpoint(checkpoint, path)
    without_module = {**checkpoint, "hyper_parameters": {"lr": 0.1, "when": datetime.date(2024, 1, 2)}}
    with pytest.raises(tc.StateError, match=r"hyper_parameters/when.*allow_pickle"):
        io.save_checkpoint(without_module, path)
    assert io.checkpointer.list() == [] and not path.exists()
    io.teardown()

    io = TieredCheckpointIO(config, job="pickled", allow_pickle=True)
    io.save_checkpoint(checkpoint, path)
    hparams = io.load_checkpoint(path)["hyper_parameters"]
    assert isinstance(hparams["act"], torch.nn.ReLU) and hparams["when"] == datetime.date(2024, 1, 2)
    with pytest.raises(tc.StateError, match="weights_only=True.*pickle"):
        io.load_checkpoint(path, weights_only=True)
    io.teardown()


def run_ddp(*args: str, timeout: float = 180) -> str:
    """One 2-process DDP fit (Lightning starts rank 1). Its own session, so a hang kills both ranks, after each
    printed its threads' stacks (SIGUSR1: faulthandler). 180 s: a 3-epoch fit passed 90 s on a loaded CI machine."""
    proc = subprocess.Popen([sys.executable, str(SCRIPT), *args], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGUSR1)
        try:
            out, _ = proc.communicate(timeout=5)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            out, _ = proc.communicate()
        pytest.fail(f"the DDP run hung for {timeout} s:\n{out[-12000:]}")
    assert proc.returncode == 0, out[-4000:]
    return out


@pytest.mark.timeout(420)
def test_ddp_two_processes_save_and_resume(tmp_path, shm_dir):
    config = write_toml(tmp_path, shm_dir)
    ckpt_dir = Path(os.path.realpath(tmp_path / "ckpt"))
    run_ddp(str(config), str(ckpt_dir), str(tmp_path / "first"), "3")
    first = [json.loads((tmp_path / "first" / f"rank{r}.json").read_text()) for r in (0, 1)]
    # 24 samples, batch 4, 2 ranks: 3 steps per epoch; epoch 2 pushed out epoch 1 and saved last.ckpt
    assert [os.path.basename(p) for p in first[0]["kept"]] == ["epoch=0-step=3.ckpt", "epoch=2-step=9.ckpt"]
    assert sorted(first[0]["checkpoints"]) == sorted([*first[0]["kept"], first[0]["last"]])
    assert first[0]["weights"] == first[1]["weights"]
    # ReserveStaging: every rank built the checkpoint (no rank waited for another), rank 0, which saves, reserved
    assert first[0]["reserved"] >= 1 and first[1]["reserved"] is None

    out = run_ddp(str(config), str(ckpt_dir), str(tmp_path / "second"), "5", "--resume")
    assert "Restored all states" in out
    second = [json.loads((tmp_path / "second" / f"rank{r}.json").read_text()) for r in (0, 1)]
    for rank in (0, 1):  # every rank read the checkpoint itself, through an engine of its own
        assert second[rank]["at_start"] == {"global_step": 9, "epoch": 3, "weights": first[0]["weights"]}, rank
        assert second[rank]["global_step"] == 15
    assert [os.path.basename(p) for p in second[0]["kept"]] == ["epoch=2-step=9.ckpt", "epoch=4-step=15.ckpt"]
    assert sorted(second[0]["checkpoints"]) == sorted([*second[0]["kept"], second[0]["last"]])
    assert engine_paths(config) == sorted([*second[0]["kept"], second[0]["last"]])


def count_buffers_and_plans(monkeypatch) -> tuple[list[int], list[int]]:
    """The staging buffers the engines of this process make from now on (their sizes), and the plans they make
    (their sizes): Lightning tears the plugin's engine down at the end of fit, so it is counted from outside."""
    made: list[int] = []
    plans: list[int] = []
    new, make, plan_world = StagingPool._new, StagingPool._make, plan_module._plan_world
    monkeypatch.setattr(StagingPool, "_new", lambda self, nbytes: (made.append(nbytes), new(self, nbytes))[1])
    monkeypatch.setattr(StagingPool, "_make", lambda self, nbytes, plan: (made.append(nbytes),
                                                                          make(self, nbytes, plan))[1])

    def counted_plan(*args: Any) -> Any:  # rank 0 plans the world on each plan miss (save/plan.py)
        shares, world, error = plan_world(*args)
        if world is not None:
            plans.append(sum(world.rank_nbytes))
        return shares, world, error

    monkeypatch.setattr(plan_module, "_plan_world", counted_plan)
    return made, plans


class DurableBeforeEachEpoch(Callback):
    """Each epoch starts once the saves before it are durable on every tier: a buffer is busy until its disk copy
    is written, so where the disk lags (a loaded CI machine made 6 buffers) more saves overlap; this keeps the
    count a property of the pool, not of the machine's speed."""

    def __init__(self, io: TieredCheckpointIO):
        self.io = io

    def on_train_epoch_start(self, trainer: L.Trainer, module: L.LightningModule) -> None:
        if self.io._ckpt is not None:
            self.io._ckpt.wait_all()


def test_saving_every_epoch_reuses_the_staging_buffers(tmp_path, shm_dir, monkeypatch):
    """ModelCheckpoint's scores are 0-d tensors, one more per kept path: saved as tensors, each save had other
    tensors, so it planned anew and (with the memory tier staging its files, which must be the state's size)
    made a staging buffer of its own: 17 for 16 saves with save_top_k=-1. They are stored as values now, and a
    checkpoint retired while the next save already took a buffer is kept for the save after: every save is of
    one plan, and the buffers made are the ones the memory tier holds (keep_last + 1) and one in flight."""
    config = write_toml(tmp_path, shm_dir, host="keep_last = 2")
    made, plans = count_buffers_and_plans(monkeypatch)
    io = TieredCheckpointIO(config)
    ckpt_dir = Path(os.path.realpath(tmp_path / "ckpt"))
    trainer, _, mc = fit(ckpt_dir, io, epochs=8, save_top_k=-1, callbacks=(DurableBeforeEachEpoch(io),))
    assert io._next_step == 16  # every epoch: its own path, and last.ckpt
    assert len(made) <= 2 + 1 + 1, made
    assert len(plans) == 1, plans
    for path, score in mc.best_k_models.items():  # scores come back as the tensors ModelCheckpoint holds
        state = io.load_checkpoint(path)["callbacks"]
        (saved,) = [v for k, v in state.items() if k.startswith("ModelCheckpoint")]
        assert saved["best_k_models"][path].dtype == score.dtype and torch.equal(saved["best_k_models"][path], score)
    io.teardown()


def test_reserve_staging_makes_the_buffers_before_the_first_save(tmp_path, shm_dir, monkeypatch):
    config = write_toml(tmp_path, shm_dir, host="keep_last = 2")
    made, plans = count_buffers_and_plans(monkeypatch)
    io = TieredCheckpointIO(config)
    reserving = ReserveStaging()
    saves_at_reserve: list[int] = []
    reserve = io.reserve
    io.reserve = lambda checkpoint: (saves_at_reserve.append(io._next_step), reserve(checkpoint))[1]  # type: ignore
    fit(Path(os.path.realpath(tmp_path / "ckpt")), io, epochs=4, callbacks=(reserving,), save_top_k=-1)
    assert saves_at_reserve == [0] and reserving.done  # once, before any save
    assert io.reservation is not None and io.reservation.made == 2 + 1  # keep_last + max_inflight
    assert io._next_step == 8
    assert len(made) == io.reservation.made + 1, made  # the one the tier holds beyond keep_last, made once
    assert len(plans) == 1, plans  # the reservation's plan is every save's
    io.teardown()


def test_a_superseded_version_is_deleted_in_the_background(tmp_path, shm_dir, monkeypatch):
    """Saving last.ckpt again deletes its older version once the new one is complete. That delete (a tenth of a
    second and more for a large checkpoint) runs beside training: save_checkpoint does not wait for it, and
    teardown does."""
    config = write_toml(tmp_path, shm_dir)
    delete = tc.Engine.delete
    deleting = threading.Event()

    deleted: list[int] = []

    async def slow_delete(engine: tc.Engine, step: int) -> None:
        deleted.append(step)
        deleting.set()
        await asyncio.sleep(2.0)
        await delete(engine, step)

    monkeypatch.setattr(tc.Engine, "delete", slow_delete)
    io = TieredCheckpointIO(config)
    last = tmp_path / "last.ckpt"
    for epoch in (0, 1):
        io.save_checkpoint({"state_dict": {"w": torch.full((4,), float(epoch))}, "epoch": epoch}, last)
    io._inflight[1].wait()  # the second version is complete: the first goes at the next save
    started = time.perf_counter()
    io.save_checkpoint({"state_dict": {"w": torch.zeros(4)}, "epoch": 2}, tmp_path / "other.ckpt")
    assert time.perf_counter() - started < 1.5 and deleting.is_set()  # returned while the delete sleeps
    io.save_checkpoint({"state_dict": {"w": torch.ones(4)}, "epoch": 3}, last)  # while version 0 is being deleted
    io.teardown()  # waits for it
    assert engine_paths(config) == sorted([str(last), str(tmp_path / "other.ckpt")])
    assert io.load_checkpoint(last)["epoch"] == 3
    assert deleted == [0, 1], deleted  # each superseded version deleted once (0 was not listed as 3's older one)


def test_a_failed_background_delete_is_logged_not_raised(tmp_path, shm_dir, monkeypatch, caplog):
    async def failing_delete(engine: tc.Engine, step: int) -> None:
        raise RuntimeError("the tier went away")

    monkeypatch.setattr(tc.Engine, "delete", failing_delete)
    io = TieredCheckpointIO(write_toml(tmp_path, shm_dir))
    last = tmp_path / "last.ckpt"
    for epoch in range(3):  # the third save reaps the second, which supersedes the first
        io.save_checkpoint({"state_dict": {"w": torch.full((4,), float(epoch))}}, last)
        io._inflight[epoch].wait()
    io.teardown()
    assert "the superseded checkpoint 0 was not deleted: RuntimeError: the tier went away" in caplog.text


def test_reserve_staging_needs_the_plugin(tmp_path):
    with pytest.raises(ValueError, match="TieredCheckpointIO"):
        fit(tmp_path / "ckpt", None, epochs=1, callbacks=(ReserveStaging(),))


def test_save_on_sigterm_is_refused_since_nothing_asks_should_save(tmp_path, shm_dir):
    """ModelCheckpoint decides when to save and never asks should_save: a SIGTERM handler would only note the
    signal, and the process would go on until SIGKILL."""
    with pytest.raises(ValueError, match="save_on_sigterm"):
        TieredCheckpointIO(write_toml(tmp_path, shm_dir), save_on_sigterm=True)


@pytest.mark.parametrize("disk, warned", [("every = 2", True), ("keep_last = 3", True), ("", False)])
def test_the_plugin_warns_when_no_tier_keeps_every_save(tmp_path, shm_dir, disk, warned, recwarn):
    """A disk tier with `every = 2` holds only every second save: with keep_last on the memory tier, a top-k
    checkpoint saved at an odd step went with the memory tier's retention. The warning looked at keep_last
    alone, so it said nothing then."""
    config = write_toml(tmp_path, shm_dir, host="keep_last = 1")
    config.write_text(config.read_text() + disk + "\n")
    TieredCheckpointIO(config)
    said = [str(w.message) for w in recwarn.list if "no tier keeps every save" in str(w.message)]
    assert bool(said) == warned, [str(w.message) for w in recwarn.list]
