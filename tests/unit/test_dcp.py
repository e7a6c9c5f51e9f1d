"""tiered_ckpt.dcp in one process (no process group): dcp.save / dcp.async_save through StorageWriter and
dcp.load through StorageReader give back exactly what DCP's own FileSystemWriter/Reader give back; the
checkpoint is an ordinary one of the job (list, export, verified reads with fallback); bad input names what
is wrong. Multi-rank resharding: tests/multirank/test_dcp.py."""
from __future__ import annotations

import threading
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

import tiered_ckpt as tc
from tiered_ckpt.dcp import StorageReader, StorageWriter, close
from tiered_ckpt.dcp import engines as dcp_engines
from tiered_ckpt.layout import PartKey
from tiered_ckpt.testing.configs import stack_dict, write_toml

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")


@pytest.fixture(autouse=True)
def closed_engines():
    yield
    close()


def trained(seed: int) -> dict:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.randn(8, 16)).sum().backward()
    optimizer.step()
    return {"model": model.state_dict(), "optim": optimizer.state_dict(),
            "extra": {"epoch": seed, "name": f"run{seed}", "rng": torch.get_rng_state()}}


def flat(state: dict) -> dict:
    from torch.distributed.checkpoint._nested_dict import flatten_state_dict

    return flatten_state_dict(state)[0]


def same(a: dict, b: dict) -> None:
    fa, fb = flat(a), flat(b)
    assert fa.keys() == fb.keys()
    for k, v in fa.items():
        if isinstance(v, torch.Tensor):
            assert v.dtype == fb[k].dtype and torch.equal(v, fb[k]), k
        else:
            assert v == fb[k], k


def config_dict(tmp_path: Path, shm_dir: Path) -> dict:
    return stack_dict(tmp_path, {"kind": "memory", "capacity": "1GiB", "keep_last": 8}, "local", shm=shm_dir)


@pytest.fixture
def config(tmp_path, shm_dir) -> tc.Config:
    return tc.config.parse_config(config_dict(tmp_path, shm_dir))


@pytest.mark.parametrize("mode", ["save", "async_save"])
def test_round_trip_matches_filesystem_writer(config, tmp_path, mode):
    state = trained(1)
    if mode == "save":
        dcp.save(state, storage_writer=StorageWriter(config, step=10))
    else:
        dcp.async_save(state, storage_writer=StorageWriter(config, step=10)).result()
    dcp.save(state, storage_writer=dcp.FileSystemWriter(str(tmp_path / "fs")))
    ours, theirs = trained(2), trained(2)
    dcp.load(ours, storage_reader=StorageReader(config))
    dcp.load(theirs, storage_reader=dcp.FileSystemReader(str(tmp_path / "fs")))
    same(ours, state)
    same(theirs, ours)


def test_async_save_returns_after_the_copy_and_keeps_the_values_of_that_moment(config):
    state = trained(1)
    expected = {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in flat(state).items()}
    future = dcp.async_save(state, storage_writer=StorageWriter(config, step=3))
    for t in state["model"].values():  # training goes on at once: the checkpoint keeps the staged values
        t.add_(1.0)
    future.result()
    loaded = trained(5)
    dcp.load(loaded, storage_reader=StorageReader(config, step=3))
    same(loaded, _unflat(expected, state))


class ThreadsOfSaves(StorageWriter):
    """The writer, noting the thread each engine save of it starts on."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.save_threads: list[str] = []

    def _save(self, values, mappings):
        self.save_threads.append(threading.current_thread().name)
        super()._save(values, mappings)


def test_async_save_stages_through_the_writer_in_the_calling_thread(config):
    """async_save takes the writer as its stager (not DCP's DefaultStager, whose full copy would then be saved in
    DCP's thread): the one engine save starts in the training thread, before async_save returns."""
    state = trained(1)
    writer = ThreadsOfSaves(config, step=3)
    future = dcp.async_save(state, storage_writer=writer)
    assert writer.save_threads == [threading.current_thread().name]
    assert writer.handle is not None and writer.handle.step == 3
    future.result()
    assert writer.save_threads == [threading.current_thread().name]  # write_data found it staged


def test_async_saves_checkpoint_id_is_the_staged_step(config):
    """async_save's checkpoint_id names the step, as dcp.save's does, though DCP hands it to the writer only
    after staging: a writer made for step 8, or with no step, stages step 9 when given checkpoint_id 9."""
    for writer, given in ((ThreadsOfSaves(config, step=8), 9), (ThreadsOfSaves(config), "/ckpt/step-12")):
        state = trained(given if isinstance(given, int) else 12)
        expected = _unflat({k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in flat(state).items()}, state)
        future = dcp.async_save(state, storage_writer=writer, checkpoint_id=given)
        for t in state["model"].values():
            t.add_(1.0)
        future.result()
        assert writer.save_threads == [threading.current_thread().name]
        loaded = trained(5)
        dcp.load(loaded, storage_reader=StorageReader(config), checkpoint_id=given)
        same(loaded, expected)
    assert [s.step for s in dcp_engines.checkpointer(config).list()] == [9, 12]  # no step 8
    with pytest.raises(ValueError, match="no step to stage.*checkpoint_id=N"):
        dcp.async_save(trained(1), storage_writer=StorageWriter(config))


def test_async_saves_process_mode_is_refused_before_anything_is_saved(config):
    """The writer is the stager, so the process mode is refused in stage(), before the engine's save starts (the
    multirank test runs it under a process group)."""
    from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

    with pytest.raises(TypeError, match="cannot be sent to another process.*thread mode"):
        dcp.async_save(trained(1), storage_writer=StorageWriter(config, step=1),
                       async_checkpointer_type=AsyncCheckpointerType.PROCESS)
    assert dcp_engines.checkpointer(config).list() == []


def test_a_staged_save_is_kept_by_a_reset_to_its_step_and_a_reset_to_another_is_refused(config):
    writer = StorageWriter(config, step=8)
    state = trained(1)
    writer.stage(state)  # outside async_save: the writer's own step
    handle = writer.handle
    writer.reset("step-8")
    assert writer.handle is handle
    dcp.save(state, storage_writer=writer, checkpoint_id=8)
    other = StorageWriter(config, step=10)
    other.stage(trained(2))
    with pytest.raises(ValueError, match=r"stage\(\) saved step 10 .* names step 11; step 10 is saved all the same"):
        other.reset(11)
    other.handle.wait()
    other.reset(11)  # usable again: a new save
    dcp.save(trained(3), storage_writer=other)
    for step, seed in ((8, 1), (10, 2), (11, 3)):
        loaded = trained(5)
        dcp.load(loaded, storage_reader=StorageReader(config, step=step))
        same(loaded, trained(seed))


def _unflat(values: dict, like: dict) -> dict:
    from torch.distributed.checkpoint._nested_dict import flatten_state_dict, unflatten_state_dict

    return unflatten_state_dict(values, flatten_state_dict(like)[1])


def test_reader_takes_the_newest_complete_step_and_a_given_one(config):
    for step, seed in ((10, 1), (20, 2)):
        dcp.save(trained(seed), storage_writer=StorageWriter(config, step=step, durable="all"))
    newest, older = trained(9), trained(9)
    reader = StorageReader(config)
    assert reader.step == 20
    dcp.load(newest, storage_reader=reader)
    same(newest, trained(2))
    dcp.load(older, storage_reader=StorageReader(config, step=10))
    same(older, trained(1))


def test_checkpoint_id_names_the_step(config):
    dcp.save(trained(1), storage_writer=StorageWriter(config), checkpoint_id="/anywhere/step-30")
    loaded = trained(9)
    dcp.load(loaded, storage_reader=StorageReader(config), checkpoint_id="step-30")
    same(loaded, trained(1))


def test_the_checkpoint_is_the_jobs_own(config, tmp_path):
    """list, export and the engine see a DCP save as any checkpoint: tensors by their DCP names."""
    state = trained(1)
    dcp.save(state, storage_writer=StorageWriter(config, step=7, durable="all"))
    close()
    with tc.Checkpointer(config) as ckpt:
        (status,) = ckpt.list()
        assert status.step == 7 and status.complete == {"host", "disk"} and status.metadata == {"format": "dcp"}
        info = ckpt.export(tmp_path / "out.pt", to="torch")
        assert info.tensors > 0
    exported = torch.load(tmp_path / "out.pt")
    assert torch.equal(exported["model.0.weight"], state["model"]["0.weight"])


def test_a_corrupt_part_on_the_memory_tier_is_read_from_disk(config, shm_dir):
    state = trained(1)
    dcp.save(state, storage_writer=StorageWriter(config, step=4, durable="all"))
    engine = dcp_engines.checkpointer(config).engine
    part = Path(engine.store.io.driver("host").root) / PartKey("test", 4, 0, 0, engine.incarnation).path
    with open(part, "r+b") as f:  # a flipped byte in the memory tier's first part
        f.seek(100)
        byte = f.read(1)
        f.seek(100)
        f.write(bytes([byte[0] ^ 0xFF]))
    reader = StorageReader(config)
    loaded = trained(9)
    dcp.load(loaded, storage_reader=reader)
    same(loaded, state)
    assert reader.reads.fallbacks and reader.reads.bytes_by_tier.get("disk")


def test_a_config_file_and_a_job_override(tmp_path, shm_dir):
    path = write_toml(tmp_path / "tiered.toml", config_dict(tmp_path, shm_dir))
    dcp.save(trained(1), storage_writer=StorageWriter(path, job="other", step=1))
    loaded = trained(9)
    dcp.load(loaded, storage_reader=StorageReader(str(path), job="other"))
    same(loaded, trained(1))
    with pytest.raises(tc.IncompleteCheckpoint, match="job 'test'.*complete checkpoints: none"):
        StorageReader(path)  # the file's own job has none


def test_bad_input_is_named(config, tmp_path):
    with pytest.raises(tc.ConfigError, match="nope.toml"):
        StorageWriter(tmp_path / "nope.toml", step=1)
    with pytest.raises(tc.ConfigError, match="nope.toml"):
        StorageReader(str(tmp_path / "nope.toml"))
    dcp.save(trained(1), storage_writer=StorageWriter(config, step=10))
    with pytest.raises(tc.IncompleteCheckpoint, match=r"job 'test'.*12.*complete checkpoints: \[10\]"):
        StorageReader(config, step=12)
    with pytest.raises(ValueError, match="names no step"):
        StorageWriter(config).reset("latest")
    with pytest.raises(CheckpointException, match="the writer has no step"):  # DCP wraps every rank's error
        dcp.save(trained(1), storage_writer=StorageWriter(config))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(CheckpointException, match="keys starting with '__dcp__'"):
            dcp.save({"__dcp__": torch.ones(2)}, storage_writer=StorageWriter(config, step=11))


def test_a_step_no_tier_takes_is_refused(tmp_path, shm_dir):
    raw = config_dict(tmp_path, shm_dir)
    for tier in raw["tiers"]:
        tier["every"] = 5
    with pytest.raises(ValueError, match="no tier takes step 3"):
        StorageWriter(tc.config.parse_config(raw), step=3)


def test_a_save_no_tier_committed_is_never_visible_to_the_reader(tmp_path):
    """DCP's metadata is the manifest's: with every tier failing its writes, dcp.save raises and no step is
    listed as loadable (nothing half-written can be read as a checkpoint)."""
    from tiered_ckpt.testing.configs import faults, stack

    config = stack(tmp_path, "faulty")
    dcp.save(trained(1), storage_writer=StorageWriter(config, step=1))
    faults(config).inject("fail")
    with pytest.raises(CheckpointException, match="disk"):
        dcp.save(trained(2), storage_writer=StorageWriter(config, step=2))
    reader = StorageReader(config)
    assert reader.step == 1
    loaded = trained(9)
    dcp.load(loaded, storage_reader=reader)
    same(loaded, trained(1))
