"""The file index keeps each job folder's sorted step names and lists the folder again only once something else
changed it: a writer's own saves (begin, delete) never list it again, another process's change is seen."""
import os

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
