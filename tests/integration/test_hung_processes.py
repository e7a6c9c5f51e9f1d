"""hung_processes.wait_or_fail, the hang report of the tests that start process trees (test_local_stack.py): it
finds a child in a session of its own (as torchrun starts its ranks) and one left holding the output after
its parent exited, names them, stops them, and fails within its time limit."""
import subprocess
import sys
import time

import pytest

from .hung_processes import descendants, wait_or_fail

SLEEPER = "import time; print('child up', flush=True); time.sleep(600)"


def start(parent_code: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", parent_code], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True, env={"PYTHONFAULTHANDLER": "1"})


def test_a_hung_tree_with_a_child_in_its_own_session_is_reported_and_stopped():
    proc = start("import subprocess, sys, time; "
                 f"subprocess.Popen([sys.executable, '-c', {SLEEPER!r}], start_new_session=True); time.sleep(600)")
    deadline = time.monotonic() + 20
    while len(descendants(proc.pid)) < 1:  # the child started
        assert time.monotonic() < deadline
        time.sleep(0.05)
    child = descendants(proc.pid)[0]
    with pytest.raises(pytest.fail.Exception) as failed:
        wait_or_fail(proc, 2, "the parent")
    report = str(failed.value)
    assert "the parent did not finish in 2 s" in report and f"\n{child} (parent {proc.pid}, session {child}" in report
    assert "Fatal Python error: Aborted" in report  # its stack, printed on SIGABRT into the output
    assert descendants(proc.pid) == [] and not alive(child)


def test_a_child_left_holding_the_output_is_found_without_a_parent_link():
    proc = start("import subprocess, sys; "
                 f"subprocess.Popen([sys.executable, '-c', {SLEEPER!r}], start_new_session=True)")
    with pytest.raises(pytest.fail.Exception) as failed:
        wait_or_fail(proc, 3, "the parent")
    report = str(failed.value)
    assert "the parent exited 0, but its output stayed open" in report, report
    lines = report.splitlines()
    holders = [int(line.split()[0]) for line in lines if "[holds the output pipe]" in line]
    assert len(holders) == 1 and "child up" in report, report  # the child, in the report and its output
    assert not alive(holders[0])


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False
