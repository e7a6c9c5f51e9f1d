"""`tiered-ckpt bench --training-loop` (bench/loop_share.py): the training loop's share, split per save.
Checked for what it reports and how its figures are made from the runs, never for how fast."""
import shutil
import tempfile
import warnings
from pathlib import Path

import pytest

from tiered_ckpt.bench import loop_share


@pytest.fixture(scope="module")
def result(tmp_path_factory):
    shm = Path(tempfile.mkdtemp(prefix="tiered_ckpt-test-", dir="/dev/shm" if Path("/dev/shm").is_dir() else None))
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield loop_share.measure(steps=6, every=3, repeats=1, base=tmp_path_factory.mktemp("loop"), shm=str(shm),
                                     dcp=False, calibrate_ms=5.0)
        assert not list(shm.iterdir())  # its memory tier's folder is gone with it
    finally:
        shutil.rmtree(shm, ignore_errors=True)


def test_each_run_and_the_split_of_a_save_are_reported(result):
    assert set(result["runs"]) == {"none", "tiered_ckpt", "tiered_ckpt_agent", "dcp", "python"}
    assert result["agent"] is None and not result["runs"]["tiered_ckpt_agent"]  # --agent: a process, not here
    assert set(result["durable"]["tiered_ckpt"]) == {"host", "disk"}
    assert [len(result["runs"][k]) for k in ("none", "tiered_ckpt", "python")] == [1, 1, 1] and not result["runs"]["dcp"]
    assert set(result["slowdown"]) == {"tiered_ckpt", "python"}
    b = result["breakdown"]
    assert b["save_call"] > 0 and b["staged_wait"] >= 0
    # the per-save cost is the runs' difference over the saves: the same figure the slowdown gives
    saves = result["steps"] // result["every"]
    expected = (result["runs"]["tiered_ckpt"][0] - result["runs"]["none"][0]) / saves
    assert b["per_save"] == pytest.approx(expected)
    assert b["split_share"] == pytest.approx((b["save_call"] + b["step_after_save"]) / (result["every"] * b["step"]))
    assert 0 < b["step"] < result["runs"]["tiered_ckpt"][0] / result["steps"] * 3  # a step, not a run
    assert result["python_per_save"] is not None and result["python_step_after"] is not None


@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="threads' CPU is read from Linux's /proc")
def test_the_engine_threads_are_grouped_by_what_they_do(result):
    groups = result["background_cpu_per_save"]
    assert {"event loop", "staging copy", "tier host", "tier disk"} <= set(groups)
    assert all(user >= 0 and system >= 0 for user, system in groups.values())
    assert sum(user + system for user, system in groups.values()) > 0  # the engine's work is counted somewhere


def test_the_report_names_every_part():
    text = loop_share.report({
        "steps": 6, "every": 3, "state_bytes": 25 << 20, "calibrate_ms": 5.0,
        "seconds": {"none": 1.0, "tiered_ckpt": 1.1, "python": 1.05},
        "slowdown": {"tiered_ckpt": 0.1, "python": 0.05},
        "breakdown": {"save_call": 0.002, "staged_wait": 0.0003, "step_after_save": 0.004, "per_save": 0.05,
                      "split_share": 0.021},
        "python_per_save": 0.025, "python_step_after": 0.009, "background_cpu_per_save": {"event loop": (0.004, 0.0)}, "runs": {}})
    for row in ("no checkpoint | 1.00", "10.0%", "5 ms of pure Python", "`save()` returns", "| 2.00 |",
                "waiting for the lazy copy", "the step after a save", "| 50.00 |", "over 3 steps | 2.1% |", "| 9.00 |", "| 25.00 |",
                "| event loop | 4.0 | 0.0 |"):
        assert row in text, row


def test_thread_groups():
    g = loop_share._thread_group
    assert g("tiered_ckpt-loop") == "event loop"
    assert g("tiered_ckpt-copy_0") == "staging copy"
    assert g("tiered_ckpt_1") == g("tiered_ckpt-hash_0") == "checksums and scatters"
    assert g("tiered_ckpt-disk_0") == "tier disk" and g("tiered_ckpt-host_2") == "tier host"
    assert g("uvloop_0") == g("asyncio_3") == "default executor (index files, the walk)"
    assert g("tiered_ckpt-events_0") == "event log"
    assert g("MainThread") == ""


def test_too_few_steps_for_two_saves_is_refused_before_any_run():
    with pytest.raises(ValueError, match="at least twice every"):
        loop_share.measure(steps=5, every=3)


def test_the_yardstick_thread_ends_when_closed():
    background = loop_share.BackgroundPython(1.0)
    background(3, {})
    background.close()
    assert not background._thread.is_alive()


def test_the_report_compares_the_agent_run_and_gives_time_to_durable():
    b = {"save_call": 0.002, "staged_wait": 0.0003, "step_after_save": 0.004, "per_save": 0.05, "split_share": 0.021}
    text = loop_share.report({
        "steps": 6, "every": 3, "state_bytes": 25 << 20, "calibrate_ms": 5.0,
        "seconds": {"none": 1.0, "tiered_ckpt": 1.1, "tiered_ckpt_agent": 1.02},
        "slowdown": {"tiered_ckpt": 0.1, "tiered_ckpt_agent": 0.02}, "breakdown": b,
        "agent": {"breakdown": {**b, "step_after_save": 0.001, "split_share": 0.007},
                  "background_cpu_per_save": {"event loop": (0.002, 0.0)}, "agent_cpu_per_save": 0.012},
        "durable": {"tiered_ckpt": {"host": 0.02, "disk": 0.09}, "tiered_ckpt_agent": {"host": 0.03, "disk": 0.15}},
        "background_cpu_per_save": {"event loop": (0.004, 0.0)}, "runs": {}})
    for row in ("agent on (the disk tier drained by the node agent) | 1.02 | 2.0%", "| agent off | agent on |",
                "the step after a save, beyond the other steps | 4.00 | 1.00 |", "| 2.1% | 0.7% |",
                "trainer thread CPU: event loop (user + system) | 4.0 | 2.0 |", "the agent process's CPU | | 12.0 |",
                "time to durable, tiered_ckpt_agent (save() to the tier committed, medians, ms): disk 150, host 30"):
        assert row in text, row
