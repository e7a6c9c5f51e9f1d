"""tiered_ckpt.integrations.hf with real Hugging Face Trainers on CPU (a tiny GPT-2 built from its config): a run
that failed resumes through the tiers exactly where its newest complete checkpoint left off, save_total_limit
becomes tier retention, a run resumed at max_steps trains no further, a changed batch size is refused instead
of training on other data, a run begun with the Trainer's own folders resumes from them, and checkpoints export
to folders `from_pretrained` reads (docs/integrations.md). Killed processes and DDP: tests/e2e/test_hf_example.py."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainerCallback, TrainingArguments, set_seed

import tiered_ckpt as tc
from tiered_ckpt.testing.configs import stack
from tiered_ckpt.integrations.hf import TieredTrainer, cap_keep_last, export_pretrained, run_config

pytestmark = pytest.mark.timeout(300)  # several real Trainer runs per test

VOCAB = 64


class Crash(Exception):
    pass


class CrashAt(TrainerCallback):
    """The run fails after `step` (a bug, an OOM): what was saved before stays."""

    def __init__(self, step: int):
        self.step = step

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == self.step:
            raise Crash(f"crash after step {state.global_step}")


class Steps(TrainerCallback):
    """The global steps a run trained."""

    def __init__(self) -> None:
        self.trained: list[int] = []

    def on_step_end(self, args, state, control, **kwargs):
        self.trained.append(state.global_step)


def data() -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [{"input_ids": x, "labels": x} for x in torch.randint(0, VOCAB, (24, 16), generator=g)]


def trainer(out: Path, shm: Path, *, steps: int = 12, cls: type = TieredTrainer, callbacks: tuple = (),
            tiers: tc.Config | None = None, reserve: bool = False, **args) -> Trainer:
    """6 steps per epoch (24 samples, batches of 4): 12 steps cross an epoch; dropout on."""
    torch.set_num_threads(1)
    training = TrainingArguments(output_dir=str(out), max_steps=steps, per_device_train_batch_size=4, save_steps=4,
                                 learning_rate=1e-3, warmup_steps=2, seed=0, data_seed=0, use_cpu=True,
                                 report_to=[], disable_tqdm=True, logging_steps=100, **args)
    set_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=VOCAB, n_positions=16, n_embd=16, n_layer=2, n_head=2,
                                       bos_token_id=0, eos_token_id=0))
    extra = {"tiers": tiers or run_config(out, shm_root=shm, part_size="64KiB"),
             **({"reserve": True} if reserve else {})} if cls is TieredTrainer else {}
    return cls(model=model, args=training, train_dataset=data(), callbacks=list(callbacks), **extra)


def weights(t: Trainer) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in t.model.state_dict().items()}


def assert_bit_equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    differ = [k for k in a if not (a[k].dtype == b[k].dtype and torch.equal(a[k].reshape(-1).view(torch.uint8),
                                                                        b[k].reshape(-1).view(torch.uint8)))]
    assert not differ, differ


def optimizer_tensors(t: Trainer) -> dict[str, torch.Tensor]:
    sd = t.optimizer.state_dict()["state"]
    return {f"{i}/{k}": v.clone() for i, s in sd.items() for k, v in s.items()}


def test_a_failed_run_resumes_where_its_newest_checkpoint_left_off(tmp_path, shm_dir):
    straight = trainer(tmp_path / "straight", shm_dir)
    straight.train()

    out = tmp_path / "run"
    with pytest.raises(Crash):
        trainer(out, shm_dir, callbacks=(CrashAt(10),)).train()
    steps = Steps()
    resumed = trainer(out, shm_dir, callbacks=(steps,))
    assert resumed.last_checkpoint() == 8
    resumed.train(resume_from_checkpoint=True)

    assert steps.trained == [9, 10, 11, 12]  # from the checkpoint of step 8, through the epoch boundary at 6·2
    assert resumed.state.global_step == 12
    assert_bit_equal(weights(resumed), weights(straight))  # data position, dropout RNG, optimizer, schedule
    assert_bit_equal(optimizer_tensors(resumed), optimizer_tensors(straight))
    assert resumed.lr_scheduler.get_last_lr() == straight.lr_scheduler.get_last_lr()
    losses = [[h.get("loss") for h in t.state.log_history[:-1]] for t in (resumed, straight)]
    assert losses[0] == losses[1]
    assert sorted(p.name for p in out.iterdir()) == ["tiered_ckpt"]  # no checkpoint-N folders
    with tc.Checkpointer(resumed.tiers_config) as ckpt:
        statuses = {s.step: s for s in ckpt.list()}
    assert {s: set(status.complete) for s, status in statuses.items()} == {  # the memory tier keeps 2
        4: {"disk"}, 8: {"host", "disk"}, 12: {"host", "disk"}}
    assert statuses[12].metadata["hf"]["global_step"] == 12


def test_resume_from_a_given_step_and_refusals(tmp_path, shm_dir):
    out = tmp_path / "run"
    first = trainer(out, shm_dir, steps=8)
    with pytest.raises(ValueError, match="No valid checkpoint found"):
        first.train(resume_from_checkpoint=True)
    first.train()
    again = trainer(out, shm_dir, steps=8)
    with pytest.raises(ValueError, match="newer checkpoints"):  # would save over checkpoint 8
        again.train(resume_from_checkpoint=4)
    steps = Steps()
    again = trainer(out, shm_dir, steps=8, callbacks=(steps,))
    again.train(resume_from_checkpoint=str(out / "checkpoint-8"))  # the Trainer's name for step 8
    assert steps.trained == [] and again.state.global_step == 8  # max_steps reached: no step more
    assert_bit_equal(weights(again), weights(first))
    with pytest.raises(ValueError, match="does not support save_only_model"):
        trainer(tmp_path / "other", shm_dir, save_only_model=True)


def test_a_changed_batch_size_is_refused_rather_than_training_on_other_data(tmp_path, shm_dir):
    out = tmp_path / "run"
    with pytest.raises(Crash):
        trainer(out, shm_dir, callbacks=(CrashAt(5),)).train()
    halved = trainer(out, shm_dir)
    halved.args.per_device_train_batch_size = 2
    halved._train_batch_size = 2
    with pytest.raises(ValueError, match=r"stopped 16 samples into epoch 0 .* skip to 8 samples into epoch 0"):
        halved.train(resume_from_checkpoint=True)
    accepted = trainer(out, shm_dir, ignore_data_skip=True)
    accepted.train(resume_from_checkpoint=True)
    assert accepted.state.global_step == 12


def test_save_total_limit_caps_keep_last_on_every_tier(tmp_path, shm_dir):
    t = trainer(tmp_path / "run", shm_dir, save_total_limit=2)
    assert [(c.name, c.keep_last) for c in t.tiers_config.tiers] == [("host", 2), ("disk", 2)]
    t.args.save_steps = 2
    t.train()
    with tc.Checkpointer(t.tiers_config) as ckpt:
        complete = {tier: [s.step for s in ckpt.list() if tier in s.complete] for tier in ("host", "disk")}
    assert complete == {"host": [10, 12], "disk": [10, 12]}
    config = run_config(tmp_path / "x", shm_root=shm_dir, memory_keep_last=1)
    assert [c.keep_last for c in cap_keep_last(config, 3).tiers] == [1, 3]  # a smaller keep_last stays


def test_a_run_begun_with_the_trainers_own_folders_resumes_from_them(tmp_path, shm_dir):
    straight = trainer(tmp_path / "straight", shm_dir)
    straight.train()
    out = tmp_path / "run"
    with pytest.raises(Crash):
        trainer(out, shm_dir, cls=Trainer, callbacks=(CrashAt(6),)).train()
    assert (out / "checkpoint-4").is_dir()
    steps = Steps()
    switched = trainer(out, shm_dir, callbacks=(steps,))
    assert switched.last_checkpoint() is None
    switched.train(resume_from_checkpoint=True)  # no tiered checkpoint: the Trainer's checkpoint-4 folder
    assert steps.trained[0] == 5
    assert_bit_equal(weights(switched), weights(straight))
    assert trainer(out, shm_dir).last_checkpoint() == 12  # later saves went to the tiers


def test_export_pretrained_writes_what_from_pretrained_reads(tmp_path, shm_dir):
    t = trainer(tmp_path / "run", shm_dir)
    t.train()
    assert t.export_pretrained(tmp_path / "at8", step=8) == 8
    at8 = GPT2LMHeadModel.from_pretrained(tmp_path / "at8")
    expected = trainer(tmp_path / "run", shm_dir).model
    with tc.Checkpointer(t.tiers_config) as ckpt:
        ckpt.load({"model": expected}, step=8)
    assert_bit_equal(at8.state_dict(), expected.state_dict())
    assert not torch.equal(at8.transformer.wte.weight, t.model.transformer.wte.weight)  # not step 12's

    fresh = GPT2LMHeadModel(at8.config)
    assert export_pretrained(fresh, tmp_path / "run" / "tiered_ckpt" / "tiers.toml", tmp_path / "newest") == 12
    assert_bit_equal(GPT2LMHeadModel.from_pretrained(tmp_path / "newest").state_dict(), weights(t))


def test_runs_are_keyed_by_their_output_directory(tmp_path, shm_dir):
    a, b = run_config(tmp_path / "a", shm_root=shm_dir), run_config(tmp_path / "b", shm_root=shm_dir)
    assert a.engine.job != b.engine.job and a.engine.index != b.engine.index
    assert a.tiers[0].options.path != b.tiers[0].options.path and str(a.tiers[0].options.path).startswith(str(shm_dir))
    assert run_config(tmp_path / "a" / ".." / "a", shm_root=shm_dir).engine.job == a.engine.job
    trainer(tmp_path / "a", shm_dir, steps=4).train()
    assert trainer(tmp_path / "b", shm_dir, steps=4).last_checkpoint() is None
    toml = tmp_path / "a" / "tiered_ckpt" / "tiers.toml"
    ls = subprocess.run([sys.executable, "-m", "tiered_ckpt.cli", "ls", "-c", str(toml)], capture_output=True,
                        text=True, timeout=120)
    assert ls.returncode == 0 and [line.split()[0] for line in ls.stdout.splitlines()
                                   if line.split() and line.split()[0].isdigit()] == ["4"], ls.stdout + ls.stderr


def test_a_save_that_fails_in_the_background_fails_the_run(tmp_path, shm_dir):
    full = stack(tmp_path, {"kind": "local", "capacity": "16KiB", "retries": 0}, job="full")
    t = trainer(tmp_path / "run", shm_dir, tiers=full)
    with pytest.raises(tc.SaveError, match="step 4 failed on 1 tier.*TierFull"):  # at the next save, or at the end
        t.train()


def test_save_on_sigterm_is_refused_since_the_trainer_never_asks_should_save(tmp_path, shm_dir):
    out = tmp_path / "run"
    with pytest.raises(ValueError, match="save_on_sigterm"):
        trainer(out, shm_dir, tiers=run_config(out, shm_root=shm_dir, save_on_sigterm=True))


def test_reserve_makes_the_buffers_after_the_first_step_at_the_size_every_save_has(tmp_path, shm_dir):
    """reserve=True reserves once the optimizer's state exists (after the first step): the buffers are made
    for exactly the bytes each save then writes, before the first save (at step 4), and the run's checkpoints
    load as without it."""
    steps = Steps()
    t = trainer(tmp_path / "run", shm_dir, steps=8, reserve=True, callbacks=(steps,))
    assert t.reservation is None
    t.train()
    r = t.reservation
    assert r is not None and r.made >= 1 and r.tier == "host" and r.host_bytes >= r.state_bytes
    with tc.Checkpointer(t.tiers_config) as ckpt:
        sizes = {s.step: s.nbytes for s in ckpt.list() if s.is_complete}
    assert sorted(sizes) == [4, 8] and set(sizes.values()) == {r.state_bytes}
    assert steps.trained == list(range(1, 9))


def test_resume_true_with_every_checkpoint_lost_follows_on_lost(tmp_path, shm_dir):
    """Every copy of the run's checkpoints is gone (the memory and the disk tier: nodes lost) while the index still
    lists them. resume_from_checkpoint=True takes what a load takes: by default CheckpointLost (a person decides);
    with on_lost = "fresh" the run trains from the start, unattended, and saves the lost steps again."""
    import shutil

    out = tmp_path / "run"
    first = trainer(out, shm_dir, steps=8)
    first.train()
    config = first.tiers_config
    for tier in config.tiers:
        shutil.rmtree(Path(tier.options.path) / config.engine.job)
    with pytest.raises(tc.CheckpointLost):
        trainer(out, shm_dir, steps=8).train(resume_from_checkpoint=True)
    steps = Steps()
    fresh = trainer(out, shm_dir, steps=8, callbacks=(steps,),
                    tiers=run_config(out, shm_root=shm_dir, part_size="64KiB", on_lost="fresh"))
    fresh.train(resume_from_checkpoint=True)
    assert steps.trained == list(range(1, 9))
    assert_bit_equal(weights(fresh), weights(first))
    assert fresh.last_checkpoint() == 8
