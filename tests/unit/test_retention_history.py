"""A save's retention pass costs the same whatever the history a job keeps: after its first pass, retention asks
the index for the few checkpoints it judges (its keep_last window, the saves finishing, the best ones kept),
never for the whole history. Counted in checkpoint records read, on both indexes."""
import pytest

import tiered_ckpt as tc
from tiered_ckpt.lifecycle import lineage
from tiered_ckpt.storage.index import file as file_index
from tiered_ckpt.storage.index import redis as redis_index

from .common import state_of

HISTORY = 1000  # checkpoints the job keeps (keep_every on the disk tier) before the saves counted


@pytest.fixture
def records_read(monkeypatch):
    """How many checkpoint records the indexes have decoded (a file index's `begun` record, a Redis summary)."""
    count = [0]
    real_file, real_redis = file_index._read_begun, redis_index._from_summary

    def file_record(path):
        count[0] += 1
        return real_file(path)

    def redis_summary(step, raw):
        count[0] += 1
        return real_redis(step, raw)

    monkeypatch.setattr(file_index, "_read_begun", file_record)
    monkeypatch.setattr(redis_index, "_from_summary", redis_summary)
    return count


async def fill(engine: tc.Engine, steps: range) -> None:
    """Complete checkpoints on the disk tier, recorded through the index's own calls (their data is not
    written: retention judges by the index, and keep_every keeps each of them)."""
    index, job = engine.store.index, engine.store.job
    for step in steps:
        await index.begin(job, step, ["disk"], {"nbytes": 1, "metadata": {"loss": 1.0}})
        assert await index.mark_durable(job, step, "disk", 0, 1, "filled")


@pytest.mark.parametrize("kind", ["file", "redis"])
async def test_a_save_reads_the_same_records_at_a_thousand_checkpoints_as_at_none(make_config, shm_dir, kind,
                                                                                  records_read, redis_server):
    """Failed on the old code: every pass listed the whole index (over a thousand records per save here)."""
    url = f"file://{shm_dir}/index" if kind == "file" else redis_server().url
    config = make_config(index=url, tiers=[{"keep_last": 2}, {"keep_last": 2, "keep_every": 10}])
    async with tc.Engine(config) as engine:
        await (await engine.save(1, state_of(1.0))).wait()  # fences the index: the fill writes in its epoch
        await fill(engine, range(10, 10 * (HISTORY + 1), 10))
        step = 10 * (HISTORY + 1)
        for n in range(4):  # the first pass of each tier after the fill may list everything (it is its first)
            records_read[0] = 0
            await (await engine.save(step + n, state_of(float(n)))).wait()
        assert records_read[0] < 40, records_read[0]  # a window of keep_last and the save, per tier
        listing = await engine.statuses()
        assert len([s for s in listing if "disk" in s.complete]) == HISTORY + 3  # keep_every: the fill and step, + 2
        assert [s.step for s in listing if "host" in s.complete] == [step + 2, step + 3]


async def test_a_best_checkpoint_below_the_window_is_judged_again_when_a_better_one_comes(make_config, shm_dir):
    """keep_best = 1 keeps the best one however old: when a better one is saved, the old best (below the keep_last
    window, so outside what a pass lists) is removed, as a pass over the whole index would."""
    config = make_config(index=f"file://{shm_dir}/index",
                         tiers=[{"keep_last": 1}, {"keep_last": 1, "keep_best": 1, "best_metric": "loss"}])
    async with tc.Engine(config) as engine:
        for step, loss in ((1, 0.5), (2, 0.9), (3, 0.8), (4, 0.7), (5, 0.2), (6, 0.6)):
            await (await engine.save(step, state_of(float(step)), metadata={"loss": loss})).wait()
        assert [s.step for s in await engine.statuses() if "disk" in s.complete] == [5, 6]


async def test_checkpoints_another_process_removed_from_the_window_make_the_pass_look_again(make_config, shm_dir):
    """A step of the keep_last window deleted by another process (the CLI) is missed by the window: the pass
    lists everything again and still keeps the tier at keep_last."""
    config = make_config(index=f"file://{shm_dir}/index", tiers=[{"keep_last": 2}, {"keep_last": 2}])
    async with tc.Engine(config) as engine:
        for step in (1, 2, 3):
            await (await engine.save(step, state_of(float(step)))).wait()
        await engine.delete(3)
        for step in (4, 5):
            await (await engine.save(step, state_of(float(step)))).wait()
        assert [s.step for s in await engine.statuses()] == [4, 5]
        # and the next writer's start compares every step of the index with the tiers again
        assert await engine.store.index.get_note(engine.store.job, lineage.NOTE) == lineage.FORGOT


@pytest.mark.parametrize("kind", ["file", "redis"])
async def test_a_loads_pick_reads_the_newest_records_and_the_newest_folders_only(make_config, shm_dir, kind,
                                                                                records_read, redis_server,
                                                                                monkeypatch):
    """Failed on the old code: the pick listed every record of the index (and every key of every tier)."""
    from tiered_ckpt.layout import PartKey
    from tiered_ckpt.lifecycle import lineage

    url = f"file://{shm_dir}/index" if kind == "file" else redis_server().url
    config = make_config(index=url, tiers=[{"keep_last": 2}, {"keep_last": 2, "keep_every": 10}])
    async with tc.Engine(config) as engine:
        await (await engine.save(1, state_of(1.0))).wait()
        await fill(engine, range(10, 10 * (HISTORY + 1), 10))
        disk = engine.store.io.driver("disk")
        for step in range(10, 3000, 10):  # keys of older steps on the tier (a history it keeps)
            await disk.write(PartKey("test", step, 0, 0, "ix-old/s").path, memoryview(b"x"))
        step = 10 * (HISTORY + 1) + 1
        await (await engine.save(step, state_of(7.0))).wait()
        parsed = []
        real = getattr(lineage, "copies_of", None)
        monkeypatch.setattr(lineage, "copies_of", lambda keys, *a: real(parsed.extend(keys) or keys, *a), raising=False)
        records_read[0] = 0
        info = await engine.load(out := state_of(0.0))
        assert info.step == step and float(out["w"][0]) == 7.0
        assert records_read[0] < 20, records_read[0]
        assert all(k.split("/")[1] >= "step-000000009930" for k in parsed), sorted(parsed)[:3]


async def test_a_load_from_a_tier_that_takes_every_tenth_save_widens_its_window(make_config, shm_dir):
    """The newest checkpoint complete on the tier asked for is older than the 8 newest the index lists: the pick
    looks further back (64, then 512 records) and still finds it."""
    config = make_config(index=f"file://{shm_dir}/index", tiers=[{"keep_last": 20}, {"keep_last": 5, "every": 10}])
    async with tc.Engine(config) as engine:
        for step in range(1, 20):
            await (await engine.save(step, state_of(float(step)))).wait()
        info = await engine.load(out := state_of(0.0), tiers=["disk"])
        assert info.step == 10 and float(out["w"][0]) == 10.0
        info = await engine.load(out := state_of(0.0))
        assert info.step == 19 and float(out["w"][0]) == 19.0


def test_a_verdict_makes_its_kept_steps_once():
    """A pass asks `kept` for each checkpoint it judges: made at each ask (the old code), a first pass over ten
    thousand checkpoints cost O(H^2) (2.6 s on the event loop); now the one set is made once per verdict."""
    from tiered_ckpt.lifecycle.rules import Rules

    verdict = Rules(2, keep_every=3).judge([(step, {}) for step in range(1, 10_001)])
    assert verdict.kept is verdict.kept  # the same set: not made again
    assert len(verdict.kept) == 3333 + 1  # every third step (3 ... 9,999), and the newest two (9,999 and 10,000)


@pytest.mark.parametrize("forgotten", ["newest", "middle"])
async def test_a_writer_reads_no_whole_listing_to_clean_up_at_its_start(make_config, shm_dir, monkeypatch, forgotten):
    """Failed on the old code: a writer's start listed the whole index (three times before an earlier fix, then
    once) and every key of every tier (a walk of the whole history), and retention's first pass walked each tier
    again. Now neither lists them: the index's newest records back to its newest complete one, and the keys of the
    steps the index forgot. Where the index kept its history (the lineage note an earlier start left) only the
    tiers' steps from its newest complete one on are compared: what a restore from an older snapshot loses
    ("newest"); where retention found since that the index forgot a step it had listed ("middle"), every step
    number of the index against each tier's step folders. Its work is kept either way: the steps forgotten are
    listed again, an incomplete newer one removed."""
    from tiered_ckpt.storage.index.file import FileIndex
    from tiered_ckpt.storage.tiers.local import LocalTier

    config = make_config(index=f"file://{shm_dir}/index", tiers=[{"keep_last": 50}, {"keep_last": 50}])
    async with tc.Engine(config) as engine:
        for step in range(1, 31):
            await (await engine.save(step, state_of(float(step)))).wait()
        index, job = engine.store.index, engine.store.job
        assert await index.get_note(job, lineage.NOTE) == lineage.KEPT
        for step in ([29, 30] if forgotten == "newest" else [2]):
            await index.delete(job, step)  # forgotten by the index: still whole on the tiers
        if forgotten == "middle":  # what retention's pass writes when the index no longer lists a step it kept
            await index.put_note(job, lineage.NOTE, lineage.FORGOT)
        await index.begin(job, 99, ["disk"])  # a crashed run's incomplete checkpoint, newer than every complete one
    listings, keys = [0], [0]
    real_list, real_keys = FileIndex.list, LocalTier.list

    async def counted(self, job):
        listings[0] += 1
        return await real_list(self, job)

    async def counted_keys(self, prefix):
        found = await real_keys(self, prefix)
        keys[0] += len(found)
        return found

    monkeypatch.setattr(FileIndex, "list", counted)
    monkeypatch.setattr(LocalTier, "list", counted_keys)
    async with tc.Engine(config) as engine:
        listings[0] = keys[0] = 0
        await engine.store.writer.become()
        assert listings[0] == 0
        assert keys[0] < 30, keys[0]  # the forgotten steps' keys on each tier (7 a step), not the 30 steps' (over 400)
        assert [s.step for s in await engine.statuses()] == list(range(1, 31))
        assert await engine.store.index.get_note(engine.store.job, lineage.NOTE) == lineage.KEPT
        keys[0] = 0
        await (await engine.save(31, state_of(31.0))).wait()  # retention's first pass looks at each tier itself
        assert keys[0] < 30, keys[0]  # by its step folders' names: no step's keys (the old code walked all 31)


async def test_a_first_pass_judges_a_long_history_off_the_event_loop(make_config, shm_dir, monkeypatch):
    """Failed on the old code: a writer's first pass judged every checkpoint on the event loop (10,000: 0.1 s of
    judging, and 2.6 s more for the kept set). Now a listing from `LONG` checkpoints on is judged in a thread."""
    import threading

    from tiered_ckpt.lifecycle import retention
    from tiered_ckpt.lifecycle.rules import Rules

    monkeypatch.setattr(retention, "LONG", 16, raising=False)
    config = make_config(index=f"file://{shm_dir}/index", tiers=[{"keep_last": 2}, {"keep_last": 2, "keep_every": 10}])
    async with tc.Engine(config) as engine:
        await (await engine.save(1, state_of(1.0))).wait()
        await fill(engine, range(10, 410, 10))
    judged: list[tuple[int, bool]] = []  # (how many, on the event loop's thread)
    real = Rules.judge

    def recorded(self, complete):
        judged.append((len(complete), threading.current_thread() is threading.main_thread()))
        return real(self, complete)

    monkeypatch.setattr(Rules, "judge", recorded)
    async with tc.Engine(config) as engine:  # a new writer: its first pass looks at the whole history
        await (await engine.save(500, state_of(5.0))).wait()
        assert any(n > 16 for n, _ in judged) and not [n for n, on_loop in judged if n > 16 and on_loop], judged
        assert [s.step for s in await engine.statuses() if "disk" in s.complete][-3:] == [390, 400, 500]


def counting(method, listed):
    """`method` (an index's list or list_range) adding the checkpoints it returns to listed[0]."""
    async def counted(self, *args, **kwargs):
        found = await method(self, *args, **kwargs)
        listed[0] += len(found)
        return found
    return counted


@pytest.mark.parametrize("kind", ["file", "redis"])
async def test_a_full_tier_makes_room_reading_the_records_of_what_it_holds(make_config, shm_dir, kind,
                                                                          redis_server, monkeypatch):
    """Failed on the old code: a tier with room for two states (it retires one to make room at every save, as a
    small memory tier does) listed the whole index at each retirement: over a thousand records per save here, the
    job's history. Now it reads the records of the steps the tier holds, asked for by name."""
    from tiered_ckpt.lifecycle.retention import Retention

    url = f"file://{shm_dir}/index" if kind == "file" else redis_server().url
    config = make_config(index=url, tiers=[{"keep_last": 2},
                                                   {"capacity": "520KiB", "keep_last": 3, "keep_every": 10}])
    async with tc.Engine(config) as engine:
        await (await engine.save(1, state_of(1.0))).wait()
        index, job = engine.store.index, engine.store.job
        for old in range(10, 10 * (HISTORY + 1), 10):  # the history, kept on another tier (an archive's)
            await index.begin(job, old, ["archive"], {"nbytes": 1, "metadata": {}})
            assert await index.mark_durable(job, old, "archive", 0, 1, "filled")
        step = 10 * (HISTORY + 1)
        for n in range(4):
            await (await engine.save(step + n, state_of(float(n)))).wait()
        made_room, listed = [], [0]  # checkpoints the index listed during each make_room
        real, kind_of = Retention.make_room, type(index)
        for name in ("list", "list_range"):
            monkeypatch.setattr(kind_of, name, counting(getattr(kind_of, name), listed))

        async def counted(self, tier, *, finishing):
            before = listed[0]
            retired = await real(self, tier, finishing=finishing)
            made_room.append(listed[0] - before)
            return retired

        monkeypatch.setattr(Retention, "make_room", counted)
        for n in range(4, 7):
            await (await engine.save(step + n, state_of(float(n)))).wait()
        assert made_room and max(made_room) < 10, made_room  # the two or three steps the tier holds
        on_disk = [s.step for s in await engine.statuses() if "disk" in s.complete and s.step > step - 10]
        assert on_disk[-1] == step + 6 and len(on_disk) <= 2, on_disk


@pytest.mark.parametrize("kind", ["file", "redis"])
async def test_a_new_writers_first_pass_judges_the_window_its_predecessor_left(make_config, shm_dir, kind,
                                                                              redis_server, monkeypatch):
    """Failed on the old code: a writer's first pass (a new process) listed every checkpoint the index holds on
    each tier (over two thousand statuses here), as it did not know where the previous writer's passes had left
    off. Now the previous passes left their place in the index (a note per tier), and the new writer's whole first
    save reads a window: the newest records, each tier's keep_last window and its own step. A note of other rules
    is not used: keep_last changed, that tier's first pass judges every checkpoint once."""
    url = f"file://{shm_dir}/index" if kind == "file" else redis_server().url
    tiers = [{"keep_last": 2}, {"keep_last": 2, "keep_every": 10}]
    async with tc.Engine(make_config(index=url, tiers=tiers)) as engine:
        await (await engine.save(1, state_of(1.0))).wait()
        await fill(engine, range(10, 10 * (HISTORY + 1), 10))
        step = 10 * (HISTORY + 1) + 1
        for n in range(2):  # the first pass after the fill looks at everything (its first); the second leaves a note
            await (await engine.save(step + n, state_of(float(n)))).wait()
        kind_of = type(engine.store.index)
    listed = [0]  # statuses the index returned (list and list_range)
    for name in ("list", "list_range"):
        monkeypatch.setattr(kind_of, name, counting(getattr(kind_of, name), listed))
    async with tc.Engine(make_config(index=url, tiers=tiers)) as engine:  # a new writer: a new process's engine
        listed[0] = 0  # (the engine's open lists the job once: not a save's)
        await (await engine.save(step + 2, state_of(2.0))).wait()
        assert listed[0] < 60, listed[0]
        listing = await engine.statuses()
        assert len([s for s in listing if "disk" in s.complete]) == HISTORY + 2  # keep_every's, and the newest two
        assert [s.step for s in listing if "host" in s.complete] == [step + 1, step + 2]
    tiers[1] = {**tiers[1], "keep_last": 3}  # other rules: the note of the disk tier is not used
    async with tc.Engine(make_config(index=url, tiers=tiers)) as engine:
        listed[0] = 0
        await (await engine.save(step + 3, state_of(3.0))).wait()
        assert listed[0] > HISTORY, listed[0]
        assert [s.step for s in await engine.statuses() if "disk" in s.complete][-3:] == [step + 1, step + 2, step + 3]


@pytest.mark.parametrize("kind", ["file", "redis"])
async def test_a_resumed_writers_first_save_lists_no_tiers_job_folder(make_config, shm_dir, kind, redis_server,
                                                                      monkeypatch):
    """Failed on the old code: a new process's first save listed and sorted every step folder of the job on each
    local tier (its start compares the steps from the index's newest complete one on, retention's first pass those
    of its window: 10,000 step folders, 5-9 ms of CPU). Now it reads the newest names its predecessor kept. What
    the tiers hold is still found: the two newest steps, forgotten by the index and written while the names could
    not be kept (a crash between a step folder made and its names kept), are listed again. Agent off: with the
    node agent, the agent makes the disk's step folders, so the trainer's kept names are stale and its first save
    lists that folder again (not yet kept across the two processes)."""
    from tiered_ckpt.storage.tiers import local

    url = f"file://{shm_dir}/index" if kind == "file" else redis_server().url
    config = make_config(index=url, agent="off", tiers=[{"keep_last": 2}, {"keep_last": 2, "keep_every": 1}])
    async with tc.Engine(config) as engine:
        for step in range(1, 31):
            await (await engine.save(step, state_of(float(step)))).wait()
        roots = [str(engine.store.io.file_tier(t).root) for t in engine.store.io.names]
        job = engine.store.job
    folders = {f"{root.rstrip('/')}/{job}" for root in roots}
    listed = [0]
    real = local.os.listdir

    def counted(path):
        listed[0] += str(path).rstrip("/") in folders
        return real(path)

    monkeypatch.setattr(local.os, "listdir", counted)
    async with tc.Engine(config) as engine:  # the job restarted
        listed[0] = 0
        await (await engine.save(31, state_of(31.0))).wait()
        assert listed[0] == 0, listed[0]
        assert [s.step for s in await engine.statuses() if "disk" in s.complete] == list(range(1, 32))
        monkeypatch.setattr(local, "_write_tail", lambda path, tail: (_ for _ in ()).throw(OSError("killed")))
        for step in (32, 33):
            await (await engine.save(step, state_of(float(step)))).wait()
        for step in (32, 33):
            await engine.store.index.delete(job, step)  # the index forgot them
    monkeypatch.undo()
    async with tc.Engine(config) as engine:
        await (await engine.save(34, state_of(34.0))).wait()
        assert [s.step for s in await engine.statuses() if "disk" in s.complete][-4:] == [31, 32, 33, 34]
