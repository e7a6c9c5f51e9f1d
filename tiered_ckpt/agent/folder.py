"""Where the agent lives: one folder per user (mode 0700, owned by the user, else refused), holding the socket
(0600), the lock that makes the agent one per folder, and its log."""
from __future__ import annotations

import os
import stat
import tempfile
from pathlib import Path

from ..errors import ConfigError

FOLDER_ENV = "TIERED_CKPT_AGENT_DIR"  # another folder (tests: one per test, so agents never meet)
IDLE_ENV = "TIERED_CKPT_AGENT_IDLE"  # seconds an agent the engine starts waits idle before it exits


def agent_folder() -> Path:
    """$TIERED_CKPT_AGENT_DIR, else $XDG_RUNTIME_DIR/tiered_ckpt-agent-<ns>, else <tmp>/tiered_ckpt-agent-<uid>-<ns>,
    where <ns> names this process's mount namespace: the agent must see the memory tier's files the trainer sees,
    and two containers that share /tmp (a bind mount) but not /dev/shm must not share an agent."""
    named = os.environ.get(FOLDER_ENV)
    if named:
        return Path(named)
    ns = mount_namespace()
    runtime = os.environ.get("XDG_RUNTIME_DIR")
    if runtime and os.path.isdir(runtime):
        return Path(runtime) / f"tiered_ckpt-agent{ns}"
    return Path(tempfile.gettempdir()) / f"tiered_ckpt-agent-{os.getuid()}{ns}"


def mount_namespace() -> str:
    """"-<inode>" of /proc/self/ns/mnt (processes that share it see the same files); "" where there is none."""
    try:
        return f"-{os.stat('/proc/self/ns/mnt').st_ino}"
    except OSError:
        return ""


def make_folder(folder: Path) -> Path:
    """The folder, created 0700; one that another user owns or others may enter is refused (its socket could be
    someone else's agent, or reachable by others)."""
    try:
        folder.mkdir(mode=0o700, parents=True, exist_ok=True)
        st = folder.lstat()
    except OSError as e:
        raise ConfigError(f"agent folder {folder}: {e.strerror or e}") from None
    if not stat.S_ISDIR(st.st_mode):
        raise ConfigError(f"agent folder {folder} is not a directory (a link?)")
    if st.st_uid != os.getuid():
        raise ConfigError(f"agent folder {folder} belongs to uid {st.st_uid}, not this user ({os.getuid()})")
    if st.st_mode & 0o077:
        raise ConfigError(f"agent folder {folder} has mode {stat.S_IMODE(st.st_mode):o}: others may enter it; "
                          f"chmod 700 it")
    return folder


def socket_path(folder: Path) -> Path:
    return folder / "agent.sock"


def lock_path(folder: Path) -> Path:
    return folder / "agent.lock"


def log_path(folder: Path) -> Path:
    return folder / "agent.log"
