"""`python -m tiered_ckpt.bench.stalls`: what it reports, checked without timing anything: the watcher of the
GIL names the thread that held it, and each operation's row carries every figure."""
import asyncio
import gc
import threading
import time
from pathlib import Path

from tiered_ckpt.bench import stalls


def _hold(seconds: float) -> None:
    """Hold the GIL through one C call for about `seconds` (a sort of a list that takes that long)."""
    n = 50_000
    values = list(range(n, 0, -1))
    start = time.thread_time()
    while time.thread_time() - start < seconds:
        sorted(values * 20)  # one C call: the GIL is not given back inside it


def test_the_watcher_names_a_worker_threads_long_hold_and_not_the_loops():
    gc.disable()
    try:
        watch = stalls._GilWatch(threading.get_ident(), late=0.005)
        time.sleep(0.05)
        watch.reset()
        worker = threading.Thread(target=_hold, args=(0.3,), name="holder")
        worker.start()
        worker.join()
        time.sleep(0.02)
        watch.close()
    finally:
        gc.enable()
    assert watch.worker[0] >= 0.02, watch.holds  # at least one single call's worth, by CPU
    assert watch.worker[1]  # where it was after the hold
    assert watch.loop < watch.worker[0]  # this (the 'loop') thread only waited


def test_each_operation_reports_every_figure(tmp_path):
    shm = Path("/dev/shm") if Path("/dev/shm").is_dir() else tmp_path
    import tempfile

    with tempfile.TemporaryDirectory(dir=shm) as memory:
        figures = asyncio.run(stalls.measure(200, tmp_path, Path(memory)))
    assert list(figures) == list(stalls.OPERATIONS)
    for op, (seconds, stall, cpu, wait, held, where, holds) in figures.items():
        assert seconds > 0 and stall >= 0 and cpu >= 0 and wait >= 0 and held >= 0, op
        assert isinstance(where, str) and isinstance(holds, list)
    runs = [{"tensors": 200, "automatic_gc": True, "figures": figures}]
    row = stalls.report(runs).splitlines()[-1]
    assert row.startswith("| 200 | on |") and row.count(" / ") == 4 * len(stalls.OPERATIONS)
    assert len(stalls.holders(runs).splitlines()) == len(stalls.OPERATIONS)


def test_the_world_plan_of_each_replicated_layout_is_measured():
    for layout in stalls.PLAN_LAYOUTS:
        r = stalls._plan_one(300, layout)
        assert r["layout"] == layout and r["cpu"] > 0 and r["wait"] >= 0 and r["held"] >= 0
    gc.enable()  # (_plan_one turns automatic collection off, as its own process would)


def test_each_step_of_a_loads_planning_is_measured_alone():
    steps = stalls._load_steps_one(500)
    gc.enable()  # (as above)
    assert [r["step"] for r in steps] == list(stalls.LOAD_STEPS)
    for r in steps:
        assert r["tensors"] == 500 and r["cpu"] > 0 and r["wait"] >= 0 and r["held"] >= 0, r
