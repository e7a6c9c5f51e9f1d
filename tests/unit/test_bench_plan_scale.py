"""The planning bench's measure() (which the simulation bench calls): its keys, and that its synthetic ranks'
payloads are what describe() makes (it checks rank 1's itself)."""
import pytest

from tiered_ckpt.bench.plan_scale import measure


@pytest.mark.parametrize("layout, chunks", [("ddp", 4 + 7), ("fsdp", 4 * 8), ("hsdp", 4 * 4 + 4)])
def test_measure_reports_both_sides_of_a_plan_miss(layout, chunks):
    m = measure(layout, 4, 8)
    assert {"rank_cpu", "coordinator_cpu", "gathered_bytes", "rank_received_bytes", "max_mean",
            "chunks"} <= set(m)
    assert m["chunks"] == chunks and m["max_mean"] == pytest.approx(1.0, abs=0.01)
    # (hsdp's 4 more: a large shard's box is cut between its two replicas) DDP's ranks send two digests, no boxes
    assert m["rank_received_bytes"] > 0 and (m["gathered_bytes"] < 64 * 7) == (layout == "ddp")


@pytest.mark.parametrize("layout", ["ddp", "fsdp", "hsdp"])
def test_measure_reports_a_loading_ranks_metadata_work(layout):
    m = measure(layout, 4, 8, manifest=True, load=True)
    assert m["load_decode_cpu"] >= 0 and m["load_plan_cpu"] >= 0
    # same layout: an FSDP rank reads its own 4 shards, a DDP rank every chunk of every tensor
    assert m["load_chunks"] == {"ddp": m["chunks"], "fsdp": 4, "hsdp": 4 + 1}[layout]
    assert (m["load_broadcast_cpu"] is None) == (layout == "hsdp")
