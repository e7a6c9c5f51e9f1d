"""The conformance suite every Index passes (the file index, the Redis index, a third party's).

Subclass `IndexConformance` and give it one fixture, `make_index`: a function that returns a new,
*unopened* index over one empty store, the same store on every call. The suite opens and fences each index
as a job's writer does and closes it afterwards.
"""
from __future__ import annotations

import asyncio
from typing import Any, AsyncIterator, Callable

import pytest

from ..errors import IncompleteCheckpoint
from ..storage.index import Index, rank_metas

JOB = "job"


class IndexConformance:
    @pytest.fixture
    async def opened(self, make_index: Callable[[], Index]) -> AsyncIterator[Callable[[], Any]]:
        started: list[Index] = []

        async def open_one(job: str = JOB, *, epoch: int | None = None, fence: bool = True) -> Index:
            """A writer of `job`: fenced as a new incarnation, or joining incarnation `epoch` (another rank);
            with fence=False only opened (a reader, or a cleaner that attaches)."""
            index = make_index()
            await index.open()
            if fence:
                index.epoch = await index.fence(job) if epoch is None else epoch
            started.append(index)
            return index

        yield open_one
        for index in started:
            await index.close()

    @pytest.fixture
    async def index(self, opened) -> Index:  # type: ignore[no-untyped-def]
        return await opened()

    async def test_begin_lists_an_incomplete_checkpoint_with_its_tiers_in_order(self, index):
        await index.begin(JOB, 5, ["host", "disk", "s3"])
        [status] = await index.list(JOB)
        assert (status.step, status.tiers, status.complete, status.is_complete) == (5, ("host", "disk", "s3"),
                                                                                    frozenset(), False)
        assert status.created > 0

    async def test_list_is_sorted_by_step_and_per_job(self, index, opened):
        for step in (30, 4, 100):
            await index.begin(JOB, step, ["disk"])
        await (await opened("other")).begin("other", 7, ["disk"])
        assert [s.step for s in await index.list(JOB)] == [4, 30, 100]
        assert [s.step for s in await index.list("other")] == [7]
        assert await index.list("nobody") == []

    async def test_list_range_lists_from_a_step_on_the_newest_and_the_steps_asked(self, index):
        for step in (4, 30, 100, 7, 250):
            await index.begin(JOB, step, ["disk"], {"nbytes": step, "metadata": {"loss": 1.0 / step}})
        assert await index.mark_durable(JOB, 30, "disk", 0, 1, "s")
        whole = await index.list(JOB)
        assert await index.list_range(JOB, 30) == [s for s in whole if s.step >= 30]  # the same statuses
        assert await index.list_range(JOB) == whole
        assert [s.step for s in await index.list_range(JOB, newest=2)] == [100, 250]
        assert [s.step for s in await index.list_range(JOB, 31, also=[4, 5, 30])] == [4, 30, 100, 250]
        assert [s.step for s in await index.list_range(JOB, newest=1, also=[7, 250])] == [7, 250]
        assert [s.step for s in await index.list_range(JOB, 8, newest=10)] == [30, 100, 250]
        assert [s.step for s in await index.list_range(JOB, oldest=2)] == [4, 7]  # from the other end
        assert [s.step for s in await index.list_range(JOB, 5, oldest=2, also=[250])] == [7, 30, 250]
        assert [s.step for s in await index.list_range(JOB, newest=3, oldest=1)] == [30]
        assert await index.list_range(JOB, 30, oldest=2) == [s for s in whole if s.step in (30, 100)]
        assert await index.list_range(JOB, oldest=0) == []
        assert await index.list_range(JOB, 251) == [] and await index.list_range("nobody") == []
        await index.delete(JOB, 100)
        assert [s.step for s in await index.list_range(JOB, 30, also=[100])] == [30, 250]

    async def test_jobs_are_those_with_a_checkpoint(self, index, opened):
        assert await index.jobs() == []  # a fenced writer has no checkpoint yet
        await index.begin(JOB, 1, ["disk"])
        await (await opened("other-job")).begin("other-job", 7, ["disk"])
        assert await index.jobs() == [JOB, "other-job"]

    async def test_manifest_and_rank_records_round_trip(self, index):
        await index.begin(JOB, 1, ["disk"])
        await index.put_manifest(JOB, 1, b"\x00manifest\xff")
        await index.put_rank_meta(JOB, 1, 0, b"rank0")
        await index.put_rank_meta(JOB, 1, 3, b"rank3")
        assert await index.get_manifest(JOB, 1) == b"\x00manifest\xff"
        assert [await index.get_rank_meta(JOB, 1, r) for r in (0, 3)] == [b"rank0", b"rank3"]
        with pytest.raises(IncompleteCheckpoint):
            await index.get_rank_meta(JOB, 1, 1)
        with pytest.raises(IncompleteCheckpoint):
            await index.get_manifest(JOB, 2)

    async def test_rank_records_are_read_in_one_batch_missing_ones_absent(self, index):
        await index.begin(JOB, 1, ["disk"])
        records = {r: f"rank{r}".encode() * (r % 5 + 1) for r in range(0, 2500, 2)}  # more than one batch
        for r, data in records.items():
            await index.put_rank_meta(JOB, 1, r, data)
        assert await rank_metas(index, JOB, 1, range(2500)) == records  # odd ranks: no record, absent
        assert await rank_metas(index, JOB, 1, [4, 0]) == {4: records[4], 0: records[0]}
        assert await rank_metas(index, JOB, 1, []) == {}
        assert await rank_metas(index, JOB, 2, [0, 1]) == {}  # no such step: nothing, not an error

    async def test_a_tier_completes_when_every_rank_of_one_session_marked_it(self, index):
        await index.begin(JOB, 1, ["host", "disk"])
        assert not await index.mark_durable(JOB, 1, "disk", 0, 3, "s1")
        assert not await index.mark_durable(JOB, 1, "disk", 0, 3, "s1")  # a repeat does not count twice
        assert not await index.mark_durable(JOB, 1, "disk", 1, 3, "old")  # an earlier attempt's marker
        assert not await index.mark_durable(JOB, 1, "disk", 1, 3, "s1")
        state = await index.tier_state(JOB, 1, "disk", "s1")
        assert (state.state, state.ranks_done) == ("pending", frozenset({0, 1}))
        assert (await index.list(JOB))[0].complete == frozenset()
        assert await index.mark_durable(JOB, 1, "disk", 2, 3, "s1")
        assert (await index.tier_state(JOB, 1, "disk", "s1")).state == "complete"
        [status] = await index.list(JOB)
        assert status.complete == frozenset({"disk"}) and status.incomplete == ("host",)

    async def test_concurrent_marks_complete_exactly_once(self, index, opened):
        others = [await opened(epoch=index.epoch) for _ in range(3)]
        await index.begin(JOB, 2, ["disk"])
        results = await asyncio.gather(*(i.mark_durable(JOB, 2, "disk", r, 4, "s")
                                         for r, i in enumerate([index, *others])))
        assert sorted(results) == [False, False, False, True]

    async def test_a_failure_is_seen_by_every_rank_and_listed(self, index):
        await index.begin(JOB, 3, ["disk", "s3"])
        await index.mark_failed(JOB, 3, "s3", 1, "s1", "TierFull: no space")
        state = await index.tier_state(JOB, 3, "s3", "s1")
        assert state.state == "failed" and "rank 1" in state.reason and "no space" in state.reason
        assert (await index.tier_state(JOB, 3, "s3", "s2")).state == "pending"  # another session's failure
        [status] = await index.list(JOB)
        assert "s3" in status.failed and "no space" in status.failed["s3"]

    async def test_tombstones_are_set_listed_per_job_and_removed(self, index, opened):
        assert await index.buried(JOB) == set()
        await index.bury(JOB, 7)
        await index.bury(JOB, 12)
        await (await opened("other")).bury("other", 3)
        assert await index.buried(JOB) == {7, 12}
        await index.unbury(JOB, 7)
        await index.unbury(JOB, 99)  # absent: not an error
        assert await index.buried(JOB) == {12}

    async def test_unmark_drops_one_tier_and_delete_drops_the_checkpoint(self, index):
        await index.begin(JOB, 4, ["host", "disk"])
        await index.put_manifest(JOB, 4, b"m")
        for tier in ("host", "disk"):
            assert await index.mark_durable(JOB, 4, tier, 0, 1, "s")
        await index.unmark(JOB, 4, "host")
        [status] = await index.list(JOB)
        assert status.complete == frozenset({"disk"}) and status.tiers == ("disk",)
        await index.delete(JOB, 4)
        assert await index.list(JOB) == []
        with pytest.raises(IncompleteCheckpoint):
            await index.get_manifest(JOB, 4)
        await index.delete(JOB, 4)  # absent: not an error

    async def test_rank_0s_begin_records_size_and_metadata_for_list(self, index, opened):
        info = {"nbytes": 123_456_789_012, "metadata": {"name": "best", "loss": 0.25, "tags": ["a", "b"]}}
        await index.begin(JOB, 1, ["host", "disk"], info)
        other_rank = await opened(epoch=index.epoch)
        await other_rank.begin(JOB, 1, ["host", "disk"])  # the other ranks begin the same save without it
        await index.begin(JOB, 2, ["disk"])  # an earlier release recorded none
        assert await index.mark_durable(JOB, 1, "host", 0, 1, "s")
        await index.unmark(JOB, 1, "disk")
        one, two = await index.list(JOB)
        assert (one.nbytes, one.metadata, one.complete) == (info["nbytes"], info["metadata"], frozenset({"host"}))
        assert (two.nbytes, two.metadata) == (None, {})

    async def test_a_cleaner_attaches_without_fencing_the_running_writer(self, index, opened):
        await index.begin(JOB, 1, ["disk"])
        cleaner = await opened(fence=False)
        assert await cleaner.attach(JOB) is False  # a writer holds the job (or the index cannot tell)
        await cleaner.bury(JOB, 1)  # the cleaner may change the index ...
        await cleaner.delete(JOB, 1)
        await cleaner.unbury(JOB, 1)
        assert await index.list(JOB) == [] and await index.buried(JOB) == set()
        await index.begin(JOB, 2, ["disk"])  # ... and the writer is not fenced out
        assert await index.mark_durable(JOB, 2, "disk", 0, 1, "s")
        assert [s.step for s in await cleaner.list(JOB) if s.is_complete] == [2]
        await cleaner.detach(JOB)  # done: releases whatever attach held, and the writer goes on
        await index.begin(JOB, 3, ["disk"])


    async def test_a_writers_notes_are_kept_per_job_and_name_and_read_by_a_later_process(self, index, opened):
        """Retention keeps where its passes left off here, so a later writer's first pass judges a window."""
        assert await index.get_note(JOB, "retention.disk") is None
        await index.put_note(JOB, "retention.disk", b"\x00first")
        await index.put_note(JOB, "retention.disk", b"\x00second")  # replaced, not appended
        await index.put_note(JOB, "retention.host", b"host's")
        await (await opened("other")).put_note("other", "retention.disk", b"other job's")
        later = await opened(fence=False)  # a later process, reading
        assert await later.get_note(JOB, "retention.disk") == b"\x00second"
        assert await later.get_note(JOB, "retention.host") == b"host's"
        assert await later.get_note("other", "retention.disk") == b"other job's"
        assert await later.get_note(JOB, "retention.s3") is None
        assert await index.list(JOB) == [] and JOB not in await index.jobs()  # a note is no checkpoint
