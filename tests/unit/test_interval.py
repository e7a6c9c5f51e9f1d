"""The checkpoint-interval advice (#30 item 6): the model's optimum (Young's formula where it applies, a brute
force over every interval where tiers make it multi-level), which tier each failure resumes from, the costs
measured from a real engine's save records, and `tiered-ckpt advise` on them."""
import asyncio
import json
import math
import statistics
import time

import pytest
import torch

import tiered_ckpt as tc
from tiered_ckpt.config import parse_config
from tiered_ckpt.interval import costs_from_events, plan_at, read_events, survivors

from .test_cli import write_config
from .test_cli_scripts import run_cli


def stack(*tiers: dict) -> tc.Config:
    return parse_config({"engine": {"job": "j"}, "tiers": list(tiers)})


HOST = {"name": "host", "kind": "memory", "path": "/dev/shm/unused"}
DISK = {"name": "disk", "kind": "local", "path": "/tmp/unused"}
RING = {"name": "peer", "kind": "redis", "urls": ["redis://a:6379", "redis://b:6379"]}
S3 = {"name": "s3", "kind": "s3", "bucket": "b"}


def test_one_tier_that_is_durable_at_once_gives_youngs_interval():
    costs = tc.SaveCosts(blocked_seconds=2.0, seconds_per_step=0.5, durable_seconds={"host": 0.0})
    advice = tc.advise(stack(HOST), costs, tc.FailureRates(interruptions_per_day=4))
    young = math.sqrt(2 * 2.0 / (4 / 86400)) / 0.5  # steps
    assert abs(advice.recommended.save_every_steps - young) <= 1, (advice.recommended, young)
    assert advice.recommended.resume_from == {"interruption": "host"}


def test_node_losses_resume_from_the_tiers_off_the_machine_and_slow_tiers_take_fewer_saves():
    config = stack(HOST, DISK, RING, S3)
    assert survivors(config) == {"interruption": ("host", "disk", "peer", "s3"), "node_loss": ("peer", "s3")}
    costs = tc.SaveCosts(0.3, 1.0, {"host": 0.5, "disk": 4.0, "peer": 6.0, "s3": 900.0})
    failures = tc.FailureRates(interruptions_per_day=3, node_losses_per_day=1, restart_seconds=300)
    advice = tc.advise(config, costs, failures, current_every_steps=50)
    rec = advice.recommended
    alive = survivors(config)
    # the optimum of the model over every whole interval up to a day
    brute = min(range(1, 86400), key=lambda s: plan_at(s, costs, failures, alive).lost_fraction)
    assert rec.lost_fraction <= plan_at(brute, costs, failures, alive).lost_fraction * (1 + 1e-12)
    assert rec.resume_from == {"interruption": "host", "node_loss": "peer"}
    seconds = rec.save_every_steps * costs.seconds_per_step
    assert rec.every["s3"] == math.ceil(900.0 / seconds) > 1 and rec.every["host"] == 1  # S3 cannot take every save
    assert advice.current is not None and advice.current.lost_fraction > rec.lost_fraction
    assert rec.restart_fraction == pytest.approx(4 / 86400 * 300)
    assert "save_every_steps = " in advice.summary() and "node losses (resume from peer)" in advice.summary()


def test_node_losses_with_only_node_local_tiers_are_refused_naming_the_fix():
    costs = tc.SaveCosts(0.3, 1.0, {"host": 0.5, "disk": 4.0})
    with pytest.raises(tc.ConfigError, match="no tier survives a node loss"):
        tc.advise(stack(HOST, DISK), costs, tc.FailureRates(node_losses_per_day=1))
    with pytest.raises(ValueError, match="give a failure rate"):
        tc.advise(stack(HOST, DISK), costs, tc.FailureRates())
    with pytest.raises(ValueError, match="names tiers the configuration lacks: \\['nvme'\\]"):
        tc.advise(stack(HOST), tc.SaveCosts(0.3, 1.0, {"nvme": 1.0}), tc.FailureRates(1))
    # S3 survives a node loss, but no save of it committed: its time to durable is unknown (it said "every step"
    # and an infinite loss before)
    with pytest.raises(ValueError, match="no time to durable is known .* node loss leaves \\(s3\\)"):
        tc.advise(stack(HOST, DISK, S3), costs, tc.FailureRates(node_losses_per_day=1))
    with pytest.raises(ValueError, match="current_every_steps"):
        tc.advise(stack(HOST, DISK), costs, tc.FailureRates(1), current_every_steps=-3)


def test_costs_come_from_a_real_engines_save_records_and_advise_reads_them(tmp_path, shm_dir, capsys):
    log = tmp_path / "events-{rank}.jsonl"
    config = write_config(tmp_path, shm_dir, extra=f'events_log = "{log}"\n')

    async def train():
        async with tc.Engine.from_toml(config) as engine:
            state = {"w": torch.zeros(200_000)}
            for step in range(1, 41):
                await asyncio.sleep(0.005)  # a training step
                state["w"] += 1
                if step % 10 == 0:
                    await (await engine.save(step, state)).wait()

    asyncio.run(train())
    records = read_events(tmp_path / "events-0.jsonl")
    costs = costs_from_events(records)
    assert costs.saves == 4 and costs.save_every_steps == 10
    assert set(costs.durable_seconds) == {"host", "disk"}
    assert 0 < costs.blocked_seconds <= min(costs.durable_seconds.values())
    assert costs.seconds_per_step >= 0.005 * 0.9  # at least the sleep (sleep never ends early)

    status, out, err = run_cli(capsys, "-c", str(config), "advise", "--interruptions-per-day", "2", "--json")
    assert status == 0, err
    advice = json.loads(out)
    assert advice["current"]["save_every_steps"] == 10 and advice["costs"]["saves"] == 4
    fastest = min(advice["costs"]["durable_seconds"].items(), key=lambda kv: kv[1])[0]  # both take every save
    assert advice["recommended"]["resume_from"] == {"interruption": fastest}
    assert advice["recommended"]["lost_fraction"] <= advice["current"]["lost_fraction"]

    status, out, err = run_cli(capsys, "-c", str(config), "advise", "--interruptions-per-day", "2",
                               "--blocked", "30", "--every-steps", "1000")  # a slow save: save less often than now
    assert status == 0, err
    assert "now: save_every_steps = 1000" in out and "recommended: save_every_steps = " in out


def test_advise_without_records_or_with_a_broken_line_says_what_to_do(tmp_path, shm_dir, capsys):
    config = write_config(tmp_path, shm_dir)
    status, _, err = run_cli(capsys, "-c", str(config), "advise", "--interruptions-per-day", "1")
    assert status == 2 and "events_log" in err and "--durable TIER=SECONDS" in err
    status, out, err = run_cli(capsys, "-c", str(config), "advise", "--interruptions-per-day", "1", "--blocked", "1",
                               "--step-seconds", "0.5", "--durable", "host=0.2", "--durable", "disk=3")
    assert status == 0 and "recommended: save_every_steps" in out, err
    broken = tmp_path / "broken.jsonl"
    broken.write_text('{"event": "save"}\nnot json\n')
    status, _, err = run_cli(capsys, "-c", str(config), "advise", "--interruptions-per-day", "1", "--events",
                             str(broken))
    assert status == 2 and f"{broken}: line 2 is not JSON" in err
    broken.write_text('{"event": "save", "rank": 0, "step": null, "blocked_seconds": 1, "time": 1}\n' * 3)
    status, _, err = run_cli(capsys, "-c", str(config), "advise", "--interruptions-per-day", "1", "--events",
                             str(broken))
    assert status == 2 and "a save record that cannot be read" in err  # a TypeError traceback before
    for tiers in ("[1]", '{"disk": 5}', '{"disk": null}'):  # tiers that are no map of tier records
        broken.write_text("".join(f'{{"event": "save", "rank": 0, "step": {s}, "blocked_seconds": 1, "time": {s}, '
                                  f'"tiers": {tiers}}}\n' for s in (1, 2, 3)))
        status, _, err = run_cli(capsys, "-c", str(config), "advise", "--interruptions-per-day", "1", "--events",
                                 str(broken))
        assert status == 2 and "a save record whose tiers cannot be read" in err, (tiers, err)  # tracebacks before
    status, _, err = run_cli(capsys, "-c", str(config), "advise", "--interruptions-per-day", "1", "--every-steps",
                             "-5", "--blocked", "1", "--step-seconds", "1", "--durable", "host=1")
    assert status == 2 and "--every-steps" in err


def test_a_lazy_saves_pause_counts_the_loops_wait_in_staged(tmp_path, shm_dir):
    """What the training loop waits for a lazy save is save() plus staged() (the demo's "training paused"), not
    save() alone: the record's paused_seconds says it and advise counts it (before: save()'s own 5 ms against
    the demo's 33-42 ms, an interval ~2.6x too short)."""
    log = tmp_path / "events.jsonl"
    config = tmp_path / "c.toml"  # large parts: save() plans a few, and the copy is most of the pause
    config.write_text(f'[engine]\njob = "j"\nindex = "file://{tmp_path}/index"\npart_size = "16MiB"\n'
                      f'events_log = "{log}"\n[[tiers]]\nname = "host"\nkind = "memory"\npath = "{shm_dir}/host"\n'
                      f'[[tiers]]\nname = "disk"\nkind = "local"\npath = "{tmp_path}/disk"\n')
    waits: dict[int, float] = {}  # step -> what the loop waited: save() + staged()

    async def train():
        async with tc.Engine.from_toml(config) as engine:
            state = {"w": torch.zeros(48 * 2**20 // 4)}  # 48 MiB: a copy of milliseconds
            for step in range(1, 7):
                state["w"] += 1
                t = time.perf_counter()
                handle = await engine.save(step, state, lazy=True)
                if step == 6:  # the copy is done before the loop asks: it waits for save() alone
                    await handle.copy_ended()
                await handle.staged()  # else at once, as a loop whose forward pass is shorter than the copy
                waits[step] = time.perf_counter() - t
                await handle.wait()

    asyncio.run(train())
    records = [r for r in read_events(log) if r["event"] == "save"]
    costs = costs_from_events(r for r in records if r["step"] <= 5)
    saves = {r["step"]: r for r in records}
    # advise counts the whole pause (the first save left out), not save() alone: no timing compared across clocks
    assert costs.blocked_seconds == statistics.median(saves[s]["paused_seconds"] for s in range(2, 6)), costs
    assert costs.blocked_seconds > statistics.median(saves[s]["blocked_seconds"] for s in range(2, 6)), costs
    for step in range(1, 6):
        r = saves[step]
        assert r["paused_seconds"] > r["blocked_seconds"], r  # the copy ran after save() returned
        assert r["paused_seconds"] <= waits[step] + 1e-6, (r, waits[step])
        assert r["paused_seconds"] >= r["staged_seconds"] - 0.005, r  # waited from save() to the copy's end
    assert saves[6]["paused_seconds"] == saves[6]["blocked_seconds"]


def test_advise_reads_only_its_own_jobs_records_from_a_shared_log(tmp_path, shm_dir, capsys):
    """Two jobs writing one events_log: a job's advice comes from its own saves (before: every rank-0 record in
    the file, the other job's saves and intervals mixed in)."""
    log = tmp_path / "events.jsonl"
    config = write_config(tmp_path, shm_dir, extra=f'events_log = "{log}"\n')

    async def train(job: str, every: int, steps: int):
        async with tc.Engine.from_toml(config, job=job) as engine:
            state = {"w": torch.zeros(50_000)}
            for step in range(every, steps + 1, every):
                state["w"] += 1
                await (await engine.save(step, state)).wait()

    asyncio.run(train("cli", 10, 40))  # write_config's job: 4 saves, every 10 steps
    asyncio.run(train("other", 3, 30))  # 10 saves, every 3 steps
    status, out, err = run_cli(capsys, "-c", str(config), "advise", "--interruptions-per-day", "2", "--json")
    assert status == 0, err
    advice = json.loads(out)
    assert advice["costs"]["saves"] == 4 and advice["costs"]["save_every_steps"] == 10
    assert advice["current"]["save_every_steps"] == 10
    status, out, err = run_cli(capsys, "-c", str(config), "--job", "other", "advise", "--interruptions-per-day", "2",
                               "--json")
    assert status == 0, err
    assert json.loads(out)["costs"]["saves"] == 10 and json.loads(out)["costs"]["save_every_steps"] == 3
    status, _, err = run_cli(capsys, "-c", str(config), "--job", "none", "advise", "--interruptions-per-day", "2")
    assert status == 2 and "of job 'none'" in err, err
    records = read_events(log)
    assert {r["job"] for r in records if r["event"] == "save"} == {"cli", "other"}
    costs = costs_from_events(records, job="cli")
    assert costs.saves == 4 and costs.save_every_steps == 10
