"""When a test's subprocess does not finish: every process that belongs to it, described and then stopped, so
the test fails with what each was doing instead of hanging in its own clean-up.

A process belongs to it when it descends from it (by parent pid) or holds its output pipe open. Both are
needed: torchrun starts every rank in a session of its own, so a search by session or process group misses
the ranks; and a child a rank leaves behind, once its parent is gone, has no parent link back to the test,
yet reading the pipe to its end waits for it."""
from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import threading
import time
from pathlib import Path

import pytest


def children_by_parent() -> dict[int, list[int]]:
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError, IndexError, ValueError):
            ppid = int(stat.read_text().rsplit(")", 1)[1].split()[1])
            children.setdefault(ppid, []).append(int(stat.parent.name))
    return children


def descendants(pid: int) -> list[int]:
    """`pid`'s descendants, parents before their children."""
    children, found, todo = children_by_parent(), [], [pid]
    while todo:
        for child in children.get(todo.pop(0), []):
            found.append(child)
            todo.append(child)
    return found


def pipe_holders(fd: int) -> list[int]:
    """The other processes that have the pipe `fd` is an end of open (any descriptor, either end)."""
    target = f"pipe:[{os.fstat(fd).st_ino}]"
    holders = []
    for proc_fd in Path("/proc").glob("[0-9]*/fd"):
        pid = int(proc_fd.parent.name)
        if pid == os.getpid():
            continue
        with contextlib.suppress(OSError):
            if any(os.readlink(link) == target for link in proc_fd.iterdir()):
                holders.append(pid)
    return holders


def command_line(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return ""


def describe(pid: int, holds_output: bool = False) -> str:
    """One process: parent, session, state and kernel wait of each thread, what its stdout and stderr are,
    the command line, and its kernel stack where it can be read."""
    base = Path(f"/proc/{pid}")
    try:
        head, tail = (base / "stat").read_text().rsplit(")", 1)
        fields = tail.split()
        cmdline = (base / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return f"{pid}: exited"
    threads = []
    with contextlib.suppress(OSError):
        for task in sorted((base / "task").iterdir(), key=lambda t: int(t.name)):
            with contextlib.suppress(OSError):
                state = (task / "stat").read_text().rsplit(")", 1)[1].split()[0]
                threads.append(f"{(task / 'comm').read_text().strip()}:{state}:{(task / 'wchan').read_text() or '-'}")
    outputs = []
    for fd in (1, 2):
        try:
            outputs.append(os.readlink(base / "fd" / str(fd)))
        except OSError:
            outputs.append("closed")
    lines = [f"{pid} (parent {fields[1]}, session {fields[3]}, state {fields[0]})"
             f"{' [holds the output pipe]' if holds_output else ''} {cmdline[:300]}",
             f"    stdout {outputs[0]}, stderr {outputs[1]}; threads (name:state:kernel wait): {' '.join(threads)}"]
    with contextlib.suppress(OSError):
        stack = (base / "stack").read_text().split("\n")[:6]
        lines.append("    kernel stack: " + " | ".join(s.split(" ", 1)[-1] for s in stack if s))
    if "python" in cmdline and shutil.which("py-spy"):  # where installed: native frames too (a hang in C++)
        with contextlib.suppress(OSError, subprocess.SubprocessError):
            dump = subprocess.run(["py-spy", "dump", "--native", "--pid", str(pid)], capture_output=True,
                                  text=True, timeout=30).stdout
            lines.append("    py-spy: " + dump.strip().replace("\n", "\n    "))
    return "\n".join(lines)


class Output:
    """A subprocess's output (text mode), read by a thread as it comes: what was read stays available however
    the process ends, and the end of the pipe can be waited for with a time limit."""

    def __init__(self, proc: subprocess.Popen):
        assert proc.stdout is not None
        self.proc, self.lines = proc, []
        self.fd = proc.stdout.fileno()
        self.thread = threading.Thread(target=self._read, daemon=True, name=f"output of {proc.pid}")
        self.thread.start()

    def _read(self) -> None:
        with contextlib.suppress(ValueError, OSError):
            for line in self.proc.stdout:  # type: ignore[union-attr]
                self.lines.append(line)

    def ended(self, timeout: float) -> bool:
        self.thread.join(timeout)
        return not self.thread.is_alive()

    def text(self) -> str:
        return "".join(self.lines)


def wait_or_fail(proc: subprocess.Popen, timeout: float, what: str, *, quiet: tuple[str, ...] = ()) -> str:
    """`proc`'s output once it exited and its output pipe closed, both within `timeout` seconds; else the test
    fails with the processes left and what they wait on (stop_hung; `quiet`: see there)."""
    output, deadline = Output(proc), time.monotonic() + timeout
    try:
        proc.wait(timeout)
    except subprocess.TimeoutExpired:
        pytest.fail(stop_hung(proc, output, f"{what} did not finish in {timeout:g} s", quiet=quiet), pytrace=False)
    if not output.ended(max(5.0, deadline - time.monotonic())):
        pytest.fail(stop_hung(proc, output, f"{what} exited {proc.returncode}, but its output stayed open: "
                                            f"a process it started still holds it", quiet=quiet), pytrace=False)
    return output.text()


def stop_hung(proc: subprocess.Popen, output: Output, what: str, *, quiet: tuple[str, ...] = (),
              grace: float = 30.0) -> str:
    """`proc` ran too long: say which processes are left and what they wait on, SIGABRT the Python ones
    (deepest first; with PYTHONFAULTHANDLER set, each prints every thread's stack into the output) but those
    whose command line contains one of `quiet` (servers whose stacks would only crowd the others out), SIGKILL
    them all, and return a report ending with the last of the output. Bounded: it waits for the output's end
    `grace` seconds at most."""
    found = descendants(proc.pid)
    held = pipe_holders(output.fd)
    tree = [proc.pid, *found, *(p for p in held if p not in found and p != proc.pid)]
    report = [f"{what}. Its processes (and any other holding its output open):",
              *(describe(pid, pid in held) for pid in tree)]
    # the leader last: it may be what passes the others' output on (scripts/local_stack.py does)
    python = [p for p in [*reversed(tree[1:]), tree[0]]
              if "python" in command_line(p) and not any(q in command_line(p) for q in quiet)]
    for pid in python:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGABRT)
        time.sleep(1 if pid != proc.pid else 0.5)  # its stacks printed and passed on
    if python:
        report.append(f"SIGABRT sent to {python} (their stacks are in the output below)")
    for pid in reversed(tree):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    proc.wait()
    if not output.ended(grace):
        report.append(f"the output pipe is still held by {pipe_holders(output.fd)} after every process above "
                      f"was killed; it is not read further (its reader is a daemon thread: left behind)")
    return "\n".join(report) + f"\n--- the last of the output ---\n{output.text()[-40000:]}"
