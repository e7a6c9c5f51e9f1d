"""`abandon` on both indexes (the file index on disk, the Redis index on a real redis-server): it ends a session's
commit of a tier unless that tier is complete, and a marker that lands after it completes nothing."""
import pytest

from tiered_ckpt.errors import RankFailed
from tiered_ckpt.storage.index import status_of
from tiered_ckpt.storage.index.file import FileIndex
from tiered_ckpt.storage.index.redis import RedisIndex


@pytest.fixture(params=["file", "redis"])
async def index(request, tmp_path, redis_server):
    made = FileIndex(tmp_path / "index") if request.param == "file" else RedisIndex(redis_server().url)
    await made.open()
    made.epoch = await made.fence("j")
    yield made
    await made.close()


async def test_an_abandoned_commit_takes_no_late_marker_and_a_complete_one_is_not_abandoned(index):
    await index.begin("j", 1, ["host", "disk"])
    assert not await index.mark_durable("j", 1, "host", 0, 2, "s1")
    assert await index.abandon("j", 1, "host", "s1", 1, "the trainer went")  # rank 1 never marked
    with pytest.raises(RankFailed, match="abandoned before rank 1's marker landed: the trainer went"):
        await index.mark_durable("j", 1, "host", 1, 2, "s1")
    status = await status_of(index, "j", 1)
    assert status.complete == frozenset() and status.failed["host"] == "rank 1: the trainer went"
    assert await index.mark_durable("j", 1, "host", 0, 1, "s2")  # another session's commit is its own
    await index.begin("j", 2, ["host", "disk"])
    assert await index.mark_durable("j", 2, "host", 0, 1, "s1")
    assert not await index.abandon("j", 2, "host", "s1", 0, "too late")  # complete first: the caller drains
    status = await status_of(index, "j", 2)
    assert status.complete == {"host"} and status.failed == {}
    await index.unmark("j", 1, "host")  # retention drops the abandonment with the tier's records
    await index.begin("j", 1, ["host"])
    assert await index.mark_durable("j", 1, "host", 0, 1, "s1")
