"""The simulation bench's index phases (tiered_ckpt/bench/scale.py) run the real commit and load-metadata code
for synthetic worlds: a rank's commit costs the same number of index round trips at 8 and 96 ranks on both
indexes (exactly one marker commits), and a world's load reads the index a fixed number of times."""
from tiered_ckpt.bench import scale
from tiered_ckpt.storage.index.file import FileIndex
from tiered_ckpt.storage.index.redis import RedisIndex


async def test_commit_and_load_round_trips_do_not_grow_with_the_world(redis_server, tmp_path):
    url = redis_server().url
    for name, make in (("redis", lambda: RedisIndex(url)), ("file", lambda: FileIndex(tmp_path / "index"))):
        small, large = [await scale.commit_phase(name, make, r, step) for step, r in ((1, 8), (2, 96))]
        assert small["round_trips_rank"] == large["round_trips_rank"] <= 3
        loads = [await scale.load_phase(name, make, r) for r in (8, 96)]
        assert loads[0]["round_trips_world"] == loads[1]["round_trips_world"] <= 2
        assert loads[1]["rank_received_bytes"] > loads[0]["rank_received_bytes"]  # the manifest lists every rank


def test_report_fits_a_slope_per_phase():
    rows = [{"phase": "p", "ranks": r, "rank_cpu": 0.001 * r, "round_trips_rank": 3} for r in (64, 256, 1024)]
    lines = scale.report(rows)
    assert "- p: rank_cpu R^1.00, round_trips_rank R^0.00" in lines
