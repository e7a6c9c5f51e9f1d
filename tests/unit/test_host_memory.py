"""Host memory a user can see and free (#31 items 2 and 3): `ls` shows the RAM a job holds in the memory tier,
`gc` reclaims a process's staging buffers once it died (kill -9), `free` gives a job's memory-tier copies back
through the index (refused while no other tier holds the newest checkpoint, unless forced), and neither `gc
--other-indexes` nor `free --force` touches what a live trainer of another index holds. Real trainers in
subprocesses, killed for real; the CLI as a subprocess; no mocks."""
import asyncio
import json
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import tiered_ckpt as tc

from .test_cli import REPO, write_config

TRAINER = """
import asyncio, sys, torch, tiered_ckpt as tc
async def main():
    async with tc.Engine.from_toml(sys.argv[1]) as engine:
        for step in map(int, sys.argv[2].split(",")):
            await (await engine.save(step, {"w": torch.full((50_000,), float(step))})).wait()
        print("saved", flush=True)
        await asyncio.get_running_loop().run_in_executor(None, sys.stdin.readline)  # until told, or killed
asyncio.run(main())
"""


def cli(config: Path, *argv: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "tiered_ckpt.cli", "-c", str(config), *argv], cwd=REPO,
                          capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL)


def start_trainer(config: Path, steps: str) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-c", TRAINER, str(config), steps], cwd=REPO, stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    line = proc.stdout.readline()
    if line != "saved\n":
        proc.kill()
        raise AssertionError(f"the trainer did not save: {line!r} {proc.communicate()[1]}")
    return proc


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.kill()
    proc.communicate()


def ram(config: Path) -> dict:
    out = cli(config, "ls", "--json")
    assert out.returncode == 0, out.stderr
    (entry,) = json.loads(out.stdout)["host_memory"]
    return entry


def files(root: Path) -> dict[str, int]:
    return {str(p.relative_to(root)): p.stat().st_size for p in sorted(root.rglob("*")) if p.is_file()}


def load(config: Path) -> tuple[int, str, float]:
    async def run():
        async with tc.Engine.from_toml(config) as engine:
            state = {"w": torch.zeros(50_000)}
            info = await engine.load(state)
            return info.step, info.tier, float(state["w"][0])

    return asyncio.run(run())


def test_a_killed_trainers_staging_buffers_are_shown_by_ls_and_reclaimed_by_gc(tmp_path, shm_dir):
    """keep_last = 1 on the memory tier: step 1's files come back as a free staging buffer when step 2 commits;
    kill -9 leaves them in the dead process's staging folder, RAM that only gc (or free) gives back."""
    config = write_config(tmp_path, shm_dir, host_keep=1)
    trainer = start_trainer(config, "1,2")
    try:
        live = ram(config)
        assert live["staging"] > 0 and live["staging_dead"] == 0  # a live trainer's buffer
        listed = cli(config, "gc", "--dry-run")
        assert ".staging/" not in listed.stdout, listed.stdout  # never offered while its process lives
    finally:
        trainer.send_signal(signal.SIGKILL)
        stop(trainer)
    dead = ram(config)
    assert dead["staging_dead"] == dead["staging"] == live["staging"] > 0
    assert dead["nbytes"] == dead["checkpoints"] + dead["staging"] and dead["checkpoints"] > 0
    text = cli(config, "ls").stdout
    assert "left by processes that died: `tiered-ckpt gc` frees it" in text and "RAM on this machine" in text
    dry = cli(config, "gc", "--dry-run", "--json")
    doc = json.loads(dry.stdout)
    staging = [r for r in doc["removed"] if r["name"].startswith(".staging/cli-")]
    assert dry.returncode == 0 and len(staging) == 1 and staging[0]["nbytes"] == dead["staging"], dry.stdout
    assert staging[0]["tier"] == "host" and "died" in staging[0]["what"]
    assert ram(config)["staging_dead"] == dead["staging"]  # the dry run changed nothing
    done = cli(config, "gc")
    assert done.returncode == 0 and "removed host" in done.stdout and ".staging/cli-" in done.stdout, done.stdout
    after = ram(config)
    assert after["staging"] == after["staging_dead"] == 0 and after["checkpoints"] == dead["checkpoints"]
    assert not [p for p in (shm_dir / "host" / ".staging").iterdir()]
    assert load(config) == (2, "host", 2.0)  # the checkpoints themselves untouched


def test_free_is_refused_while_only_host_memory_holds_the_newest_and_forced_loses_what_it_names(tmp_path, shm_dir):
    """The disk takes even steps only (`every = 2`): steps 1 and 3 are complete in host memory alone. The refusal
    names both, and --force loses both, as it says (before: the refusal named step 3 alone, and --force lost
    step 1 too)."""
    config = write_config(tmp_path, shm_dir)
    config.write_text(config.read_text() + "every = 2\n")  # on the last tier: disk
    trainer = start_trainer(config, "1,2,3")
    stop(trainer)  # its staging folder goes when it closes: the checkpoints' RAM is left
    disk = files(tmp_path / "disk")
    before = files(shm_dir / "host")
    refused = cli(config, "free", "--yes")
    assert refused.returncode == 2 and refused.stdout == "", refused
    assert refused.stderr.strip().splitlines() == [refused.stderr.strip()]  # one line
    assert "step 3, is complete only in host memory (host)" in refused.stderr and "--force" in refused.stderr
    assert "and with it step 1, also complete only there" in refused.stderr, refused.stderr
    assert files(shm_dir / "host") == before and files(tmp_path / "disk") == disk
    assert cli(config, "free", "--dry-run").returncode == 2
    dry = cli(config, "free", "--force", "--dry-run", "--json")
    (job,) = json.loads(dry.stdout)["jobs"]
    assert dry.returncode == 0 and job["lost"] == [1, 3] and "and with it step 1" in job["refused"], dry
    lost = {r["step"] for r in job["removed"] if "the checkpoint is lost" in r["what"]}
    assert lost == {1, 3}
    forced = cli(config, "free", "--force", "--yes")
    assert forced.returncode == 0, forced
    assert "the only complete one: the checkpoint is lost" in forced.stdout
    assert "lost checkpoint(s) 1, 3: complete in host memory alone" in forced.stdout, forced.stdout
    assert not [k for k in files(shm_dir / "host") if k.startswith("cli/")]
    assert files(tmp_path / "disk") == disk  # only the memory tier's data went
    listed = json.loads(cli(config, "ls", "--json").stdout)
    assert [(c["step"], c["complete_on"]) for c in listed["checkpoints"]] == [(2, ["disk"])]
    assert listed["host_memory"][0]["nbytes"] == 0
    assert load(config) == (2, "disk", 2.0)


def test_free_gives_the_memory_tier_back_through_the_index_and_loads_come_from_disk(tmp_path, shm_dir):
    config = write_config(tmp_path, shm_dir)
    stop(start_trainer(config, "1,2"))
    disk = files(tmp_path / "disk")
    held = ram(config)["checkpoints"]
    dry = cli(config, "free", "--dry-run", "--json")
    doc = json.loads(dry.stdout)
    assert dry.returncode == 0 and doc["dry_run"] and doc["nbytes"] == held, dry
    assert [(r["tier"], r["step"]) for r in doc["jobs"][0]["removed"]] == [("host", 1), ("host", 2)]
    assert ram(config)["checkpoints"] == held  # nothing changed
    done = cli(config, "free")  # stdin is no terminal: not asked
    assert done.returncode == 0 and "freed 2 item(s)" in done.stdout, done
    assert ram(config)["nbytes"] == 0 and files(tmp_path / "disk") == disk
    listed = json.loads(cli(config, "ls", "--json").stdout)["checkpoints"]
    assert [(c["step"], c["tiers"], c["complete_on"]) for c in listed] == [(1, ["disk"], ["disk"]),
                                                                           (2, ["disk"], ["disk"])]
    assert load(config) == (2, "disk", 2.0)
    assert cli(config, "verify").returncode == 0


@pytest.mark.parametrize("stage_in_memory_tier", [True, False])  # the live signs: its staging lock, its lease
def test_other_indexes_folders_of_a_live_writer_are_never_offered(tmp_path, shm_dir, stage_in_memory_tier):
    """Two runs of job `cli` share the tiers' folders with an index each; `gc --other-indexes` and `free
    --force` from run A keep every folder of B while B's trainer lives (by its staging folder's lock, or, when
    it does not stage in the memory tier, by its index's writer lease), and offer them once it is killed."""
    a = write_config(tmp_path, shm_dir, host_keep=4)  # keep_last set: the memory tier can be the staging buffer
    b_dir = tmp_path / "b"
    b_dir.mkdir()
    b = b_dir / "c.toml"
    b.write_text(a.read_text().replace(f"file://{tmp_path}/index", f"file://{b_dir}/index")
                 .replace('part_size = "64KiB"\n', f'part_size = "64KiB"\nstage_in_memory_tier = '
                                                   f'{str(stage_in_memory_tier).lower()}\n'))
    stop(start_trainer(a, "1"))
    trainer = start_trainer(b, "5,6")
    try:
        shm_b = {k for k in files(shm_dir / "host") if "step-000000000005" in k or "step-000000000006" in k}
        disk_b = {k for k in files(tmp_path / "disk") if "step-000000000005" in k or "step-000000000006" in k}
        assert shm_b and disk_b
        dry = cli(a, "gc", "--other-indexes", "--dry-run", "--json")
        doc = json.loads(dry.stdout)
        assert dry.returncode == 0 and [r for r in doc["removed"] if r["step"] in (5, 6)] == [], dry.stdout
        kept = [k for k in doc["kept"] if "another index's folders" in k]
        assert len(kept) == 2 and all("step(s) 5, 6" in k for k in kept), doc["kept"]  # host and disk
        why = "its staging folder is locked" if stage_in_memory_tier else "the writer lease is held"
        assert all(why in k for k in kept), kept
        assert cli(a, "gc", "--other-indexes").returncode == 0
        # a part of an earlier release's format (no incarnation folder) right in step 5's folder: its prefix is
        # the whole step folder, B's live one included
        legacy = shm_dir / "host" / "cli" / "step-000000000005" / "rank-00000" / "part-000000"
        legacy.parent.mkdir(parents=True)
        legacy.write_bytes(b"x" * 100)
        forced = cli(a, "free", "--force", "--yes")
        assert forced.returncode == 0 and "kept host step 5" in forced.stdout, forced
        assert shm_b <= set(files(shm_dir / "host")) and disk_b <= set(files(tmp_path / "disk"))
        assert not legacy.exists()  # removed key by key
    finally:
        trainer.send_signal(signal.SIGKILL)
        stop(trainer)
    dry = json.loads(cli(a, "gc", "--other-indexes", "--dry-run", "--json").stdout)
    assert {r["step"] for r in dry["removed"] if r["tier"] is not None and r["step"] is not None} == {5, 6}, dry


def test_free_of_a_job_without_host_memory_says_so_and_creates_nothing(tmp_path, shm_dir):
    config = write_config(tmp_path, shm_dir, host_keep=2)
    out = cli(config, "--job", "nosuch", "free", "--yes")
    assert out.returncode == 0 and "job 'nosuch' holds no host memory" in out.stdout, out
    assert not (tmp_path / "index" / "nosuch").exists()  # no lease file made for a job that is not there
