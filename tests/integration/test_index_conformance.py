"""Both indexes pass the one Index conformance suite: the file index on disk, the Redis index on a real
redis-server."""
import pytest

from tiered_ckpt.storage.index.file import FileIndex
from tiered_ckpt.storage.index.redis import RedisIndex
from tiered_ckpt.testing import IndexConformance


class TestFileIndex(IndexConformance):
    @pytest.fixture
    def make_index(self, tmp_path):
        return lambda: FileIndex(tmp_path / "index")


class TestRedisIndex(IndexConformance):
    @pytest.fixture
    def make_index(self, redis_server):
        url = redis_server().url
        return lambda: RedisIndex(url)
