"""Observability (issue #31, item 6): every save, tier, load and removal as a typed record through on_event, as
one JSON line (the `tiered_ckpt.events` logger and `[engine] events_log`), and as Prometheus metrics scraped
over real HTTP from the port the engine serves."""
import asyncio
import json
import logging
import socket
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import torch

import tiered_ckpt as tc
from tiered_ckpt.config import parse_config

from .common import load_values, state_of, wait_until

STATE_BYTES = 50_000 * 4 + 7 * 3 * 8  # state_of's tensors: what each tier holds of a save (one rank)


def saves(records):
    return [r for r in records if isinstance(r, tc.SaveEvent)]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def test_a_save_and_a_load_each_give_a_typed_record_through_on_event(make_config):
    records: list = []
    async with tc.Engine(make_config(), on_event=records.append) as engine:
        handle = await engine.save(1, state_of(1.0))
        await handle.wait()
        await wait_until(lambda: saves(records), what="the save's record")
        tiers = [r for r in records if isinstance(r, tc.TierEvent)]
        assert [(t.step, t.tier, t.outcome) for t in tiers] in (
            [(1, "host", "committed"), (1, "disk", "committed")], [(1, "disk", "committed"), (1, "host", "committed")])
        [save] = saves(records)
        assert records.index(save) == len(records) - 1  # after its tiers
        assert (save.job, save.rank, save.step) == ("test", 0, 1)
        assert save.blocked_seconds > 0 and save.staged_seconds > 0
        assert [t.tier for t in save.tiers] == ["host", "disk"] and save.committed == ("host", "disk") and save.ok
        assert all(t.nbytes == save.nbytes >= STATE_BYTES and t.seconds > 0 and t.error is None for t in save.tiers)
        assert {t.tier: t.seconds for t in save.tiers} == handle.durable_at

        info, out = await load_values(engine)
        [load] = [r for r in records if isinstance(r, tc.LoadEvent)]
        assert (load.step, load.tier, load.error, load.fallbacks) == (1, "host", None, 0)
        assert load.nbytes_by_tier == info.bytes_by_tier and load.nbytes >= STATE_BYTES and load.seconds > 0
        assert load.tiers == ("host",) and torch.all(out["w"] == 1.0)

        await load_values(engine, tiers=["disk"])
        assert records[-1].tier == "disk" and records[-1].nbytes_by_tier.keys() == {"disk"}


async def test_a_failed_tier_a_fallback_a_failed_load_and_a_removal_are_recorded(make_config, tmp_path):
    records: list = []
    # host too small for a save (TierFull) with its own copy; keep_last = 1 on disk: save 2 retires save 1 there
    config = make_config(tiers=[{"capacity": "100KiB"}, {"keep_last": 1}], stage_in_memory_tier=False)
    async with tc.Engine(config) as engine:
        stop = engine.on_event(records.append)
        with pytest.raises(tc.IncompleteCheckpoint):
            await engine.load(state_of(0.0))
        [failed_load] = records
        assert isinstance(failed_load, tc.LoadEvent) and failed_load.error.startswith("IncompleteCheckpoint: ")
        assert failed_load.step is None and failed_load.nbytes_by_tier == {}

        for step in (1, 2):
            handle = await engine.save(step, state_of(float(step)))
            await handle.wait()  # complete on disk: no error, the handle names the failed tier
            assert list(handle.errors) == ["host"]
        await wait_until(lambda: len(saves(records)) == 2, what="both saves' records")
        save = saves(records)[1]
        assert not save.ok and save.committed == ("disk",)
        host = save.tiers[0]
        assert (host.tier, host.outcome, host.nbytes, host.seconds) == ("host", "failed", 0, None)
        assert host.error.startswith("TierFull: ")
        removals = [r for r in records if isinstance(r, tc.RemovalEvent)]
        assert [(r.step, r.tier) for r in removals] == [(1, "disk")]

        stop()
        await (await engine.save(3, {"w": torch.ones(10)})).wait()
        assert not [r for r in records if getattr(r, "step", None) == 3]  # no longer subscribed


async def test_a_part_read_from_a_slower_tier_counts_as_a_fallback(engine):
    records: list = []
    engine.on_event(records.append)
    await (await engine.save(1, state_of(1.0))).wait()
    part = sorted(p for p in Path(engine.store.io.driver("host").root).rglob("part-*") if "step-000000000001" in str(p))[0]
    data = bytearray(part.read_bytes())
    data[100] ^= 0x01
    part.write_bytes(bytes(data))
    info, _ = await load_values(engine)
    load = records[-1]
    assert load.fallbacks == len(info.fallbacks) >= 1 and load.nbytes_by_tier.get("disk", 0) > 0


async def test_a_callback_that_raises_is_logged_and_the_save_goes_on(make_config, caplog):
    seen: list = []

    def broken(record):
        seen.append(record)
        raise RuntimeError("boom")

    async with tc.Engine(make_config(), on_event=broken) as engine:
        await (await engine.save(1, state_of(1.0))).wait()
        await wait_until(lambda: saves(seen), what="the save's record")
        await load_values(engine)
    assert [c.step for c in await _statuses(make_config())] == [1]
    messages = [r for r in caplog.records if "on_event callback raised" in r.getMessage()]
    assert len(messages) == len(seen) == 4 and "boom" in messages[0].exc_text  # host, disk, save, load


async def _statuses(config):
    async with tc.Engine(config) as engine:
        return [s async for s in engine.list() if s.is_complete]


async def test_each_save_and_load_is_one_json_line_in_events_log_and_on_the_logger(make_config, tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="tiered_ckpt.events")
    async with tc.Engine(make_config(events_log=str(tmp_path / "logs" / "events-{rank}.jsonl"))) as engine:
        await (await engine.save(7, state_of(7.0))).wait()
        await wait_until(lambda: any('"event":"save"' in r.getMessage() for r in caplog.records), what="save line")
        await load_values(engine)
    lines = (tmp_path / "logs" / "events-0.jsonl").read_text().splitlines()
    records = [json.loads(line) for line in lines]
    assert [r["event"] for r in records].count("tier") == 2 and [r["event"] for r in records][-2:] == ["save", "load"]
    save, load = records[-2:]
    assert save["job"] == "test" and save["rank"] == 0 and save["step"] == 7 and save["time"] > 0
    assert save["blocked_seconds"] > 0 and save["staged_seconds"] > 0 and save["nbytes"] >= STATE_BYTES
    assert save["paused_seconds"] == save["blocked_seconds"]  # a plain save: the copy is inside save()
    assert list(save["tiers"]) == ["host", "disk"] and set(save) == {
        "event", "job", "rank", "step", "blocked_seconds", "staged_seconds", "nbytes", "tiers", "paused_seconds",
        "time"}
    assert set(save["tiers"]["host"]) == {"outcome", "seconds", "nbytes", "error", "superseded_by"}
    assert all(t["outcome"] == "committed" and t["seconds"] > 0 and t["nbytes"] == save["nbytes"] and
               t["error"] is None for t in save["tiers"].values())
    assert load["step"] == 7 and load["tier"] == "host" and load["nbytes_by_tier"]["host"] >= STATE_BYTES
    assert load["seconds"] > 0 and load["fallbacks"] == 0 and load["error"] is None
    logged = [json.loads(r.getMessage()) for r in caplog.records if r.name == "tiered_ckpt.events"]
    assert logged == records  # the logger carries the same records, one JSON object per message


async def test_an_events_log_that_cannot_be_written_names_the_key(make_config, tmp_path):
    (tmp_path / "taken").mkdir()
    engine = tc.Engine(make_config(events_log=str(tmp_path / "taken")))
    with pytest.raises(tc.ConfigError) as err:
        await engine.open()
    assert err.value.key == "engine.events_log"
    with pytest.raises(RuntimeError, match="engine is closed"):  # the failed open() closed what it had opened
        await engine.save(1, {"w": torch.ones(1)})
    await engine.close()  # and closing again is harmless


def scrape(port: int) -> dict[tuple[str, tuple], float]:
    """GET /metrics over HTTP and parse the text format: (sample name, sorted labels) → value."""
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
        text = response.read().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def sample(metrics, name, **labels) -> float:
    return metrics[(name, tuple(sorted({"job_name": "test", **labels}.items())))]


async def test_metrics_port_serves_prometheus_metrics_of_real_saves_and_loads(make_config):
    pytest.importorskip("prometheus_client")
    port = free_port()
    async with tc.Engine(make_config(metrics_port=port, metrics_addr="127.0.0.1")) as engine:
        handle = await engine.save(1, state_of(1.0))
        await handle.wait()
        await (await engine.save(2, state_of(2.0))).wait()
        await wait_until(lambda: engine.saves_in_flight == 0)
        info, _ = await load_values(engine)
        m = await asyncio.to_thread(scrape, port)
        assert sample(m, "tiered_ckpt_save_blocked_seconds_count") == 2
        assert sample(m, "tiered_ckpt_save_blocked_seconds_sum") > 0
        assert sample(m, "tiered_ckpt_save_blocked_seconds_bucket", le="+Inf") == 2
        assert sample(m, "tiered_ckpt_save_staged_seconds_count") == 2
        assert sample(m, "tiered_ckpt_save_paused_seconds_count") == 2
        for tier in ("host", "disk"):
            assert sample(m, "tiered_ckpt_save_durable_seconds_count", tier=tier) == 2
            assert sample(m, "tiered_ckpt_save_durable_seconds_sum", tier=tier) > 0
            assert sample(m, "tiered_ckpt_saves_total", tier=tier, outcome="committed") == 2
            assert sample(m, "tiered_ckpt_save_bytes_total", tier=tier) == 2 * handle.nbytes >= 2 * STATE_BYTES
            assert sample(m, "tiered_ckpt_last_committed_step", tier=tier) == 2
        assert ("tiered_ckpt_saves_total", (("job_name", "test"), ("outcome", "failed"), ("tier", "host"))) not in m
        assert sample(m, "tiered_ckpt_loads_total", outcome="ok") == 1
        assert sample(m, "tiered_ckpt_load_bytes_total", tier="host") == info.bytes_by_tier["host"] > 0
        assert sample(m, "tiered_ckpt_load_seconds_count") == 1 and sample(m, "tiered_ckpt_load_seconds_sum") > 0
        assert sample(m, "tiered_ckpt_load_fallbacks_total") == 0
        assert sample(m, "tiered_ckpt_last_loaded_step") == 2
        assert sample(m, "tiered_ckpt_saves_in_flight") == 0
    with pytest.raises(urllib.error.URLError):  # close() stopped the server
        await asyncio.to_thread(scrape, port)


async def test_serve_gives_each_engine_its_own_registry_and_counts_failures_and_removals(make_config, tmp_path):
    pytest.importorskip("prometheus_client")
    from tiered_ckpt import metrics

    config = make_config(tiers=[{"capacity": "100KiB"}, {"keep_last": 1}], stage_in_memory_tier=False)
    other = parse_config({"engine": {"job": "other", "index": f"file://{tmp_path}/index2"},
                          "tiers": [{"name": "disk", "kind": "local", "path": str(tmp_path / "disk2")}]})
    async with tc.Engine(config) as engine, tc.Engine(other) as quiet:
        served, served_quiet = metrics.serve(engine, 0, "127.0.0.1"), metrics.serve(quiet, 0, "127.0.0.1")
        try:
            with pytest.raises(tc.IncompleteCheckpoint):
                await engine.load(state_of(0.0))
            for step in (1, 2):
                handle = await engine.save(step, state_of(1.0))
                await handle.wait()  # complete on disk
                assert list(handle.errors) == ["host"]
            await wait_until(lambda: engine.saves_in_flight == 0)
            m = await asyncio.to_thread(scrape, served.port)
            assert sample(m, "tiered_ckpt_saves_total", tier="host", outcome="failed") == 2
            assert sample(m, "tiered_ckpt_saves_total", tier="disk", outcome="committed") == 2
            assert sample(m, "tiered_ckpt_removals_total", tier="disk") == 1
            assert sample(m, "tiered_ckpt_loads_total", outcome="failed") == 1
            q = await asyncio.to_thread(scrape, served_quiet.port)
            assert not [k for k in q if k[0].startswith("tiered_ckpt_save") and q[k]]  # nothing of the other engine
        finally:
            served.close()
            served_quiet.close()


async def test_a_taken_metrics_port_is_logged_and_the_engine_works_without_metrics(make_config, caplog):
    pytest.importorskip("prometheus_client")
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        async with tc.Engine(make_config(metrics_port=port, metrics_addr="127.0.0.1")) as engine:
            await (await engine.save(1, state_of(1.0))).wait()
            assert engine.metrics_server is None
    assert any("metrics are not served" in r.getMessage() and str(port) in r.getMessage() for r in caplog.records)


async def test_a_full_disk_under_events_log_neither_fails_close_nor_leaves_the_metrics_port_open(make_config,
                                                                                                  caplog):
    """/dev/full takes the open and refuses every byte (ENOSPC), as a full disk does: the records are lost and
    logged, close() returns, and the metrics server is stopped (before: close() raised the OSError of the file's
    last flush and the port stayed open)."""
    pytest.importorskip("prometheus_client")
    port = free_port()
    engine = tc.Engine(make_config(events_log="/dev/full", metrics_port=port, metrics_addr="127.0.0.1"))
    async with engine:
        await (await engine.save(1, state_of(1.0))).wait()
        await wait_until(lambda: engine.saves_in_flight == 0)
        assert await asyncio.to_thread(scrape, port)  # served
    with pytest.raises(urllib.error.URLError):  # close() stopped the server
        await asyncio.to_thread(scrape, port)
    with socket.socket() as s:  # and nothing listens on the port any more (the scrape's TIME_WAIT allowed)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind(("127.0.0.1", port))
    messages = [r.getMessage() for r in caplog.records]
    assert any("events_log /dev/full" in m and "No space left" in m for m in messages), messages


@pytest.mark.parametrize("local_rank", ["1", "rank-one"])
async def test_a_metrics_port_past_65535_with_local_rank_is_logged_and_training_goes_on(make_config, caplog,
                                                                                       monkeypatch, local_rank):
    """metrics_port 65535 on LOCAL_RANK 1 is port 65536 (before: an OverflowError from bind() failed open() on
    rank 1); a LOCAL_RANK that is no number likewise (before: a ValueError). Both cost the metrics, as a taken
    port does, never the training."""
    pytest.importorskip("prometheus_client")
    monkeypatch.setenv("LOCAL_RANK", local_rank)
    async with tc.Engine(make_config(metrics_port=65535, metrics_addr="127.0.0.1")) as engine:
        await (await engine.save(1, state_of(1.0))).wait()
        assert engine.metrics_server is None
    messages = [r.getMessage() for r in caplog.records if "metrics are not served" in r.getMessage()]
    assert messages and ("port 65536, above 65535" in messages[0] if local_rank == "1"
                         else "LOCAL_RANK='rank-one'" in messages[0]), messages


def test_metrics_without_prometheus_client_name_the_extra(make_config, monkeypatch):
    import importlib.util
    import sys

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "prometheus_client"
                        else real(name, *a))
    with pytest.raises(tc.ConfigError, match=r"\.\[prometheus\]") as err:
        make_config(metrics_port=9400)
    assert err.value.key == "engine.metrics_port"
    make_config(metrics_port=0)  # off: no package needed

    monkeypatch.setitem(sys.modules, "prometheus_client", None)  # `import prometheus_client` fails
    from tiered_ckpt.metrics import EngineMetrics

    with pytest.raises(ImportError, match=r"\.\[prometheus\]"):
        EngineMetrics("job")


def test_the_checkpointer_hands_records_to_its_callback(make_config):
    records: list = []
    with tc.Checkpointer(make_config()) as ckpt:
        ckpt.on_event(records.append)
        ckpt.save(1, state_of(1.0)).wait()
        ckpt.wait_all()
        ckpt.load(state_of(0.0))
    kinds = [r.kind for r in records]
    assert kinds.count("tier") == 2 and kinds[-2:] == ["save", "load"]
