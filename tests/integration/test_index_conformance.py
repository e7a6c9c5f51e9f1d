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


class WithoutBatchedReads:
    """A third party's index written before `get_rank_metas` existed (not subclassing Index): every call but
    that one goes to a file index."""

    def __init__(self, inner: FileIndex):
        object.__setattr__(self, "_inner", inner)

    def __getattr__(self, name):
        if name == "get_rank_metas":
            raise AttributeError(name)
        return getattr(self._inner, name)

    def __setattr__(self, name, value):
        setattr(self._inner, name, value)


class TestIndexWithoutBatchedReads(IndexConformance):
    @pytest.fixture
    def make_index(self, tmp_path):
        return lambda: WithoutBatchedReads(FileIndex(tmp_path / "index"))


class TestFileIndexWithItsSummary(IndexConformance):
    """The file index with its summary of settled checkpoints in use from the first step (file_summary.py),
    written after every listing."""

    @pytest.fixture
    def make_index(self, tmp_path, monkeypatch):
        from tiered_ckpt.storage.index import file_summary

        monkeypatch.setattr(file_summary, "LISTED_FROM", 0)
        monkeypatch.setattr(file_summary, "REWRITE_AFTER", 0)
        return lambda: FileIndex(tmp_path / "index")
