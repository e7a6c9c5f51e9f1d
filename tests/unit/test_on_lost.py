"""[engine] on_lost: what a load does when the newest checkpoint the index lists complete is lost (its parts gone
from every tier, as when the nodes that held it are lost), and that the run can then save its steps again: a
launcher's restart never loops on a checkpoint that no one can load."""
import shutil

import pytest
import torch

import tiered_ckpt as tc

from .common import load_values, state_of


def lose(tmp_path, shm_dir, step: int) -> None:
    """Every tier's copy of `step` gone (the memory tier's and the disk's folders), the index untouched."""
    for root in (shm_dir / "host", tmp_path / "disk"):
        for folder in root.glob(f"test/step-{step:012d}"):
            shutil.rmtree(folder)


async def saved(make_config, *steps: int, **engine) -> None:
    async with tc.Engine(make_config(**engine)) as e:
        for step in steps:
            await (await e.save(step, state_of(float(step)))).wait()


async def test_previous_loads_the_newest_that_can_be_loaded_and_the_lost_step_can_be_saved_again(
        make_config, tmp_path, shm_dir):
    await saved(make_config, 1, 2)
    lose(tmp_path, shm_dir, 2)
    async with tc.Engine(make_config()) as e:  # on_lost = "previous", the default
        info, out = await load_values(e)
        assert info.step == 1 and torch.all(out["w"] == 1.0)
        await (await e.save(2, state_of(20.0))).wait()  # before: CheckpointExists (the index listed step 2)
        info, out = await load_values(e)
        assert info.step == 2 and torch.all(out["w"] == 20.0)


async def test_error_refuses_to_go_back_silently(make_config, tmp_path, shm_dir):
    await saved(make_config, 1, 2)
    lose(tmp_path, shm_dir, 2)
    async with tc.Engine(make_config(on_lost="error")) as e:
        with pytest.raises(tc.CheckpointLost, match=r"newest checkpoint\(s\) \[2\].*step 1 can"):
            await load_values(e)
        assert [s.step for s in await e.statuses() if s.is_complete] == [1, 2]  # nothing removed


async def test_a_first_checkpoint_lost_wedges_by_default_and_starts_fresh_unattended_with_fresh(
        make_config, tmp_path, shm_dir):
    await saved(make_config, 4)
    lose(tmp_path, shm_dir, 4)
    async with tc.Engine(make_config()) as e:
        with pytest.raises(tc.CheckpointLost, match='on_lost = "fresh"'):
            await load_values(e)
    for attempt in range(2):  # a launcher restarting the job: it starts fresh, saves step 4 again, then resumes
        async with tc.Engine(make_config(on_lost="fresh")) as e:
            if attempt == 0:
                with pytest.raises(tc.FreshStart, match=r"starting fresh.*\[4\]") as err:
                    await load_values(e)
                assert isinstance(err.value, tc.IncompleteCheckpoint) and not isinstance(err.value, tc.CheckpointLost)
                await (await e.save(4, state_of(40.0))).wait()
            else:
                info, out = await load_values(e)
                assert info.step == 4 and torch.all(out["w"] == 40.0)


def test_on_lost_takes_one_of_three_words(make_config):
    with pytest.raises(tc.ConfigError, match="engine.on_lost"):
        make_config(on_lost="retry")
