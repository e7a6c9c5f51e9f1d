"""One root exception; subclasses also derive from the matching builtin so callers can catch either; and
`redact`, which keeps the secrets of a URL out of every message, log line and CLI output."""
from __future__ import annotations

import re

_SECRET_OPTION = re.compile(r"([?&][^=&?]*password=)[^&]*")


def redact(url: str) -> str:
    """`url` with no secret left: the password of its userinfo (everything from `://` to the last `@` before
    the host, so a password holding `@`, `:` or `/` is hidden whole) and every `*password=` option. For
    messages, logs and the CLI. A string that is not a URL comes back unchanged."""
    scheme, sep, rest = url.partition("://")
    if not sep:
        return url
    rest = _SECRET_OPTION.sub(r"\1***", rest)  # first: an option's value may hold an '@' too
    userinfo, at, hostpart = rest.rpartition("@")
    if not at:
        return f"{scheme}{sep}{rest}"
    user, colon, _ = userinfo.partition(":")
    shown = f"{user}:***" if colon else "***"  # a lone userinfo may be a password (redis://secret@host)
    return f"{scheme}{sep}{shown}@{hostpart}"


class TieredCkptError(Exception):
    """Root of every error raised by tiered_ckpt."""


class ConfigError(TieredCkptError, ValueError):
    """Bad configuration. The message names the file and the TOML key at fault."""

    def __init__(self, message: str, *, key: str | None = None, file: str | None = None):
        where = ", ".join(p for p in (f"file {file}" if file else "", f"key {key!r}" if key else "") if p)
        super().__init__(f"{where}: {message}" if where else message)
        self.message = message  # without the file and key: a caller that knows the file adds it
        self.key = key
        self.file = file


class StateError(TieredCkptError, ValueError):
    """The state given to save/load cannot be handled (unsupported object, shape or dtype mismatch)."""


class TierError(TieredCkptError):
    """A tier driver failed. `tier` names the tier; `retryable` tells the pipeline whether to retry."""

    retryable = False

    def __init__(self, message: str, *, tier: str | None = None):
        super().__init__(f"tier {tier!r}: {message}" if tier else message)
        self.tier = tier


class TierNotFound(TierError, LookupError):
    """The key is not on the tier."""


class TierUnavailable(TierError, ConnectionError):
    """The tier cannot be reached right now; retrying may help."""

    retryable = True


class TierTimeout(TierError, TimeoutError):
    """A tier operation took longer than its timeout; retrying may help."""

    retryable = True


class TierFull(TierError, OSError):
    """The tier has no room for the write (capacity or disk full)."""


class IntegrityError(TierError):
    """Bytes read back do not match the checksum or length in the manifest."""


class AgentUnavailable(TieredCkptError, ConnectionError):
    """The node agent did not take a save in time, or went away mid-drain: the trainer drains it in-process."""


class IndexUnavailable(TieredCkptError, ConnectionError):
    """The index server cannot be reached; the message names it."""


class Fenced(TieredCkptError, PermissionError):
    """A newer incarnation of the job fenced this process: it must not commit or delete any more."""


class WriterConflict(TieredCkptError, BlockingIOError):
    """Another process holds the job's writer lease (one writer per job; readers may run at any time)."""


class AuthenticationError(TieredCkptError, PermissionError):
    """A server refused the credentials (the message names the server, never the password)."""


class RankFailed(TieredCkptError):
    """Another rank (named in the message) failed a save, a plan or an agreement that every rank takes part
    in; every rank raises the same. `tier` names the tier when the failure was one tier's."""

    def __init__(self, message: str, *, tier: str | None = None):
        super().__init__(f"tier {tier!r}: {message}" if tier else message)
        self.tier = tier


class IncompleteCheckpoint(TieredCkptError, LookupError):
    """The requested checkpoint is not complete on any reachable tier (or does not exist)."""


class CheckpointLost(TieredCkptError):
    """The index lists complete checkpoints, but none can be loaded: their parts are gone from every tier (nodes
    lost with their memory and disks, a bucket emptied), or their records are unreadable. The message names, per
    checkpoint, the ranks whose parts no tier holds. Not an IncompleteCheckpoint: a program that starts fresh
    when nothing was ever saved must not start fresh here, over lost work."""


class FreshStart(IncompleteCheckpoint):
    """Every checkpoint the index lists complete is lost (its parts gone from every tier), and [engine] on_lost =
    "fresh": start fresh, as when nothing was saved. The message names the lost checkpoints, which the first save
    removes. An IncompleteCheckpoint, so code that starts fresh when nothing was saved does so unattended."""


class CheckpointExists(TieredCkptError, FileExistsError):
    """A complete checkpoint with this step already exists; delete it before saving the step again."""


class SaveError(TieredCkptError):
    """A save failed: it committed on no tier, or a tier marked `required` failed it; raised by the next `save()`
    or `close()` only when the failure policy stops training (`reason` says which rule). `errors` maps tier name
    to its exception."""

    def __init__(self, step: int, errors: dict[str, BaseException], *, reason: str | None = None):
        detail = "; ".join(f"{t}: {type(e).__name__}: {e}" for t, e in errors.items())
        super().__init__(f"checkpoint step {step} failed on {len(errors)} tier(s): {detail}"
                         + (f" -- {reason}" if reason else ""))
        self.step = step
        self.errors = errors
        self.reason = reason  # why training stops, when the failure policy raised it (save/failures.py)
