"""The agent of a folder, as tests see it: its pid (from its lock file), whether it runs, and a stop that leaves
nothing behind (a test session's agents must not outlive it)."""
from __future__ import annotations

import os
import signal
import time
from pathlib import Path

from ..agent.folder import lock_path
from ..agent.journal import trainer_alive


def agent_pid(folder: Path) -> int | None:
    """The pid the folder's last agent wrote into its lock file (it may have exited since: see `alive`)."""
    try:
        return int(lock_path(folder).read_text() or 0) or None
    except FileNotFoundError:
        return None


def alive(pid: int | None) -> bool:
    """Whether `pid` runs (a zombie does not)."""
    if pid is None:
        return False
    try:
        return "Z" not in Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0]
    except OSError:
        return False


def agent_running(folder: Path) -> bool:
    """Whether an agent holds the folder's lock now (the same test as for a trainer's lock file)."""
    return trainer_alive(str(lock_path(folder)))


def stop_agent(folder: Path, timeout: float = 10.0) -> None:
    """SIGTERM the folder's agent, if one runs, and wait for it (SIGKILL after `timeout`)."""
    pid = agent_pid(folder)
    if pid is None or not agent_running(folder):
        return
    os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout
    while agent_running(folder) and time.monotonic() < deadline:
        time.sleep(0.05)
    if agent_running(folder) and alive(pid):
        os.kill(pid, signal.SIGKILL)
