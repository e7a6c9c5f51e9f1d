"""The small operational fixes of issue #31: what `config check` names as known keys, `ls` of an index that
cannot exist, `config` without a subcommand, the bench's many-tensor section only when asked, `export`
refusing an existing file before any work. Real files and `cli.main` in process."""
import asyncio
import dataclasses
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import tiered_ckpt as tc
from tiered_ckpt import cli
from tiered_ckpt.config import TierConfig
from tiered_ckpt.testing.configs import stack_dict, write_toml
from tiered_ckpt.tier_kinds import driver_class


def test_an_unknown_tier_key_lists_every_key_the_tier_accepts(tmp_path, capsys):
    """A misspelt keep_last in a [[tiers]] table: the error lists keep_last and every key a tier has (name,
    kind, every, retries, ...) beside the driver's own (path, fsync, ...), not the driver's alone."""
    path = tmp_path / "c.toml"
    path.write_text('[engine]\njob = "x"\n[[tiers]]\nname = "disk"\nkind = "local"\npath = "d"\nkeep_lastt = 2\n')
    assert cli.main(["config", "check", str(path)]) == 2
    err = capsys.readouterr().err
    assert "key 'tiers.disk.keep_lastt': unknown key (known: " in err, err
    known = err.split("(known: ")[1].rsplit(")", 1)[0].split(", ")
    expected = ({f.name for f in dataclasses.fields(TierConfig)} - {"options"}
                | {f.name for f in dataclasses.fields(driver_class("local").Options)})
    assert sorted(known) == known and set(known) == expected
    assert {"keep_last", "name", "kind", "every", "retries", "path"} <= set(known)


def index_config(tmp_path: Path, index: Path) -> Path:
    return write_toml(tmp_path / f"c-{abs(hash(str(index)))}.toml",
                      stack_dict(tmp_path, "local", job="x", index=f"file://{index}", part_size=None))


def test_ls_of_a_missing_index_that_could_not_be_created_says_no_checkpoints(tmp_path, capsys):
    """Read-only commands create nothing, so an index folder that does not exist is no error for `ls` even where
    it could not be created: under a parent that is a regular file, or in /proc/sys (read-only for root too)."""
    (tmp_path / "a-file").write_text("")
    (tmp_path / "disk").mkdir()
    places = [tmp_path / "a-file" / "sub" / "index"]
    if not os.access("/proc/sys", os.W_OK):  # read-only for every user where /proc/sys is mounted so
        places.append(Path("/proc/sys/tiered-ckpt-test/index"))
    for index in places:
        config = index_config(tmp_path, index)
        assert cli.main(["-c", str(config), "ls"]) == 0, (index, capsys.readouterr().err)
        out, err = capsys.readouterr()
        assert out.startswith("job 'x': no checkpoints") and err == "", (index, out, err)
        assert cli.main(["-c", str(config), "ls", "--json"]) == 0, index
        out, err = capsys.readouterr()
        assert json.loads(out)["checkpoints"] == [] and err == "", (index, out, err)
        assert not index.exists() and not index.parent.exists()
    assert (tmp_path / "a-file").read_text() == "" and os.listdir(tmp_path / "disk") == []


def test_config_without_a_subcommand_prints_its_help_and_exits_2(capsys):
    assert cli.main(["config"]) == 2
    out, err = capsys.readouterr()
    assert out == "" and "config_command" not in err, err
    assert err.startswith("usage: tiered-ckpt config") and "check" in err and "validate a tier stack TOML" in err
    assert err.splitlines()[-1] == "tiered-ckpt config: error: name a subcommand (check)"


def bench_args(*argv: str):
    import argparse

    from tiered_ckpt.bench.run import add_arguments

    parser = argparse.ArgumentParser(prog="tiered-ckpt bench")
    add_arguments(parser)
    return parser.parse_args(list(argv))


def test_the_bench_runs_its_many_tensor_section_only_for_the_full_run_or_when_asked():
    from tiered_ckpt.bench.run import SMALL_TENSORS, small_tensors

    assert small_tensors(bench_args("--size", "64MiB")) == 0  # a quick run at a small size: skipped
    assert small_tensors(bench_args()) == SMALL_TENSORS == 100_000  # the full run (docs/benchmarks.md)
    assert small_tensors(bench_args("--size", "64MiB", "--small-tensors", "2000")) == 2000
    assert small_tensors(bench_args("--small-tensors", "0")) == 0


def test_every_bench_table_with_a_met_column_says_what_no_means():
    """The report's figures are made up here (no bench is run): two rows miss their targets."""
    from tiered_ckpt.bench import MET_LEGEND
    from tiered_ckpt.bench.index_storm import report as storm_report
    from tiered_ckpt.bench.run import PAIRS, report

    spread = {"median": 1.0, "min": 1.0, "max": 1.0}
    figures = {"bytes": 1 << 20, "tensors": 3, "torch": "x", "python": "3", "cuda": False, "repeats": 1,
               "memcpy": 0.001, "raw_write": 0.01, "raw_read": 0.01, "torch_save": 0.02, "torch_load": 0.01,
               "first_save_blocking": 0.01, "save_blocking": 0.005, "lazy_return": 0.001, "lazy_staged": 0.002,
               "durable_host": 0.002, "durable_disk": 0.02, "load_host": 0.002, "load_disk": 0.02,
               "plan_miss": 0.01, "plan_hit": 0.0001, "peak_extra_rss": 1 << 20, "steady_extra_rss": 0,
               "pairs": {k: spread for k in PAIRS}, "memory_only": {"load / memcpy": spread}}
    text = report(figures)
    assert "| NO |" in text and text.endswith(MET_LEGEND)
    assert "not a failure" in MET_LEGEND and "exits 0" in MET_LEGEND
    storm = {"ranks": 1024, "connections": 64, "begin_and_records_s": 0.1, "mark_p50_ms": 1.0, "mark_p99_ms": 2.0,
             "commit_s": 2.0, "all_ranks_saw_it_s": 2.1, "list_one_s": 0.001, "memory_usage_per_checkpoint": 1,
             "used_memory_per_checkpoint": 1, "keys_left_after_delete": 0, "memory_usage_left_after_delete": 0,
             "used_memory_left_after_delete": 0}
    text = storm_report("local", [storm], None)
    assert "| NO |" in text and text.endswith(MET_LEGEND)


REFUSE_EXPORT = """
import sys
from tiered_ckpt.cli import main
status = main(sys.argv[1:])
print("torch imported:", "torch" in sys.modules)
sys.exit(status)
"""


def test_export_to_an_existing_file_is_refused_before_any_work(tmp_path, shm_dir):
    """Without --force, an existing PATH is refused before the checkpoint is looked up or torch imported (seconds
    on a busy machine): the child process never imports torch, and the file stays as it was."""
    config = write_toml(tmp_path / "c.toml", stack_dict(tmp_path, shm=shm_dir, job="x"))

    async def save():
        async with tc.Engine.from_toml(config) as engine:
            await (await engine.save(1, {"w": torch.ones(1000)})).wait()

    asyncio.run(save())
    out = tmp_path / "x.pt"
    out.write_bytes(b"mine")
    argv = ["-c", str(config), "export", "--to", "torch", "-o", str(out)]
    run = subprocess.run([sys.executable, "-c", REFUSE_EXPORT, *argv], capture_output=True, text=True, timeout=60)
    assert run.stdout == "torch imported: False\n" and run.returncode == 2, run
    assert run.stderr == f"tiered-ckpt: {out} exists; pass --force to replace it\n" and out.read_bytes() == b"mine"
    run = subprocess.run([sys.executable, "-c", REFUSE_EXPORT, *argv, "--force"], capture_output=True, text=True,
                         timeout=60)
    assert run.returncode == 0 and torch.equal(torch.load(out, weights_only=True)["w"], torch.ones(1000)), run


def test_what_the_examples_write_under_runs_is_ignored_by_git():
    """examples/train_hf.py writes to runs/hf (its docstring, the README): git must not offer it for commit."""
    repo = Path(__file__).resolve().parents[2]
    if shutil.which("git") is None or not (repo / ".git").exists():
        pytest.skip("not a git work tree")
    for path in ("runs/hf/checkpoint-60/pointer", "checkpoints/index/x"):
        check = subprocess.run(["git", "check-ignore", "-q", "--no-index", path], cwd=repo, timeout=60)
        assert check.returncode == 0, path
    assert subprocess.run(["git", "check-ignore", "-q", "--no-index", "tiered_ckpt/runs.py"], cwd=repo,
                          timeout=60).returncode == 1
