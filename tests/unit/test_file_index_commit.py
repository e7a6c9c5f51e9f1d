"""The file index's commit costs the same per rank at any world size (issue 43, S2): a marker and a rank's poll
never list the markers' folder (listing `durable/` after every marker made a commit O(R^2): 16.8 s at 1,024
ranks), and the last marker still commits the tier exactly once, with ranks racing in threads and in
processes. Counted with Python's audit events (every os.listdir, os.scandir, open and link the index makes),
on real files."""
import asyncio
import json
import subprocess
import sys

from tiered_ckpt.layout import step_dir
from tiered_ckpt.storage.index.file import FileIndex

from .test_cli import REPO

FILE_OPERATIONS = {"os.listdir", "os.scandir", "open", "os.link", "os.rename", "os.remove", "os.mkdir"}
_events: list[tuple[str, str]] = []
_recording = [False]


def _hook(event: str, args: tuple) -> None:
    if event in FILE_OPERATIONS and _recording[0]:
        _events.append((event, str(args[0]) if args else ""))


sys.addaudithook(_hook)  # for the life of the process: gated by _recording


async def _commit(index: FileIndex, world: int, step: int) -> list[list[tuple[str, str]]]:
    """Every rank of a world of `world` marks tier "disk" durable and polls once, one after the other; the file
    operations of each rank's marker and poll. Exactly the last marker commits."""
    per_rank = []
    committed = []
    for rank in range(world):
        _events.clear()
        _recording[0] = True
        try:
            committed.append(await index.mark_durable("job", step, "disk", rank, world, "s1"))
            state = await index.tier_state("job", step, "disk", "s1", rank=rank)
        finally:
            _recording[0] = False
        per_rank.append(list(_events))
        assert rank in state.ranks_done
        assert state.state == ("complete" if rank == world - 1 else "pending"), (rank, state)
    assert committed == [False] * (world - 1) + [True]
    assert (await index.tier_state("job", step, "disk", "s1")).ranks_done == frozenset(range(world))
    return per_rank


async def test_a_marker_and_a_poll_list_no_folder_and_cost_the_same_at_any_world_size(tmp_path):
    index = FileIndex(tmp_path / "index")
    await index.open()
    small, large = await _commit(index, 8, 1), await _commit(index, 64, 2)
    listings = [(rank, path) for rank, events in enumerate(large) for e, path in events
                if e in ("os.listdir", "os.scandir") and path.endswith("/durable")]
    assert listings == [], listings[:3]  # before: durable/ listed after each marker and on each poll
    # a rank in the middle (neither the first, which makes the folders, nor the last, which commits) makes the
    # same file operations in a world of 8 as in a world of 64
    assert [e for e, _ in small[4]] == [e for e, _ in large[4]] == [e for e, _ in large[40]], (small[4], large[40])
    await index.close()


async def test_markers_count_per_session_and_a_retried_marker_once(tmp_path):
    index = FileIndex(tmp_path / "index")
    for rank in range(3):  # an earlier, crashed attempt of the same step: 3 of 4 ranks marked
        assert not await index.mark_durable("job", 1, "disk", rank, 4, "old")
    assert not await index.mark_durable("job", 1, "disk", 0, 4, "new")
    assert not await index.mark_durable("job", 1, "disk", 0, 4, "new")  # a retry: still one rank
    assert not await index.mark_durable("job", 1, "disk", 1, 4, "new")
    assert not await index.mark_durable("job", 1, "disk", 2, 4, "new")
    assert (await index.tier_state("job", 1, "disk", "new")).ranks_done == {0, 1, 2}
    assert await index.mark_durable("job", 1, "disk", 3, 4, "new")
    assert (await index.tier_state("job", 1, "disk", "new", rank=3)).state == "complete"
    assert not await index.mark_durable("job", 1, "disk", 3, 4, "old")  # the old session completes nothing new
    await index.unmark("job", 1, "disk")  # retention: the tier's markers and tallies go with its commit
    assert list((tmp_path / "index" / "job").glob("*/tallies/disk.*")) == []
    assert list((tmp_path / "index" / "job").glob("*/durable/disk.*")) == []


async def test_concurrent_ranks_in_threads_commit_exactly_once(tmp_path):
    index = FileIndex(tmp_path / "index")
    for step in range(1, 21):
        results = await asyncio.gather(*(index.mark_durable("job", step, "disk", r, 16, "s") for r in range(16)))
        assert sum(results) == 1, (step, results)
        assert (await index.tier_state("job", step, "disk", "s", rank=0)).state == "complete"


RANKS_OF_A_PROCESS = """
import asyncio, json, sys
from tiered_ckpt.layout import step_dir
from tiered_ckpt.storage.index.file import FileIndex
root, first, count, world, steps = sys.argv[1], *map(int, sys.argv[2:])
async def main():
    index = FileIndex(root)
    out = []
    for step in range(1, steps + 1):
        out.append(sum(await asyncio.gather(*(index.mark_durable("job", step, "disk", r, world, "s")
                                              for r in range(first, first + count)))))
    print(json.dumps(out))
asyncio.run(main())
"""


def test_concurrent_ranks_in_processes_commit_exactly_once(tmp_path):
    """4 processes of 6 ranks each, on one folder (as ranks of one machine, or of several on a shared file
    system): every step commits once, whichever rank's marker is the last."""
    steps, procs = 15, []
    for p in range(4):
        procs.append(subprocess.Popen([sys.executable, "-c", RANKS_OF_A_PROCESS, str(tmp_path / "index"),
                                       str(6 * p), "6", "24", str(steps)], cwd=REPO, stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, text=True))
    commits = []
    for proc in procs:
        out, err = proc.communicate(timeout=120)
        assert proc.returncode == 0, err
        commits.append(json.loads(out))
    assert [sum(c[i] for c in commits) for i in range(steps)] == [1] * steps, commits
    assert all((tmp_path / "index" / "job" / step_dir(s) / "complete" / "disk").exists()
               for s in range(1, steps + 1))
