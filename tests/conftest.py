"""Shared fixtures: a real on-disk config with a memory tier in /dev/shm and a local-disk tier."""
from __future__ import annotations

import shutil
import tempfile
from pathlib import Path
from typing import Any, Callable

import pytest

import tiered_ckpt as tc
from tiered_ckpt.config import parse_config


@pytest.fixture
def shm_dir():
    base = "/dev/shm" if Path("/dev/shm").is_dir() else None
    d = Path(tempfile.mkdtemp(prefix="tiered_ckpt-test-", dir=base))
    yield d
    shutil.rmtree(d, ignore_errors=True)


def config_dict(tmp_path: Path, shm_dir: Path, **engine: Any) -> dict[str, Any]:
    return {
        "engine": {"job": "test", "index": f"file://{tmp_path}/index", "part_size": "64KiB", **engine},
        "tiers": [
            {"name": "host", "kind": "memory", "path": str(shm_dir / "host"), "capacity": "1GiB"},
            {"name": "disk", "kind": "local", "path": str(tmp_path / "disk")},
        ],
    }


@pytest.fixture
def make_config(tmp_path, shm_dir) -> Callable[..., tc.Config]:
    """make_config(engine_key=value, ..., tiers=[...overrides per tier...])"""

    def make(tiers: list[dict[str, Any]] | None = None, **engine: Any) -> tc.Config:
        raw = config_dict(tmp_path, shm_dir, **engine)
        for base, extra in zip(raw["tiers"], tiers or []):
            base.update(extra)
        return parse_config(raw)

    return make


@pytest.fixture
async def engine(make_config):
    async with tc.Engine(make_config()) as e:
        yield e
