"""`tiered-ckpt bench --host-budget` runs end to end: two fresh processes, and the budget makes the memory tier
keep fewer checkpoints (the figures themselves are for docs/benchmarks.md, not for a test)."""
from tiered_ckpt.bench import host_budget


def test_the_host_budget_bench_runs_and_the_budget_run_keeps_two(shm_dir):
    runs = host_budget.run(2 << 20, 5, 4, str(shm_dir))
    assert [r["budget"] is None for r in runs] == [True, False]
    assert runs[0]["kept_in_memory"] == [2, 3, 4, 5] and runs[1]["kept_in_memory"] == [4, 5]
    assert all(r["peak_extra_bytes"] > 0 and r["state_bytes"] > 1 << 20 for r in runs)
    table = host_budget.report(runs)
    assert "| unset |" in table and "keep_last 4" in table
