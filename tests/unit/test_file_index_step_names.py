"""The file index keeps each job folder's sorted step names and lists the folder again only once something else
changed it: a writer's own saves (begin, delete) never list it again, another process's change is seen."""
import os

import pytest

from tiered_ckpt.storage.index import file as file_index
from tiered_ckpt.storage.index.file import FileIndex


async def test_own_saves_do_not_list_the_job_folder_again_and_another_processs_change_is_seen(tmp_path,
                                                                                           monkeypatch):
    listed = [0]
    real = file_index._step_names

    def counted(base):
        listed[0] += 1
        return real(base)

    monkeypatch.setattr(file_index, "_step_names", counted)
    monkeypatch.setattr(file_index, "_racy", lambda mtime_ns: -1)  # (listings here are a tick from the changes)
    index = FileIndex(tmp_path / "index")
    await index.open()
    await index.fence("j")
    for step in (1, 2, 3):
        await index.begin("j", step, ["disk"])
    assert [s.step for s in await index.list_range("j", 2)] == [2, 3]
    listed[0] = 0
    for step in (4, 5):
        await index.begin("j", step, ["disk"])
        assert [s.step for s in await index.list_range("j", step)] == [step]
    await index.delete("j", 1)
    assert [s.step for s in await index.list("j")] == [2, 3, 4, 5]
    assert listed[0] == 0  # the writer's own changes: the names were kept up to date in place
    other = FileIndex(tmp_path / "index")  # another process: a CLI's delete, another rank's begin
    await other.begin("j", 9, ["disk"])
    await other.delete("j", 3)
    assert [s.step for s in await index.list("j")] == [2, 4, 5, 9]
    assert listed[0] == 1
    os.rename(tmp_path / "index" / "j" / "step-000000000009", tmp_path / "index" / "j" / "step-000000000010")
    assert [s.step for s in await index.list_range("j", 10)] == [10]


@pytest.mark.parametrize("links", ["counted", "one"])
async def test_another_processs_step_made_in_the_tick_of_a_listing_is_seen(tmp_path, monkeypatch, links):
    """On a file system whose times are coarse, another process's change in the same tick as this process's
    listing leaves the folder's time as it was. Its link count tells where it counts subfolders; elsewhere (btrfs:
    one link, simulated) a listing made in the tick of the last change is read again at the next look. A step
    asked for by name is read from its folder whatever the names say."""
    if links == "one":
        real = file_index._stamp
        monkeypatch.setattr(file_index, "_stamp", lambda base: None if (s := real(base)) is None else (*s[:2], 1))
    index, other = FileIndex(tmp_path / "index"), FileIndex(tmp_path / "index")
    await index.open()
    await index.fence("j")
    await index.begin("j", 1, ["disk"])
    job = tmp_path / "index" / "j"
    assert [s.step for s in await index.list("j")] == [1]
    was = os.stat(job).st_mtime_ns
    await other.begin("j", 2, ["disk"])
    os.utime(job, ns=(was, was))  # the same tick: the folder's time did not move
    assert [s.step for s in await index.list_range("j", 0, also=[2])] == [1, 2]
    assert [s.step for s in await index.list("j")] == [1, 2]
