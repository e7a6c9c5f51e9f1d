"""The command line: ls (size, local time with zone), show (plain values, aligned keys), config check (every
effective key, human sizes, no secrets), delete, read-only commands that create nothing, and progress bars
that count what is read and appear only on a terminal. Real engines, real files, `cli.main` in process (or
a subprocess where a terminal is needed)."""
import asyncio
import datetime
import fcntl
import os
import pty
import re
import shutil
import struct
import subprocess
import sys
import termios
import time
import tomllib
from pathlib import Path

import torch

import tiered_ckpt as tc
from tiered_ckpt import cli
from tiered_ckpt.layout import step_dir
from tiered_ckpt.testing.configs import stack_dict, write_toml

REPO = Path(__file__).resolve().parents[2]


def write_config(tmp_path: Path, shm_dir: Path, host_keep: int | None = None, extra: str = "",
                 **engine: object) -> Path:
    """c.toml: host (keep_last = host_keep) and disk; `[engine]` keys as keywords, or as TOML lines in `extra`."""
    host = {"kind": "memory", "keep_last": host_keep or None}
    return write_toml(tmp_path / "c.toml", stack_dict(tmp_path, host, "local", shm=shm_dir, job="cli",
                                                      **tomllib.loads(extra), **engine))


def save(config: Path, steps, state=None, metadata=None) -> None:
    async def run():
        async with tc.Engine.from_toml(config) as engine:
            for step in steps:
                s = state(step) if state else {"w": torch.full((50_000,), float(step))}
                await (await engine.save(step, s, metadata=metadata)).wait()

    asyncio.run(run())


def rows(out: str) -> list[list[str]]:
    return [line.split() for line in out.splitlines() if line.split() and line.split()[0].isdigit()]


def test_ls_shows_size_and_local_time_with_its_zone(tmp_path, shm_dir, capsys, monkeypatch):
    monkeypatch.setenv("TZ", "EST5")  # a zone other than the machine's (UTC here): the output must follow TZ
    time.tzset()
    try:
        config = write_config(tmp_path, shm_dir)
        save(config, [1])
        save(config, [2], state=lambda s: {"w": torch.ones(3, 2**20, dtype=torch.uint8)})

        async def crashed_save():  # begun, never written: its size is not known
            async with tc.Engine.from_toml(config) as engine:
                await engine.store.index.begin("cli", 3, ["host", "disk"])

        asyncio.run(crashed_save())
        assert cli.main(["-c", str(config), "ls"]) == 0
        out = capsys.readouterr().out
        header = out.splitlines()[0].split()
        assert header[:4] == ["step", "created", "size", "state"]
        one, two, three = rows(out)  # step, date, time, zone, size (2 words or "-"), state, tiers
        assert one[4:7] == ["195.31", "KiB", "complete"] and two[4:7] == ["3.00", "MiB", "complete"]
        assert three[4:6] == ["-", "incomplete"]
        assert one[3] == two[3] == "EST"
        shown = datetime.datetime.strptime(f"{one[1]} {one[2]}", "%Y-%m-%d %H:%M:%S")
        expected = datetime.datetime.now(datetime.timezone(datetime.timedelta(hours=-5))).replace(tzinfo=None)
        assert abs((shown - expected).total_seconds()) < 120
    finally:
        monkeypatch.undo()
        time.tzset()


def test_show_lists_plain_values_and_metadata_with_keys_aligned_up_to_a_cap(tmp_path, shm_dir, capsys):
    """Keys are aligned to the longest, but never past cli.KEY_WIDTH: a Lightning checkpoint's long keys padded
    every line to ~210 columns; now only the long key's own line overflows."""
    config = write_config(tmp_path, shm_dir)
    long_key = "a_very_long_name_of_a_setting_that_is_longer_than_any_tensor_path_in_this_state"
    state = {"model": {"weight": torch.ones(4, 4)}, "extra": {"lr": 3e-4, "schedule": [1e-3, 5e-4], long_key: "x",
                                                               "nested": [{"epoch": 2}]}}
    save(config, [5], state=lambda s: state, metadata={"name": "best"})
    assert cli.main(["-c", str(config), "show", "5"]) == 0
    out = capsys.readouterr().out
    lines = out.splitlines()
    for expected in ("extra/lr", "extra/schedule", f"extra/{long_key}", "extra/nested/0/epoch", "name"):
        assert any(line.split()[:1] == [expected] for line in lines), (expected, out)
    values = {line.split()[0]: line.split("=", 1)[1].strip() for line in lines if " = " in line}
    assert values["extra/lr"] == "0.0003" and values["extra/schedule"] == "[0.001, 0.0005]"
    assert values["extra/nested/0/epoch"] == "2" and values["name"] == "'best'"
    assert len(f"extra/{long_key}") > cli.KEY_WIDTH >= len("extra/nested/0/epoch")
    columns = {line.split()[0]: line.index(" = ") for line in lines if " = " in line}
    assert columns.pop(f"extra/{long_key}") == 4 + len(f"extra/{long_key}")  # overflows its own line only
    assert set(columns.values()) == {4 + cli.KEY_WIDTH}  # the others: aligned at the cap
    [tensor] = [line for line in lines if line.split()[:1] == ["model/weight"]]
    assert tensor.index("float32") == 4 + cli.KEY_WIDTH + 1  # the tensor columns line up too


def test_show_aligns_short_keys_to_the_longest_of_them(tmp_path, shm_dir, capsys):
    config = write_config(tmp_path, shm_dir)
    save(config, [5], state=lambda s: {"model": {"weight": torch.ones(4, 4)}, "lr": 0.1}, metadata={"name": "x"})
    assert cli.main(["-c", str(config), "show", "5"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert {line.index(" = ") for line in lines if " = " in line} == {4 + len("model/weight")}


def test_config_check_prints_every_effective_key_with_human_sizes_and_no_password(tmp_path, capsys):
    path = tmp_path / "c.toml"
    path.write_text('[engine]\njob = "j"\nindex = "redis://user:s3cret@index-host:6379/0?sentinel_password=pw2"\n'
                    'part_size = "8MiB"\n'
                    '[[tiers]]\nname = "host"\nkind = "memory"\ncapacity = "1.5GiB"\nkeep_last = 2\n'
                    '[[tiers]]\nname = "peer"\nkind = "redis"\nurls = ["redis://:hunter2@node0:6380"]\nevery = 5\n')
    assert cli.main(["config", "check", str(path)]) == 0
    out = capsys.readouterr().out
    assert "s3cret" not in out and "hunter2" not in out and "pw2" not in out
    assert "redis://user:***@index-host:6379/0?sentinel_password=***" in out
    keys = {}
    section = None
    for line in out.splitlines()[1:]:
        if not line.startswith("    "):
            section = line.strip()
            continue
        key, value = (part.strip() for part in line.split("=", 1))
        keys.setdefault(section, {})[key] = value
    engine, host, peer = keys["[engine]"], keys["[[tiers]] host (kind memory)"], keys["[[tiers]] peer (kind redis)"]
    assert set(engine) >= {"job", "index", "part_size", "max_inflight", "allow_pickle", "adopt", "io_threads",
                           "collective_timeout", "commit_timeout"}
    assert engine["part_size"] == "8 MiB (8388608 bytes)"
    common = {"keep_last", "keep_best", "best_metric", "best_mode", "keep_every", "every", "workers", "inflight",
              "retries", "backoff", "timeout", "skip_when_behind", "required"}
    assert set(host) == common | {"path", "capacity", "fsync"}
    assert set(peer) >= common | {"urls", "node", "prefix", "chunk_size", "connections", "socket_timeout"}
    assert host["capacity"] == "1.50 GiB (1610612736 bytes)" and host["keep_last"] == "2"
    assert host["inflight"] == "256 MiB (268435456 bytes)" and host["skip_when_behind"] == "true"
    assert peer["keep_last"] == "all" and peer["every"] == "5" and peer["chunk_size"] == "64 MiB (67108864 bytes)"


def test_delete_removes_a_checkpoint_and_names_an_unknown_one(tmp_path, shm_dir, capsys):
    config = write_config(tmp_path, shm_dir)
    save(config, [1, 2])
    assert cli.main(["-c", str(config), "delete", "1"]) == 0
    out = capsys.readouterr().out
    assert "deleted step 1 of job 'cli' (complete, 195.31 KiB) from host, disk and the index" in out
    assert not [p for p in [*shm_dir.rglob("*"), *(tmp_path / "disk").rglob("*")] if step_dir(1) in str(p)]
    assert cli.main(["-c", str(config), "delete", "1"]) == 2
    assert "job 'cli' has no checkpoint 1" in capsys.readouterr().err
    assert cli.main(["-c", str(config), "ls"]) == 0
    assert [r[0] for r in rows(capsys.readouterr().out)] == ["2"]


def test_read_only_commands_create_no_folder(tmp_path, shm_dir, capsys):
    """/dev/shm is emptied (a reboot, an operator): ls, show, verify, export and the dry runs of gc and delete
    must not bring the memory tier's folder back, nor create an index that does not exist."""
    config = write_config(tmp_path, shm_dir)
    save(config, [1])
    shutil.rmtree(shm_dir / "host")
    out = tmp_path / "x.pt"
    for argv, status in ((["ls"], 0), (["show", "1"], 0), (["verify", "1"], 1), (["gc", "--dry-run"], 0),
                         (["delete", "1", "--dry-run"], 0), (["export", "--to", "torch", "-o", str(out)], 0)):
        assert cli.main(["-c", str(config), *argv]) == status, (argv, capsys.readouterr())
        assert not (shm_dir / "host").exists(), argv
    assert torch.equal(torch.load(out, weights_only=True)["w"], torch.full((50_000,), 1.0))
    capsys.readouterr()
    (tmp_path / "fresh").mkdir()
    fresh = write_config(tmp_path / "fresh", shm_dir / "fresh")
    assert cli.main(["-c", str(fresh), "ls"]) == 0 and "no checkpoints" in capsys.readouterr().out
    assert os.listdir(tmp_path / "fresh") == ["c.toml"] and not (shm_dir / "fresh").exists()


def run_on_a_terminal(*argv: str) -> tuple[int, str]:
    """Run the CLI with stderr on a pseudo-terminal (where tqdm draws its bar); return (status, stderr)."""
    master, slave = pty.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 120, 0, 0))  # a terminal has a width
    proc = subprocess.Popen([sys.executable, "-m", "tiered_ckpt.cli", *argv], cwd=REPO, stdout=subprocess.DEVNULL,
                            stderr=slave)
    os.close(slave)
    chunks = []
    while True:
        try:
            data = os.read(master, 65536)
        except OSError:  # the child closed the terminal
            break
        if not data:
            break
        chunks.append(data)
    os.close(master)
    return proc.wait(timeout=60), b"".join(chunks).decode(errors="replace")


def test_verify_progress_counts_only_what_it_reads_and_bars_show_only_on_a_terminal(tmp_path, shm_dir):
    config = write_config(tmp_path, shm_dir, host_keep=1)
    save(config, [1, 2])  # step 1 is left on disk only: verify reads one tier of two
    status, bar = run_on_a_terminal("-c", str(config), "verify", "1")
    assert status == 0
    percents = [int(p) for p in re.findall(r"(\d+)%\|", bar)]
    assert percents and max(percents) == 100, bar
    piped = subprocess.run([sys.executable, "-m", "tiered_ckpt.cli", "-c", str(config), "verify", "1"], cwd=REPO,
                           capture_output=True, text=True, timeout=60)
    assert piped.returncode == 0 and "%|" not in piped.stderr and "ok" in piped.stdout
    piped = subprocess.run([sys.executable, "-m", "tiered_ckpt.cli", "-c", str(config), "gc"], cwd=REPO,
                           capture_output=True, text=True, timeout=60)
    assert piped.returncode == 0 and piped.stderr == "" and "gc of job 'cli'" in piped.stdout


def test_gc_grace_must_be_a_finite_duration(tmp_path, shm_dir, capsys):
    config = write_config(tmp_path, shm_dir)
    for grace in ("nan", "inf", "nanh", "-1s"):
        try:
            status = cli.main(["-c", str(config), "gc", f"--grace={grace}"])
        except SystemExit as e:  # argparse refuses it, naming the option
            status = e.code
        err = capsys.readouterr().err
        assert status == 2 and "--grace" in err and "finite" in err and "Traceback" not in err, (grace, err)


def test_a_config_that_is_a_folder_or_not_utf8_is_an_error_without_a_traceback(tmp_path, capsys):
    not_utf8 = tmp_path / "latin1.toml"
    not_utf8.write_bytes('[engine]\njob = "caf\xe9"\n'.encode("latin-1"))
    for path, what in ((tmp_path, "is a directory"), (not_utf8, "is not UTF-8 text (byte 19")):
        assert cli.main(["-c", str(path), "ls"]) == 2
        assert f"tiered-ckpt: file {path}: {what}" in capsys.readouterr().err
        assert cli.main(["config", "check", str(path)]) == 2
        assert f"invalid: file {path}: {what}" in capsys.readouterr().err


def test_export_into_a_folder_that_cannot_be_written_is_an_error_without_a_traceback(tmp_path, shm_dir, capsys):
    config = write_config(tmp_path, shm_dir)
    save(config, [1])
    missing = tmp_path / "missing" / "deeper" / "x.pt"  # missing folders are created (docs/export.md)
    assert cli.main(["-c", str(config), "export", "--to", "torch", "-o", str(missing)]) == 0 and missing.is_file()
    capsys.readouterr()
    for out in (config / "x.pt", Path("/proc/x.pt")):  # a file in the way; a folder where nothing can be created
        assert cli.main(["-c", str(config), "export", "--to", "torch", "-o", str(out)]) == 2, out
        assert f"tiered-ckpt: cannot write {out}" in capsys.readouterr().err


def test_a_reader_that_goes_away_ends_the_output_quietly(tmp_path, shm_dir):
    """`tiered-ckpt ls | head -1`: the pipe closes before the output is written; no BrokenPipeError shows."""
    config = write_config(tmp_path, shm_dir)
    save(config, [1, 2])
    proc = subprocess.Popen([sys.executable, "-m", "tiered_ckpt.cli", "-c", str(config), "ls"], cwd=REPO,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    proc.stdout.close()  # long before the child has imported anything: its first write meets a closed pipe
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=60) == 1 and err == "", err


def test_verify_of_a_step_that_does_not_exist_exits_2_naming_the_steps_that_do(tmp_path, shm_dir, capsys):
    config = write_config(tmp_path, shm_dir)
    save(config, [1, 2])
    assert cli.main(["-c", str(config), "verify", "999"]) == 2
    assert "job 'cli' has no checkpoint 999 (its checkpoints: 1, 2)" in capsys.readouterr().err


def test_ls_and_verify_of_a_job_without_checkpoints_say_so_and_name_the_jobs_that_have_some(tmp_path, shm_dir,
                                                                                            capsys):
    config = write_config(tmp_path, shm_dir)
    save(config, [1])
    assert cli.main(["-c", str(config), "--job", "clj", "ls"]) == 0
    out = capsys.readouterr().out
    assert f"job 'clj': no checkpoints; jobs with checkpoints in file://{tmp_path}/index: cli" in out
    assert cli.main(["-c", str(config), "--job", "clj", "verify"]) == 2  # nothing was verified: not a pass
    assert (f"job 'clj' has no checkpoints to verify; jobs with checkpoints in file://{tmp_path}/index: cli"
            in capsys.readouterr().err)


def test_verify_checks_the_index_copies_of_the_manifest_and_rank_records(tmp_path, shm_dir, capsys):
    """A load skips a damaged index copy for a tier's; verify must still report it (exit 1)."""
    config = write_config(tmp_path, shm_dir)
    save(config, [1])
    assert cli.main(["-c", str(config), "verify", "1"]) == 0
    assert f"step 1 index file://{tmp_path}/index: manifest and 1 rank record(s), ok" in capsys.readouterr().out
    folder = tmp_path / "index" / "cli" / step_dir(1)
    for record in (folder / "manifest", folder / "ranks" / "0"):
        data = bytearray(record.read_bytes())
        data[len(data) // 2] ^= 0x10
        record.write_bytes(bytes(data))
    assert cli.main(["-c", str(config), "verify", "1"]) == 1
    out = capsys.readouterr().out
    assert "step 1 tier host (complete): 4 parts, ok" in out and "step 1 tier disk (complete): 4 parts, ok" in out
    assert f"step 1 index file://{tmp_path}/index: manifest and 1 rank record(s), 2 bad record(s)" in out
    assert "manifest: IntegrityError" in out and "checksums of rank 0: IntegrityError" in out
    (folder / "manifest").unlink()
    assert cli.main(["-c", str(config), "verify", "1"]) == 1
    assert "manifest: IncompleteCheckpoint" in capsys.readouterr().out


def test_show_best_describes_the_best_complete_checkpoint(tmp_path, shm_dir, capsys):
    """`show best`: the checkpoint load(best=True) takes, by the disk's best_metric; without one configured, a
    one-line error naming best_metric (status 2)."""
    disk = {"kind": "local", "keep_last": 1, "keep_best": 1, "best_metric": "val_loss"}
    path = write_toml(tmp_path / "c.toml", stack_dict(tmp_path, disk, job="cli"))

    async def run():
        async with tc.Engine.from_toml(path) as engine:
            for step, loss in ((1, 3.0), (2, 0.25), (3, 1.0)):
                await (await engine.save(step, {"w": torch.full((1000,), float(step))},
                                         metadata={"val_loss": loss})).wait()

    asyncio.run(run())
    assert cli.main(["-c", str(path), "show", "best"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "best by val_loss (lowest): step 2, val_loss = 0.25" and lines[1].startswith("job 'cli' step 2 ")
    assert cli.main(["-c", str(write_config(tmp_path, shm_dir)), "show", "best"]) == 2
    assert "best_metric" in capsys.readouterr().err
