"""tiered_ckpt.dcp in one process (no process group): dcp.save / dcp.async_save through StorageWriter and
dcp.load through StorageReader give back exactly what DCP's own FileSystemWriter/Reader give back; the
checkpoint is an ordinary one of the job (list, export, verified reads with fallback); bad input names what
is wrong. Multi-rank resharding: tests/multirank/test_dcp.py."""
from __future__ import annotations

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
