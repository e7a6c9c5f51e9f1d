"""The command line for scripts (#23): `--json` on ls, show, verify and gc (parsed and checked against what was
saved), `show latest`, the exit statuses, `delete --dry-run` and its question on a terminal, and a start-up
that imports no torch. Real engines, real files, `cli.main` in process (or a subprocess where a terminal or a
fresh interpreter is needed)."""
import asyncio
import json
import os
import pty
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import tiered_ckpt as tc
from tiered_ckpt import cli
from tiered_ckpt.testing.configs import stack_dict, write_toml
from tiered_ckpt.layout import step_dir

from .test_cli import REPO, rows, save, write_config


def run_cli(capsys, *argv: str) -> tuple[int, str, str]:
    """(status, stdout, stderr) of `tiered-ckpt ARGV`; argparse's own exits give their status too."""
    try:
        status = cli.main(list(argv))
    except SystemExit as e:
        status = e.code
    out, err = capsys.readouterr()
    return status, out, err


def strict_json(text: str):
    """json.loads, refusing NaN and Infinity: they are not JSON, and jq and most parsers reject them."""
    def refuse(constant):
        raise AssertionError(f"{constant} in the JSON output")

    return json.loads(text, parse_constant=refuse)


def begin_a_save_that_crashed(config: Path, step: int) -> None:
    async def run():
        async with tc.Engine.from_toml(config) as engine:
            await engine.store.index.begin("cli", step, ["host", "disk"])

    asyncio.run(run())


def test_ls_json_lists_what_was_saved(tmp_path, shm_dir, capsys):
    config = write_config(tmp_path, shm_dir)
    before = time.time()
    save(config, [1, 2], metadata={"loss": 0.5, "tag": "warm", "bad": float("nan")})
    begin_a_save_that_crashed(config, 3)
    status, out, _ = run_cli(capsys, "-c", str(config), "ls", "--json")
    assert status == 0
    doc = strict_json(out)
    assert doc["job"] == "cli" and doc["index"] == f"file://{os.path.realpath(tmp_path / 'index')}"
    one, two, three = doc["checkpoints"]
    assert [one["step"], two["step"], three["step"]] == [1, 2, 3]
    for c in (one, two):
        assert c["nbytes"] == 50_000 * 4 and c["complete"] is True
        assert c["tiers"] == c["complete_on"] == ["host", "disk"]
        assert c["failed"] == {} and c["skipped"] == {} and c["foreign"] is None
        assert c["metadata"] == {"loss": 0.5, "tag": "warm", "bad": "nan"}  # NaN is no JSON: its text
        assert before - 1 <= c["created"] <= time.time()
    assert three["complete"] is False and three["complete_on"] == [] and three["nbytes"] is None
    assert three["tiers"] == ["host", "disk"]
    status, out, _ = run_cli(capsys, "-c", str(config), "--job", "nothing-yet", "ls", "--json")
    assert status == 0 and strict_json(out)["checkpoints"] == []  # no checkpoints yet: an empty list, not an error


def test_show_json_describes_the_saved_state(tmp_path, shm_dir, capsys):
    config = write_config(tmp_path, shm_dir)
    state = {"model": {"weight": torch.ones(4, 4), "bias": torch.zeros(3, dtype=torch.float64)},
             "extra": {"lr": 3e-4, "schedule": [1e-3, 5e-4], "name": "run-7", "nested": [{"epoch": 2}]}}
    save(config, [5], state=lambda s: state, metadata={"val_loss": 0.25})
    status, out, _ = run_cli(capsys, "-c", str(config), "show", "5", "--json")
    assert status == 0
    doc = strict_json(out)
    assert doc["job"] == "cli" and doc["step"] == 5 and doc["complete"] is True and doc["best"] is None
    assert doc["complete_on"] == ["host", "disk"] and doc["failed"] == {} and doc["world_size"] == 1
    _, listed, _ = run_cli(capsys, "-c", str(config), "ls", "--json")
    assert doc["nbytes"] == strict_json(listed)["checkpoints"][0]["nbytes"] >= 4 * 4 * 4 + 3 * 8  # (with padding)
    assert doc["part_size"] == 64 * 1024 and doc["parts"] == 1
    assert doc["format"] == 4 and isinstance(doc["checksum"], str) and doc["metadata"] == {"val_loss": 0.25}
    assert doc["values"] == {"extra/lr": 3e-4, "extra/schedule": [1e-3, 5e-4], "extra/name": "run-7",
                             "extra/nested/0/epoch": 2}
    tensors = {t["path"]: t for t in doc["tensors"]}
    assert tensors == {"model/weight": {"path": "model/weight", "dtype": "float32", "shape": [4, 4], "nbytes": 64},
                       "model/bias": {"path": "model/bias", "dtype": "float64", "shape": [3], "nbytes": 24}}


def test_show_json_lists_every_tensor_and_value_where_the_text_shows_the_first(tmp_path, shm_dir, capsys):
    config = write_config(tmp_path, shm_dir)
    save(config, [1], state=lambda s: {"t": {f"x{i:02d}": torch.ones(2) for i in range(25)},
                                       "v": {f"k{i:02d}": i for i in range(60)}})
    status, out, _ = run_cli(capsys, "-c", str(config), "show", "1")
    assert status == 0 and "5 more (--tensors lists all)" in out and "10 more (--values lists all)" in out
    status, out, _ = run_cli(capsys, "-c", str(config), "show", "1", "--json")
    doc = strict_json(out)
    assert len(doc["tensors"]) == 25 and doc["values"] == {f"v/k{i:02d}": i for i in range(60)}


def test_show_latest_is_the_newest_complete_checkpoint(tmp_path, shm_dir, capsys):
    config = write_config(tmp_path, shm_dir)
    save(config, [1, 2])
    begin_a_save_that_crashed(config, 3)  # newer, but incomplete: not the one load() takes
    status, out, _ = run_cli(capsys, "-c", str(config), "show", "latest")
    lines = out.splitlines()
    assert status == 0 and lines[0] == "latest complete checkpoint: step 2" and lines[1].startswith("job 'cli' step 2 ")
    status, out, _ = run_cli(capsys, "-c", str(config), "show", "latest", "--json")
    assert status == 0 and strict_json(out)["step"] == 2
    status, out, err = run_cli(capsys, "-c", str(config), "--job", "empty", "show", "latest")
    assert status == 2 and out == "" and "Traceback" not in err and err.startswith("tiered-ckpt: ")


def test_show_best_json_names_the_metric(tmp_path, capsys):
    disk = {"kind": "local", "keep_last": 3, "keep_best": 1, "best_metric": "acc", "best_mode": "max"}
    path = write_toml(tmp_path / "c.toml", stack_dict(tmp_path, disk, job="cli"))
    for step, acc in ((1, 0.5), (2, 0.9), (3, 0.7)):
        save(path, [step], metadata={"acc": acc})
    status, out, _ = run_cli(capsys, "-c", str(path), "show", "best", "--json")
    doc = strict_json(out)
    assert status == 0 and doc["step"] == 2 and doc["best"] == {"metric": "acc", "mode": "max", "value": 0.9}


def test_verify_json_reports_every_copy_and_exits_1_on_damage(tmp_path, shm_dir, capsys):
    config = write_config(tmp_path, shm_dir)
    save(config, [1, 2])
    status, out, _ = run_cli(capsys, "-c", str(config), "verify", "--json")
    doc = strict_json(out)
    assert status == 0 and doc["ok"] is True and doc["job"] == "cli"
    assert [c["step"] for c in doc["checkpoints"]] == [1, 2]
    for c in doc["checkpoints"]:
        assert c["ok"] is True and c["error"] is None and c["retired"] is False
        assert c["tiers"] == [{"tier": t, "complete": True, "parts": 4, "ok": True, "bad": [], "retired": False}
                              for t in ("host", "disk")]
        assert c["index"] == {"index": doc["index"], "checked": True, "unreachable": None, "rank_records": 1,
                              "ok": True, "bad": []}
    [part] = [p for p in (tmp_path / "disk").rglob("part-000001") if step_dir(1) in str(p)]
    data = bytearray(part.read_bytes())
    data[100] ^= 0xFF
    part.write_bytes(bytes(data))
    status, out, _ = run_cli(capsys, "-c", str(config), "verify", "--json")
    doc = strict_json(out)
    assert status == 1 and doc["ok"] is False
    one, two = doc["checkpoints"]
    assert one["ok"] is False and two["ok"] is True
    host, disk = one["tiers"]
    assert host["ok"] is True and disk["ok"] is False and len(disk["bad"]) == 1 and "part-000001" in disk["bad"][0]
    assert disk["retired"] is False  # damage, not a step retired meanwhile
    status, out, _ = run_cli(capsys, "-c", str(config), "verify", "2", "--json")  # one step only
    assert status == 0 and [c["step"] for c in strict_json(out)["checkpoints"]] == [2]


def test_gc_json_says_what_goes_and_a_dry_run_changes_nothing(tmp_path, shm_dir, capsys):
    config = write_config(tmp_path, shm_dir)
    save(config, [1, 2])
    begin_a_save_that_crashed(config, 3)  # an index record without data
    disk = tmp_path / "disk" / "cli"
    shutil.copytree(disk / step_dir(2), disk / step_dir(7))  # data the index does not list (a zombie's write)
    for manifest in (disk / step_dir(7)).rglob("manifest.msgpack"):
        manifest.unlink()  # not a whole checkpoint: garbage
    stray = sum(p.stat().st_size for p in (disk / step_dir(7)).rglob("*") if p.is_file())
    for dry_run in (True, False):
        argv = ["-c", str(config), "gc", "--json"] + (["--dry-run"] if dry_run else [])
        status, out, _ = run_cli(capsys, *argv)
        doc = strict_json(out)
        assert status == 0 and doc["job"] == "cli" and doc["dry_run"] is dry_run and doc["exclusive"] is True
        assert doc["grace"] == 3600 and doc["checkpoints"] == [3] and doc["errors"] == []
        removed = {(r["tier"], r["step"]): r for r in doc["removed"]}
        assert set(removed) == {(None, 3), ("disk", 7)}
        assert removed[None, 3]["name"] == "index record" and removed[None, 3]["nbytes"] is None
        assert removed["disk", 7]["nbytes"] == stray and removed["disk", 7]["what"].startswith("a step the index")
        assert doc["freed"] == {"host": {"items": 0, "nbytes": 0, "unknown_sizes": False},
                                "disk": {"items": 1, "nbytes": stray, "unknown_sizes": False}}
        status, out, _ = run_cli(capsys, "-c", str(config), "ls")
        assert [r[0] for r in rows(out)] == (["1", "2", "3"] if dry_run else ["1", "2"])
        assert (disk / step_dir(7)).exists() is dry_run


def test_delete_dry_run_says_what_it_would_delete_and_deletes_nothing(tmp_path, shm_dir, capsys):
    config = write_config(tmp_path, shm_dir)
    save(config, [1, 2])
    files = sorted(p for p in [*shm_dir.rglob("*"), *(tmp_path / "disk").rglob("*"), *(tmp_path / "index").rglob("*")]
                   if step_dir(1) in str(p))
    status, out, _ = run_cli(capsys, "-c", str(config), "delete", "1", "--dry-run")
    assert status == 0
    assert out == "would delete step 1 of job 'cli' (complete, 195.31 KiB) from host, disk and the index (dry run: " \
                  "nothing deleted)\n"
    assert sorted(p for p in [*shm_dir.rglob("*"), *(tmp_path / "disk").rglob("*"),
                              *(tmp_path / "index").rglob("*")] if step_dir(1) in str(p)) == files
    status, out, _ = run_cli(capsys, "-c", str(config), "ls")
    assert [r[0] for r in rows(out)] == ["1", "2"]
    status, out, err = run_cli(capsys, "-c", str(config), "delete", "9", "--dry-run")
    assert status == 2 and out == "" and "job 'cli' has no checkpoint 9" in err


def delete_with_stdin(config: Path, *options: str, terminal: bool, answer: bytes) -> tuple[int, str]:
    """`tiered-ckpt delete 1` in a subprocess whose stdin is a terminal (a pseudo-terminal) or a pipe, with
    `answer` typed or piped in; (status, stderr)."""
    argv = [sys.executable, "-m", "tiered_ckpt.cli", "-c", str(config), "delete", "1", *options]
    if not terminal:
        proc = subprocess.run(argv, cwd=REPO, input=answer, capture_output=True, timeout=60)
        return proc.returncode, proc.stderr.decode()
    master, slave = pty.openpty()
    try:
        proc = subprocess.Popen(argv, cwd=REPO, stdin=slave, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        os.write(master, answer)  # typed ahead: the terminal keeps the line until the question reads it
        _, err = proc.communicate(timeout=60)
    finally:
        os.close(slave)
        os.close(master)
    return proc.returncode, err.decode()


QUESTION = "delete step 1 of job 'cli' (complete, 195.31 KiB) from host, disk and the index? [y/N] "


@pytest.mark.parametrize("options, terminal, answer, deleted, asked", [
    ((), True, b"n\n", False, True),  # a person said no: nothing deleted, status 2
    ((), True, b"\n", False, True),  # no answer is no
    ((), True, b"yes\n", True, True),
    (("--yes",), True, b"n\n", True, False),  # not asked (the typed "n" is never read)
    (("-y",), True, b"n\n", True, False),
    ((), False, b"n\n", True, False),  # stdin is not a terminal (a script): never asked, as before
])
def test_delete_asks_first_only_on_a_terminal(tmp_path, shm_dir, options, terminal, answer, deleted, asked):
    config = write_config(tmp_path, shm_dir)
    save(config, [1, 2])
    status, err = delete_with_stdin(config, *options, terminal=terminal, answer=answer)
    assert (QUESTION in err) is asked, err
    assert status == (0 if deleted else 2), err
    left = [p for p in [*shm_dir.rglob("*"), *(tmp_path / "disk").rglob("*")] if step_dir(1) in str(p)]
    assert bool(left) is not deleted
    if not deleted:
        assert "tiered-ckpt: nothing deleted" in err


def test_ctrl_c_at_the_question_deletes_nothing_and_ends_at_once(tmp_path, shm_dir):
    """Ctrl-C while `delete` waits for its answer is a no (status 2, no traceback), at once: the question must not
    sit in a thread that asyncio.run waits for until a line is typed. Every wait here is on the child's own output
    (the question, then its end of stderr), never on a clock: nothing is ever typed, so a child that waited for
    Enter would never end, and the test's time limit (pytest-timeout) reports it with the stacks."""
    config = write_config(tmp_path, shm_dir)
    save(config, [1, 2])
    argv = [sys.executable, "-m", "tiered_ckpt.cli", "-c", str(config), "delete", "1"]
    master, slave = pty.openpty()
    # Ctrl-C as in a terminal: a suite started in the background (nohup, `cmd &` in a script, some CI runners)
    # passes SIGINT on ignored, and a child that ignores it would wait for its answer for ever
    proc = subprocess.Popen(argv, cwd=REPO, stdin=slave, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        asked = b""
        while b"[y/N]" not in asked:  # the question comes once the checkpoint is found; nothing is typed
            chunk = os.read(proc.stderr.fileno(), 4096)
            assert chunk, asked  # the child ended before asking
            asked += chunk
        proc.send_signal(signal.SIGINT)  # as Ctrl-C on the terminal does
        out, err = proc.communicate()  # the child's stderr ends and it exits: no line was typed
    finally:
        if proc.poll() is None:  # the test failed (or hit its time limit) with the child still waiting: end it
            proc.kill()
            proc.communicate()
        os.close(slave)
        os.close(master)
    err = asked.decode() + err.decode()
    assert proc.returncode == 2 and "tiered-ckpt: nothing deleted" in err and "Traceback" not in err, err
    assert out == b""
    assert any(step_dir(1) in str(p) for p in (tmp_path / "disk").rglob("*"))


def test_delete_of_a_step_or_job_that_does_not_exist_leaves_nothing_behind(tmp_path, shm_dir, capsys):
    """Status 2, nothing done: not even the writer lease's file of a job (or an index) that did not exist, as
    `delete 3` in the wrong folder or with a mistyped --job would leave."""
    config = write_config(tmp_path, shm_dir)
    for argv in (["delete", "3"], ["--job", "typo", "delete", "3"], ["delete", "3", "--yes"]):
        status, out, err = run_cli(capsys, "-c", str(config), *argv)
        assert status == 2 and out == "" and "has no checkpoint 3" in err, (argv, err)
        assert not (tmp_path / "index").exists(), (argv, sorted((tmp_path / "index").rglob("*")))
    save(config, [1])
    before = sorted((tmp_path / "index").rglob("*"))
    status, _, err = run_cli(capsys, "-c", str(config), "--job", "typo", "delete", "1")
    assert status == 2 and sorted((tmp_path / "index").rglob("*")) == before, err
    # an empty --job (a script's unset $JOB) is an error, not the config's own job (which used to lose step 1)
    status, _, err = run_cli(capsys, "-c", str(config), "--job", "", "delete", "1", "--yes")
    assert status == 2 and "key 'engine.job'" in err and sorted((tmp_path / "index").rglob("*")) == before, err


def test_show_prints_metadata_whose_keys_are_not_strings(tmp_path, shm_dir, capsys):
    """save() takes any msgpack-able dict as metadata, int keys included: `show` prints it, no traceback."""
    config = write_config(tmp_path, shm_dir)
    save(config, [1], metadata={1: "one", "loss": 0.5})
    status, out, err = run_cli(capsys, "-c", str(config), "show", "1")
    assert status == 0, err
    assert "    1    = 'one'\n" in out and "    loss = 0.5\n" in out, out
    status, out, _ = run_cli(capsys, "-c", str(config), "show", "1", "--json")
    assert status == 0 and strict_json(out)["metadata"] == {"1": "one", "loss": 0.5}


def test_exit_statuses_follow_the_documented_rule(tmp_path, shm_dir, capsys):
    """0 ok; 1 damage found (the verify test above); 2 nothing done: bad arguments, an unknown step, no
    checkpoints, a config that cannot be read. A status 2 prints one line on stderr, no traceback, and with
    --json nothing on stdout."""
    config = write_config(tmp_path, shm_dir)
    save(config, [1])
    c = ["-c", str(config)]
    cases = [
        (c + ["ls"], 0), (c + ["ls", "--json"], 0), (c + ["--job", "empty", "ls", "--json"], 0),
        (c + ["show", "1"], 0), (c + ["show", "latest", "--json"], 0), (c + ["verify", "--json"], 0),
        (c + ["gc", "--dry-run", "--json"], 0), (c + ["delete", "1", "--dry-run"], 0),
        (["config", "check", str(config)], 0),
        (c + ["show", "9", "--json"], 2), (c + ["show", "best", "--json"], 2),  # no best_metric configured
        (c + ["--job", "empty", "show", "latest", "--json"], 2), (c + ["verify", "9", "--json"], 2),
        (c + ["--job", "empty", "verify", "--json"], 2), (c + ["delete", "9"], 2),
        (["-c", str(tmp_path / "missing.toml"), "ls", "--json"], 2), (["config", "check", str(tmp_path / "x.toml")], 2),
        (c + ["show", "newest"], 2), (c + ["ls", "--bogus"], 2), ([], 2), (c + ["gc", "--grace", "soon"], 2),
        (c + ["delete"], 2), (c + ["export", "--to", "zip", "-o", str(tmp_path / "x")], 2), (["bench", "--bogus"], 2),
    ]
    for argv, expected in cases:
        status, out, err = run_cli(capsys, *argv)
        assert status == expected, (argv, status, out, err)
        assert "Traceback" not in err, (argv, err)
        if expected == 2:
            assert err.strip(), argv
            if "--json" in argv:
                assert out == "", (argv, out)


def test_bench_options_are_parsed_once_it_is_chosen(capsys):
    """`bench`'s options come from bench/run.py, imported only for `tiered-ckpt bench` (it imports torch)."""
    status, out, _ = run_cli(capsys, "bench", "--help")
    assert status == 0 and out.startswith("usage: tiered-ckpt bench") and "--small-tensors" in out


# -- start-up without torch ----------------------------------------------------------------------------------
IMPORTS_OF = """
import json, sys
from tiered_ckpt import cli
try:
    status = cli.main(json.loads(sys.argv[2]))
except SystemExit as e:
    status = e.code
with open(sys.argv[1], "w") as f:
    json.dump({"status": status, "torch": "torch" in sys.modules}, f)
"""


@pytest.mark.parametrize("index", ["file", "redis"])
def test_help_config_check_ls_gc_and_delete_do_not_import_torch(tmp_path, shm_dir, redis_server, index):
    """Importing torch took most of every command's ~2-4 s; these answer a script without it, with either
    index (the Redis index imported torch through state/gc_pause.py until it moved to tiered_ckpt/gc_pause.py)."""
    config = write_config(tmp_path, shm_dir, **({"index": redis_server().url} if index == "redis" else {}))
    save(config, [1, 2])
    result = tmp_path / "result.json"
    for argv in (["--help"], ["config", "check", str(config)], ["-c", str(config), "ls"],
                 ["-c", str(config), "ls", "--json"], ["-c", str(config), "gc", "--dry-run"],
                 ["-c", str(config), "delete", "1", "--dry-run"], ["-c", str(config), "delete", "1", "-y"]):
        proc = subprocess.run([sys.executable, "-c", IMPORTS_OF, str(result), json.dumps(argv)], cwd=REPO,
                              capture_output=True, text=True, timeout=60)
        assert proc.returncode == 0, proc.stderr
        assert json.loads(result.read_text()) == {"status": 0, "torch": False}, (argv, proc.stdout, proc.stderr)


def test_the_package_imports_its_public_names_on_first_use():
    proc = subprocess.run([sys.executable, "-c", "import sys, tiered_ckpt as tc\n"
                           "assert 'torch' not in sys.modules, 'import tiered_ckpt imported torch'\n"
                           "tc.TieredCkptError, tc.load_config\n"
                           "assert 'torch' not in sys.modules, 'the errors and the config imported torch'\n"
                           "from tiered_ckpt import Engine\n"
                           "assert 'torch' in sys.modules and tc.Engine is Engine\n"],
                          cwd=REPO, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert {name: getattr(tc, name) for name in tc.__all__}  # every public name resolves
    assert tc.Engine is __import__("tiered_ckpt.engine").engine.Engine and tc.Fallback.__name__ == "Fallback"
    assert set(tc.__all__) <= set(dir(tc)) and "__version__" in dir(tc)
    with pytest.raises(AttributeError, match="no attribute 'Engin'"):
        tc.Engin
    namespace: dict = {}
    exec("from tiered_ckpt import *", namespace)
    assert set(tc.__all__) <= set(namespace)


def test_the_cli_start_up_bench_reports_each_command(tmp_path, shm_dir):
    from tiered_ckpt.bench import cli_startup

    config = write_config(tmp_path, shm_dir)
    save(config, [1])
    timed = {label: argv for label, argv in cli_startup.commands(config).items() if "tiered-ckpt" in label}
    assert set(timed) == {"tiered-ckpt --help", "tiered-ckpt config check FILE", "tiered-ckpt ls",
                          "tiered-ckpt gc --dry-run"}
    times = cli_startup.measure(timed, repeats=1)
    assert set(times) == set(timed) and all(len(t) == 1 and t[0][0] > 0 and t[0][1] >= 0 for t in times.values())
    assert [line.split("  ")[0] for line in cli_startup.report(times).splitlines()[1:]] == list(timed)


@pytest.mark.parametrize("to", ["safetensors", "torch", "dcp"])
def test_export_onto_a_file_system_without_room_is_one_line_and_leaves_nothing(tmp_path, shm_dir, to):
    """Writes past a limit fail with an OSError (RLIMIT_FSIZE here, a full disk in the field). torch.save and DCP
    used to hide it behind their zip writer's RuntimeError: a traceback and exit status 1."""
    import resource

    config = write_config(tmp_path, shm_dir)
    save(config, [1], state=lambda step: {"w": torch.full((100_000,), 1.0)})  # 400 kB

    def small_files() -> None:
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # the write fails with EFBIG instead of killing
        resource.setrlimit(resource.RLIMIT_FSIZE, (64 * 1024, resource.RLIM_INFINITY))

    out_dir = tmp_path / "out"
    out_dir.mkdir()
    proc = subprocess.run([sys.executable, "-m", "tiered_ckpt.cli", "-c", str(config), "export", "1", "--to", to,
                           "-o", str(out_dir / f"state.{to}")], capture_output=True, text=True,
                          preexec_fn=small_files, stdin=subprocess.DEVNULL, cwd=REPO)
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr and "cannot write" in proc.stderr and "File too large" in proc.stderr
    assert list(out_dir.iterdir()) == []


def test_ls_json_of_a_long_history_writes_a_checkpoint_a_line(tmp_path, shm_dir, capsys):
    """Failed on the old code (the whole document indented, by Python's pure-Python encoder: 0.8 s of `ls --json`
    at 10,000 checkpoints): past 100 checkpoints each is one compact line, and the document is the same JSON."""
    config = write_config(tmp_path, shm_dir)
    save(config, [1], metadata={"loss": float("nan"), "tag": "warm"})

    async def fill():
        async with tc.Engine.from_toml(config) as engine:
            index = engine.store.index
            for step in range(2, 152):
                await index.begin("cli", step, ["disk"], {"nbytes": 8, "metadata": {"loss": float("inf"), "n": step}})
                assert await index.mark_durable("cli", step, "disk", 0, 1, "filled")

    asyncio.run(fill())
    status, out, _ = run_cli(capsys, "-c", str(config), "ls", "--json")
    assert status == 0
    doc = strict_json(out)
    assert [c["step"] for c in doc["checkpoints"]] == list(range(1, 152))
    assert doc["checkpoints"][0]["metadata"] == {"loss": "nan", "tag": "warm"}
    assert doc["checkpoints"][-1]["metadata"] == {"loss": "inf", "n": 151} and doc["checkpoints"][-1]["complete"]
    lines = out.splitlines()
    assert sum(line.lstrip().startswith('{"step": ') for line in lines) == 151
    assert len(lines) < 151 + 20
