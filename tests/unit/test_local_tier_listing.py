"""A local tier's listing cuts each folder's part of the keys once, not per file, in one scandir per folder: a tier
keeping ten thousand checkpoints holds 40,000 files, and os.path.relpath per file (and os.walk's join and islink per
folder) were most of a listing's CPU (1.27 s -> 0.40 s)."""
import os
import shutil

import pytest

from tiered_ckpt.storage.tiers.local import LocalOptions, LocalTier


async def test_a_listing_works_out_no_path_per_file(tmp_path, monkeypatch):
    """Failed on the old code: one os.path.relpath per file (40 here)."""
    tier = LocalTier("disk", LocalOptions(path=str(tmp_path) + "/"))  # (a trailing slash: the keys are the same)
    keys = sorted(f"job/step-{s:012d}/ix-1/a/{name}" for s in range(10) for name in ("manifest", "part-0", "x", "y"))
    for key in keys:
        (tmp_path / key).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / key).write_bytes(b"1")
    (tmp_path / "job" / "step-000000000003" / ".tmp-part").write_bytes(b"")  # a write in progress: not a key
    (tmp_path / "job" / "step-000000000004" / "link").symlink_to(tmp_path / "job" / "step-000000000005")  # as
    # os.walk: a link to a folder is neither followed nor listed
    calls = [0]
    real = os.path.relpath

    def counted(*args, **kwargs):
        calls[0] += 1
        return real(*args, **kwargs)

    monkeypatch.setattr(os.path, "relpath", counted)
    assert await tier.list("job/") == keys
    assert await tier.list("") == keys
    assert await tier.list_from("job/", "job/step-000000000008") == keys[-8:]
    assert calls[0] == 0


async def test_a_step_folder_this_tier_makes_joins_its_kept_names_without_a_listing(tmp_path, monkeypatch):
    """Failed on the old code: a save's own new step folder changed the job folder, so the next look (a writer's
    retention pass after its first save) listed and sorted every step folder again (10,000: 5 ms). Now the name is
    put among the kept ones; a folder made by someone else still sends the next look to the folder."""
    from tiered_ckpt.storage.tiers import local

    tier = LocalTier("disk", LocalOptions(path=str(tmp_path)))
    for s in range(5):
        await tier.write(f"job/step-{s:012d}/ix-1/a/part-0", memoryview(b"1"))
    listed = _count_job_listings(monkeypatch, local)
    names = [f"step-{s:012d}" for s in range(5)]
    assert await tier.list_names("job/") == names and listed[0] == 1
    await tier.write("job/step-000000000007/ix-1/a/part-0", memoryview(b"1"))  # this tier's own new step folder
    await tier.write("job/step-000000000007/ix-1/a/part-1", memoryview(b"1"))  # (in it: the job folder as it was)
    assert await tier.list_names("job/") == [*names, "step-000000000007"] and listed[0] == 1
    assert await tier.list_from("job/", "job/step-000000000007") == ["job/step-000000000007/ix-1/a/part-0",
                                                                     "job/step-000000000007/ix-1/a/part-1"]
    os.mkdir(tmp_path / "job" / "step-000000000006")  # another process's
    assert await tier.list_names("job/") == [*names, "step-000000000006", "step-000000000007"] and listed[0] == 2


def _count_job_listings(monkeypatch, local) -> list[int]:
    listed = [0]
    real = local.os.listdir

    def counted(path):
        listed[0] += str(path).endswith("/job")
        return real(path)

    monkeypatch.setattr(local.os, "listdir", counted)
    return listed


async def test_a_new_writer_reads_its_predecessors_newest_names_instead_of_listing_the_job_folder(tmp_path,
                                                                                                  monkeypatch):
    """Failed on the old code: a new process's first look at a job's newest step folders (a writer's start,
    retention's first pass) listed and sorted every step folder of the job (10,000: 5-9 ms). Now the writer before
    it kept the newest names with the folder's stamp (`<root>/.tmp-names/job`), its own steps and its probe
    included, and the next process reads them while the folder is as it left it."""
    from tiered_ckpt.storage.tiers import local

    first = LocalTier("disk", LocalOptions(path=str(tmp_path)))
    for s in range(200):
        await first.write(f"job/step-{s:012d}/ix-1/a/part-0", memoryview(b"1"))
    listed = _count_job_listings(monkeypatch, local)
    names = [f"step-{s:012d}" for s in range(200)]
    assert await first.list_names("job/", names[190]) == names[190:] and listed[0] == 1
    for s in (200, 201):  # its own steps after the look
        await first.write(f"job/step-{s:012d}/ix-1/a/part-0", memoryview(b"1"))
    names += ["step-000000000200", "step-000000000201"]
    await first.delete("job/step-000000000195/")  # and its own removal
    names.remove("step-000000000195")
    assert await first.list_names("job/", names[190]) == names[190:] and listed[0] == 1

    second = LocalTier("disk", LocalOptions(path=str(tmp_path)))  # the next process
    await second.probe("job/.probe-1a2b-r0")  # a writer's start probes the tier first
    assert await second.list_names("job/", "step-000000000199") == names[-3:] and listed[0] == 1
    assert await second.list_names("job/", names[-local.TAIL_NAMES]) == names[-local.TAIL_NAMES:]
    assert await second.list_from("job/", "job/step-000000000201") == ["job/step-000000000201/ix-1/a/part-0"]
    assert listed[0] == 1
    assert await second.list_names("job/", names[0]) == names and listed[0] == 2  # below what was kept: listed
    assert await second.list("job/") == sorted(f"job/{n}/ix-1/a/part-0" for n in names)  # the file is no key
    assert await second.list("") == sorted(f"job/{n}/ix-1/a/part-0" for n in names)


@pytest.mark.parametrize("change", ["made", "removed", "crash", "torn", "renamed"])
async def test_kept_names_are_not_used_once_the_job_folder_changed_behind_them(tmp_path, monkeypatch, change):
    """Whatever changed the job folder since its names were kept (another process's step or leftovers, a removal, a
    crash between a step folder made and the names kept, a torn file) sends the next look to the folder, which
    then finds what is there."""
    from tiered_ckpt.storage.tiers import local

    first = LocalTier("disk", LocalOptions(path=str(tmp_path)))
    for s in range(100):
        await first.write(f"job/step-{s:012d}/ix-1/a/part-0", memoryview(b"1"))
    names = [f"step-{s:012d}" for s in range(100)]
    assert await first.list_names("job/", names[90]) == names[90:]
    if change == "made":  # another incarnation's (or rank's) step folder
        os.makedirs(tmp_path / "job" / "step-000000000100" / "ix-2" / "b")
        names.append("step-000000000100")
    elif change == "removed":
        shutil.rmtree(tmp_path / "job" / "step-000000000095")
        names.remove("step-000000000095")
    elif change == "crash":  # the step folder made, the process killed before its names were kept
        monkeypatch.setattr(local, "_write_tail", lambda path, tail: (_ for _ in ()).throw(OSError("killed")))
        await first.write("job/step-000000000100/ix-1/a/part-0", memoryview(b"1"))
        names.append("step-000000000100")
    elif change == "torn":
        path = tmp_path / local.TAILS / "job"
        path.write_bytes(path.read_bytes()[:-3])
    else:  # the job folder replaced by another (a restore from a copy): another inode
        os.rename(tmp_path / "job", tmp_path / "old")
        shutil.copytree(tmp_path / "old", tmp_path / "job")
    listed = _count_job_listings(monkeypatch, local)
    second = LocalTier("disk", LocalOptions(path=str(tmp_path)))
    assert await second.list_names("job/", names[90]) == names[90:]
    assert listed[0] == 1
