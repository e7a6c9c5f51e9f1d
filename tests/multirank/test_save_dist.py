"""Multi-rank saves on real processes: balanced plans, cached plans without collectives, shared failures,
no deadlock with the training loop's own collectives."""
from __future__ import annotations

import asyncio
import os

import pytest
import torch
import torch.distributed as dist

import tiered_ckpt as tc
from tiered_ckpt.testing.configs import faults

from .common import config
from .spawn import run_ranks

pytestmark = pytest.mark.timeout(300)  # real processes (gloo, torchrun): slower than unit tests


def replicated_state(seed: float) -> dict[str, torch.Tensor]:
    """Mixed sizes, identical on every rank (a DP replica's view of the model)."""
    sizes = [300_000, 120_000, 50_000, 50_000, 20_000, 7_000, 3_000, 1_000, 400, 10]
    return {f"layer{i}": torch.full((n,), seed + i) for i, n in enumerate(sizes)}


async def _balanced(rank: int, world: int, root: str) -> dict:
    async with tc.Engine(config(root)) as engine:
        h = await engine.save(1, replicated_state(1.0))
        await h.wait()
        collectives_after_first = engine.coordinator.collectives
        await (await engine.save(2, replicated_state(2.0))).wait()  # same structure: cache hit
        hit_collectives = engine.coordinator.collectives - collectives_after_first
        await (await engine.save(3, {**replicated_state(3.0), "extra": torch.ones(5)})).wait()  # miss
        miss_collectives = engine.coordinator.collectives - collectives_after_first - hit_collectives
        loaded, read, received = {}, {}, {}
        for step in (1, 2):
            out = {k: torch.zeros_like(v) for k, v in replicated_state(0.0).items()}
            info = await engine.load(out, step=step)
            loaded[step] = all(torch.equal(out[k], v) for k, v in replicated_state(float(step)).items())
            read[step], received[step] = sum(info.bytes_by_tier.values()), info.bytes_received
            assert info.step == step
        manifest = await engine.read_manifest(1)  # what each rank wrote of step 1, as the plan laid it out
        plan = engine.planner.last  # step 3's: the world's chunks on rank 0 alone, each rank its own boxes
        held = {"world": None if plan.tensors is None else len(plan.tensors.rank), "lengths": plan.rank_nbytes,
                "own": len(plan.local), "nbytes": plan.nbytes, "total": plan.total_nbytes,
                "mine": None if plan.tensors is None else [int((plan.tensors.rank == r).sum()) for r in range(world)],
                "streams": None if plan.tensors is None else list(plan.rank_nbytes)}
        return {"rank_nbytes": [r.nbytes for r in manifest.ranks], "hit": hit_collectives, "miss": miss_collectives,
                "held": held,
                "loaded": loaded, "misses": engine.planner.misses, "read": read, "received": received,
                "size": manifest.nbytes}


def test_replicated_state_is_written_once_and_balanced_at_dp4(tmp_path):
    results = run_ranks(_balanced, 4, str(tmp_path))
    per_rank = results[0]["rank_nbytes"]
    assert all(r["rank_nbytes"] == per_rank for r in results)  # every rank computed the same plan
    total = sum(per_rank)
    unique = sum(t.numel() * 4 for t in replicated_state(0).values())
    assert total < unique * 1.01  # written once, not 4 times (alignment padding only)
    assert max(per_rank) / (total / 4) <= 1.1, per_rank
    for r in results:
        assert r["hit"] == 0, "a cached plan must not run a collective"
        assert r["miss"] == 3 and r["misses"] == 2  # rank 0's digest, the gather to it, the scatter from it
        assert r["loaded"] == {1: True, 2: True}  # the cached plan never repeats older data
    coordinator = results[0]["held"]
    assert coordinator["world"] == sum(coordinator["mine"]) and coordinator["world"] >= 11
    for rank, r in enumerate(results):  # no rank but 0 holds the world's chunks or stream lengths
        if rank:
            assert r["held"]["world"] is None and r["held"]["lengths"] is None and r["held"]["streams"] is None
        assert r["held"]["own"] == coordinator["mine"][rank]  # its own boxes, all of them
        assert r["held"]["nbytes"] == coordinator["streams"][rank]
        assert r["held"]["total"] == sum(coordinator["streams"])
    for step in (1, 2):  # broadcast loading: the checkpoint is read from storage once, not once per replica
        assert sum(r["read"][step] for r in results) == results[0]["size"]
        assert all(r["received"][step] > 0 for r in results)


async def _staging_fails_on_rank_1(rank: int, world: int, root: str) -> dict:
    import tiered_ckpt.save.job as saving

    async with tc.Engine(config(root, commit_timeout=60)) as engine:
        await (await engine.save(1, replicated_state(1.0))).wait()
        if rank == 1:
            def broken(*args):
                raise RuntimeError("device lost during copy")
            saving.stage = broken
        try:
            handle = await engine.save(2, replicated_state(2.0))
        except RuntimeError as e:
            own = str(e)
            handle = None
        else:
            own = None
        error = None
        if handle is not None:
            try:
                await handle.wait()
            except tc.SaveError as e:
                error = {t: str(err) for t, err in e.errors.items()}
        await engine.wait_all()  # rank 1: its failure reports are written before it lists
        statuses = [(c.step, sorted(c.complete)) async for c in engine.list()]
        await asyncio.to_thread(dist.barrier)  # every rank lists before any rank loads
        out = {k: torch.zeros_like(v) for k, v in replicated_state(0.0).items()}
        info = await engine.load(out)
        leftovers = [c.step async for c in engine.list()]
        await engine.close(raise_errors=False)
        return {"own": own, "error": error, "statuses": statuses, "loaded_step": info.step, "after": leftovers}


def test_a_rank_failing_to_stage_fails_the_save_on_every_rank(tmp_path):
    results = run_ranks(_staging_fails_on_rank_1, 2, str(tmp_path))
    assert results[1]["own"] == "device lost during copy"
    errors = results[0]["error"]
    assert set(errors) == {"host", "disk"}
    assert all("rank 1" in msg and "device lost during copy" in msg for msg in errors.values())
    for r in results:
        assert dict(r["statuses"]).get(2) == [], results  # nothing committed
        # a load changes nothing in the index: the failed attempt stays listed (incomplete) until the writer's
        # retention or the next writer's opening removes it
        assert r["loaded_step"] == 1 and r["after"] == [1, 2]


async def _killed(rank: int, world: int, root: str) -> dict:
    # opened, never closed: close() would wait for collectives with the dead peer; the process just ends
    engine = await tc.Engine(config(root, commit_timeout=3)).open()
    await (await engine.save(1, replicated_state(1.0))).wait()
    handle = await engine.save(2, replicated_state(2.0))
    if rank == 1:
        os._exit(17)  # killed before its parts are durable anywhere
    with pytest.raises(tc.SaveError) as err:
        await handle.wait()
    messages = {t: str(e) for t, e in err.value.errors.items()}
    statuses = dict([(c.step, sorted(c.complete)) async for c in engine.list()])
    return {"messages": messages, "statuses": statuses}


def test_a_killed_rank_times_out_with_a_clear_error_and_commits_nothing(tmp_path):
    results = run_ranks(_killed, 2, str(tmp_path), may_die=frozenset({1}), timeout=120)
    messages = results[0]["messages"]
    assert all("ranks [1] never reported" in m for m in messages.values()), messages
    assert results[0]["statuses"][2] == [] and results[0]["statuses"][1] == ["disk", "host"]


async def _train_while_saving(rank: int, world: int, root: str) -> dict[int, bool]:
    torch.manual_seed(0)
    model = torch.nn.Linear(256, 256)
    async with tc.Engine(config(root)) as engine:
        handles, expected = [], {}
        for step in range(1, 13):
            for p in model.parameters():  # the training loop's own collectives, on the default group
                grad = torch.ones_like(p) * (rank + 1)
                dist.all_reduce(grad)
                with torch.no_grad():
                    p.sub_(grad * 1e-3)
            if step % 2 == 0:
                expected[step] = [p.detach().clone() for p in model.parameters()]
                handles.append(await engine.save(step, {"model": model}, lazy=True))
                await handles[-1].staged()
        for h in handles:
            await h.wait()
        exact = {}
        for step, params in expected.items():  # every checkpoint holds the parameters of its own step
            fresh = torch.nn.Linear(256, 256)
            await engine.load({"model": fresh}, step=step)
            exact[step] = all(torch.equal(a, b) for a, b in zip(fresh.parameters(), params))
        return exact


def test_training_collectives_while_saves_persist_do_not_deadlock(tmp_path):
    results = run_ranks(_train_while_saving, 2, str(tmp_path), timeout=120)
    assert results == [{step: True for step in range(2, 13, 2)}] * 2


async def _burst_with_one_slow_rank(rank: int, world: int, root: str) -> dict:
    cfg = config(root, commit_timeout=60.0, disk="faulty")  # rank 1's disk stalled (the test injected it)
    async with tc.Engine(cfg) as engine:
        handles = [await engine.save(step, replicated_state(float(step))) for step in range(1, 13)]
        if rank == 1:
            faults(cfg).clear()
        for h in handles:
            await h.wait()  # a skip on one rank is a skip on every rank, never a RankFailed or a timeout
        complete = {c.step: sorted(c.complete) async for c in engine.list()}
        out = {k: torch.zeros_like(v) for k, v in replicated_state(0.0).items()}
        info = await engine.load(out, tiers=["disk"])
        return {"skipped": {h.step: h.skipped.get("disk") for h in handles}, "complete": complete,
                "loaded": (info.step, all(torch.equal(out[k], v) for k, v in replicated_state(12.0).items()))}


def test_a_tier_skipping_saves_on_one_rank_skips_them_on_every_rank(tmp_path):
    # only rank 1's disk falls behind (it writes nothing during the burst): only it decides to skip
    faults(config(str(tmp_path), disk="faulty")).inject("stall", ranks=[1])
    results = run_ranks(_burst_with_one_slow_rank, 2, str(tmp_path))
    assert results[0]["skipped"] == results[1]["skipped"]
    skipped = {step for step, newer in results[0]["skipped"].items() if newer is not None}
    assert skipped, "the slow rank never fell behind: the test proves nothing"
    assert all("disk" not in results[0]["complete"].get(step, []) for step in skipped)
    assert results[0]["complete"][12] == ["disk", "host"] and results[0]["loaded"] == (12, True)


async def _reserve_then_save(rank: int, world: int, root: str) -> dict:
    async with tc.Engine(config(root)) as engine:
        reserved = await engine.reserve(replicated_state(0.0))
        made = {id(b) for b in engine.pool.free}
        for step in (1, 2):
            await (await engine.save(step, replicated_state(float(step)))).wait()
        mine = {id(b) for b in (*engine.pool.free, *engine.pool.retained.values())}
        return {"host": reserved.host_bytes, "machine": reserved.machine_bytes, "made": reserved.made,
                "own": mine <= made}


def test_reserve_counts_every_rank_of_the_machine_and_the_saves_use_its_buffers(tmp_path):
    results = run_ranks(_reserve_then_save, 2, str(tmp_path))
    assert all(r["own"] and r["made"] > 0 for r in results), results
    assert all(r["machine"] == sum(x["host"] for x in results) for r in results), results  # one machine here


async def _under_a_host_budget(rank: int, world: int, root: str) -> dict:
    # two ranks on one machine share 12 MiB: the memory tier's keep_last 8 must give way, alike on both ranks
    async with tc.Engine(config(root, host_memory="12MiB")) as engine:
        reserved = await engine.reserve(replicated_state(0.0))
        for step in range(1, 8):
            await (await engine.save(step, replicated_state(float(step)))).wait()
        await engine.wait_all()  # this rank's retention passes are over (rank 0's unmark the index's records)
        await asyncio.to_thread(dist.barrier)  # and every rank's: seen once, rank 1 listed before rank 0's last pass
        in_memory = [s.step for s in await engine.statuses() if "host" in s.complete]
        return {"keep_last": reserved.keep_last, "in_memory": in_memory, "budget": reserved.budget}


def test_ranks_of_one_machine_share_the_host_budget_and_agree_on_what_it_keeps(tmp_path):
    results = run_ranks(_under_a_host_budget, 2, str(tmp_path))
    assert results[0] == results[1], results
    keep = results[0]["keep_last"]["host"]
    assert 1 <= keep < 8 and results[0]["budget"] == 12 * 2**20
    assert results[0]["in_memory"] == list(range(8 - keep, 8))


async def _asks_for_a_step_of_its_own(rank: int, world: int, root: str) -> dict:
    async with tc.Engine(config(root)) as engine:
        for step in (1, 2):
            await (await engine.save(step, replicated_state(float(step)))).wait()
        out = {k: torch.zeros_like(v) for k, v in replicated_state(0.0).items()}
        try:
            await engine.load(out, step=1 + rank)
        except ValueError as e:
            return {"error": str(e), "untouched": all(bool(torch.all(v == 0)) for v in out.values())}
        return {"error": None}


def test_ranks_that_ask_for_different_steps_all_get_an_error(tmp_path):
    """Rank 0's arguments used to win silently: rank 1, asking for step 2, got step 1's tensors."""
    for r in run_ranks(_asks_for_a_step_of_its_own, 2, str(tmp_path)):
        assert r["error"] and "rank 0: step=1" in r["error"] and "rank 1: step=2" in r["error"], r
        assert r["untouched"]
