"""The file index's summary of settled checkpoints (storage/index/file_summary.py): a listing reads a settled
checkpoint's records once, in any process, and again only once its folders changed. Counted in `begun`
records read; each listing compared with one made without the summary."""
import asyncio
import time

import pytest

from tiered_ckpt.storage.index import file as file_index
from tiered_ckpt.storage.index import file_summary
from tiered_ckpt.storage.index.file import FileIndex

JOB = "job"
STEPS = 40


@pytest.fixture
def records_read(monkeypatch):
    """`begun` records read by the file index; the summary in use from the first step, written every listing."""
    monkeypatch.setattr(file_summary, "LISTED_FROM", 0)
    monkeypatch.setattr(file_summary, "REWRITE_AFTER", 0)
    count = [0]
    real = file_index._read_begun

    def counted(path):
        count[0] += 1
        return real(path)

    monkeypatch.setattr(file_index, "_read_begun", counted)
    return count


async def writer(root) -> FileIndex:
    index = FileIndex(root)
    await index.open()
    index.epoch = await index.fence(JOB)
    return index


async def fill(index: FileIndex, steps) -> None:
    for step in steps:
        await index.begin(JOB, step, ["disk"], {"nbytes": step, "metadata": {"loss": 1.0 / step}, "folder": "f"})
        assert await index.mark_durable(JOB, step, "disk", 0, 1, "s")


def without_summary(root) -> list:
    """The listing as read from every step's records."""
    index = FileIndex(root)
    return [s for n in file_index._step_names(index.root / JOB)
            if (s := index._status_sync(str(index.root / JOB), n)) is not None]


async def test_a_fresh_process_lists_settled_checkpoints_from_the_summary(tmp_path, records_read):
    """Failed on the old code: every listing read every step's records (40 here, in each process)."""
    index = await writer(tmp_path)
    await fill(index, range(1, STEPS + 1))
    await asyncio.sleep(0.11)  # past the file system's tick: the statuses read now are trusted (file_summary.trusted)
    first = await index.list(JOB)
    assert records_read[0] == STEPS
    records_read[0] = 0
    assert await index.list(JOB) == first and records_read[0] == 0  # this process: from memory
    reader = FileIndex(tmp_path)  # another process: from the summary file
    assert await reader.list(JOB) == first and records_read[0] == 0
    assert first == without_summary(tmp_path)
    await index.close()


async def test_a_changed_checkpoint_is_read_again(tmp_path, records_read):
    """Each change of a settled checkpoint's records is seen by a process that listed it before: a tier
    unmarked, a step deleted and saved again, a failure recorded, a new tier completed, metadata rewritten."""
    index = await writer(tmp_path)
    await fill(index, range(1, STEPS + 1))
    await index.begin(JOB, 7, ["disk", "s3"], {"nbytes": 7, "metadata": {}, "folder": "f"})  # s3 not complete yet
    await asyncio.sleep(0.11)
    reader = FileIndex(tmp_path)
    assert await reader.list(JOB) == without_summary(tmp_path)
    await index.unmark(JOB, 3, "disk")
    await index.delete(JOB, 5)
    await fill(index, [5])
    await index.mark_failed(JOB, 9, "s3", 0, "s", "full")
    assert await index.mark_durable(JOB, 7, "s3", 0, 1, "s")
    await index.begin(JOB, 11, ["disk"], {"nbytes": 1, "metadata": {"loss": 0.0}, "folder": "g"})
    records_read[0] = 0
    listed = await reader.list(JOB)
    assert records_read[0] < 10  # the changed steps, not all forty
    assert listed == without_summary(tmp_path)
    by_step = {s.step: s for s in listed}
    assert by_step[3].complete == frozenset() and by_step[5].created > by_step[4].created
    assert by_step[9].failed and by_step[7].complete == {"disk", "s3"} and by_step[11].folder == "g"
    await index.close()


async def test_a_change_within_the_tick_of_a_read_is_not_missed(tmp_path, records_read):
    """A status read within the file system's tick of its folder's last change is not kept: a change in the
    same tick keeps the modification time."""
    index = await writer(tmp_path)
    await fill(index, range(1, 4))
    reader = FileIndex(tmp_path)
    await reader.list(JOB)  # at once: within the tick of the fill
    await index.unmark(JOB, 2, "disk")
    assert await reader.list(JOB) == without_summary(tmp_path)
    await index.close()


async def test_a_torn_summary_is_not_used(tmp_path, records_read):
    index = await writer(tmp_path)
    await fill(index, range(1, 6))
    await asyncio.sleep(0.11)
    await index.list(JOB)
    path = tmp_path / JOB / file_summary.SUMMARY
    path.write_bytes(path.read_bytes()[:-5])
    records_read[0] = 0
    listed = await FileIndex(tmp_path).list(JOB)
    assert records_read[0] == 5 and listed == without_summary(tmp_path)
    await index.close()


async def test_a_short_history_keeps_no_summary(tmp_path):
    index = await writer(tmp_path)
    await fill(index, range(1, 6))
    await index.list(JOB)
    assert not (tmp_path / JOB / file_summary.SUMMARY).exists()  # below LISTED_FROM steps: nothing written
    await index.close()


async def test_a_failure_of_a_tier_no_longer_targeted_is_seen(tmp_path, records_read):
    """A step with a failure marker of a complete tier (listed as nothing) is not kept: a marker of another tier
    added to the same folder later changes only that folder, and is listed."""
    index = await writer(tmp_path)
    await fill(index, range(1, 4))
    await index.mark_failed(JOB, 2, "disk", 1, "s", "a retry that lost")  # disk is complete: not listed as failed
    await asyncio.sleep(0.11)
    reader = FileIndex(tmp_path)
    assert not (await reader.list(JOB))[1].failed
    await index.mark_failed(JOB, 2, "old", 0, "s", "gone")
    assert (await reader.list(JOB))[1].failed == {"old": "rank 0: gone"}
    await index.close()
