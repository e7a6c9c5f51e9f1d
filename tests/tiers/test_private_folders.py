"""The memory tier's folder sits in a shared, world-writable /dev/shm under a predictable name: one another
local user made beforehand (open to all, or theirs, or a symbolic link to theirs) is refused at open, naming
owner and mode, with nothing written into it. Folders the library makes are 0700 whatever the umask (the
memory and disk tiers, the file index's)."""
import asyncio
import os
import stat
from pathlib import Path

import pytest
import torch

import tiered_ckpt as tc
from tiered_ckpt.testing.configs import stack_dict, write_toml

NOBODY = 65534


def write_config(tmp_path: Path, shm: Path) -> Path:
    return write_toml(tmp_path / "tiers.toml", stack_dict(tmp_path, {"kind": "memory", "path": str(shm)}, "local",
                                                         job="private", part_size=None))


async def save_one(config: Path) -> None:
    async with tc.Engine.from_toml(config) as engine:
        await (await engine.save(1, {"w": torch.ones(1000)})).wait()


def mode_of(path: Path) -> int:
    return stat.S_IMODE(os.lstat(path).st_mode)


@pytest.mark.parametrize("how", ["open to all", "another user's", "a link to another user's folder"])
def test_a_squatted_memory_folder_is_refused_at_open_naming_owner_and_mode(tmp_path, how):
    shm = tmp_path / "shm" / "tiered_ckpt-user"
    shm.parent.mkdir()
    if how == "open to all":
        shm.mkdir()
        os.chmod(shm, 0o777)
    elif how == "another user's":
        shm.mkdir(mode=0o700)
        os.chown(shm, NOBODY, NOBODY)
    else:
        theirs = tmp_path / "theirs"
        theirs.mkdir(mode=0o700)
        shm.symlink_to(theirs)
    with pytest.raises(tc.TierError) as refused:
        asyncio.run(save_one(write_config(tmp_path, shm)))
    message = str(refused.value)
    assert "tier 'host'" in message and str(shm) in message
    expected = {"open to all": "mode 0777", "another user's": "uid 65534",
                "a link to another user's folder": "symbolic link"}[how]
    assert expected in message
    assert not any(shm.resolve().iterdir())  # nothing of the job went into it


def test_folders_the_library_makes_are_private_whatever_the_umask(tmp_path):
    old = os.umask(0o022)
    try:
        shm = tmp_path / "shm" / "tiered_ckpt-user"
        asyncio.run(save_one(write_config(tmp_path, shm)))
    finally:
        os.umask(old)
    assert mode_of(shm) == 0o700
    assert mode_of(tmp_path / "disk") == 0o700
    assert mode_of(tmp_path / "index") == 0o700 and mode_of(tmp_path / "index" / "private") == 0o700
    # and its own folder, once made, is accepted again by the next run
    asyncio.run(save_one_more(write_config(tmp_path, shm)))


async def save_one_more(config: Path) -> None:
    async with tc.Engine.from_toml(config) as engine:
        await (await engine.save(2, {"w": torch.ones(1000)})).wait()
        assert [s.step for s in await engine.statuses()] == [1, 2]
