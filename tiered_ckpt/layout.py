"""The storage layout: every key a checkpoint uses on a tier, how to parse one back, and the part arithmetic.

    <job>/step-<12 digits>/<incarnation>/manifest.msgpack                     the manifest (rank 0)
    <job>/step-<12 digits>/<incarnation>/committed                            empty: the index committed it here
    <job>/step-<12 digits>/<incarnation>/rank-<5 digits>/checksums.msgpack     one rank's part checksums
    <job>/step-<12 digits>/<incarnation>/rank-<5 digits>/part-<6 digits>       one part of one rank's stream

The incarnation is `ix-<8 hex digits of the index's identity>/<session>`: every opening of a job's engines
writes under its own folder, so a zombie of an earlier incarnation (or an unrelated run that shares the
tier's path and job name but has its own index) can never overwrite bytes another one committed; the
manifest names the folder it describes. Checkpoints of format 1 and 2 have no incarnation folder: their
keys sit right under the step folder, and an empty incarnation stands for that layout.

A rank's stream of `nbytes` bytes is cut into parts of `part_size` bytes (the last one shorter). The plan,
the manifest, the file index and the tiers' listings all go through this module, so a key is formatted
and parsed in one place only.
"""
from __future__ import annotations

import hashlib
import re
import secrets
import time
from dataclasses import dataclass

STEP_DIR = "step-"
MANIFEST = "manifest.msgpack"
COMMITTED = "committed"  # written by rank 0 once the index committed the tier: a copy that outlives the index
CHECKSUMS = "checksums.msgpack"
INDEX_DIR = "ix-"
_KEY = re.compile(r"^(?P<job>[^/]+)/step-(?P<step>\d{12,})/(?:(?P<incarnation>ix-[0-9a-f]{8}/[0-9a-f]{6,})/)?"
                  r"(?:(?P<manifest>manifest\.msgpack)|(?P<committed>committed)|rank-(?P<rank>\d{5,})/"
                  r"(?:(?P<checksums>checksums\.msgpack)|part-(?P<part>\d{6,})))$")


@dataclass(frozen=True)
class PartKey:
    """Where one part of one rank of one checkpoint lives on every tier."""

    job: str
    step: int
    rank: int
    index: int
    incarnation: str = ""

    @property
    def path(self) -> str:
        return f"{rank_prefix(self.job, self.step, self.rank, self.incarnation)}part-{self.index:06d}"


@dataclass(frozen=True)
class ParsedKey:
    """What a key names: kind is "manifest", "committed", "checksums" (rank set) or "part" (rank and index set)."""

    job: str
    step: int
    kind: str
    rank: int | None = None
    index: int | None = None
    incarnation: str = ""


def step_dir(step: int) -> str:
    """The name of one checkpoint's folder (on tiers and in the file index)."""
    return f"{STEP_DIR}{step:012d}"


def parse_step_dir(name: str) -> int | None:
    """The step a folder name stands for, or None when the name is not a step folder."""
    digits = name.removeprefix(STEP_DIR)
    return int(digits) if name.startswith(STEP_DIR) and digits.isdigit() else None


def index_dir(identity: str) -> str:
    """The folder, inside each step folder, of every incarnation that commits to the index `identity`."""
    return f"{INDEX_DIR}{hashlib.sha256(identity.encode()).hexdigest()[:8]}"


def new_session() -> str:
    """A fresh session id: time-ordered (hex milliseconds first), so the newest of several is the largest."""
    return f"{time.time_ns() // 1_000_000:011x}{secrets.token_hex(3)}"


def incarnation_dir(identity: str, session: str) -> str:
    return f"{index_dir(identity)}/{session}"


def probe_key(job: str, session: str, rank: int) -> str:
    """A value the writer writes and removes at once to check that it can write a tier (never a step's key)."""
    return f"{job}/.probe-{session}-r{rank}"


def step_prefix(job: str, step: int) -> str:
    return f"{job}/{step_dir(step)}/"


def job_prefix(job: str) -> str:
    return f"{job}/"


def checkpoint_prefix(job: str, step: int, incarnation: str = "") -> str:
    """Every key one incarnation wrote for a checkpoint ("" : the step folder of formats 1 and 2)."""
    return f"{step_prefix(job, step)}{incarnation}/" if incarnation else step_prefix(job, step)


def rank_prefix(job: str, step: int, rank: int, incarnation: str = "") -> str:
    """Every key one rank writes for a checkpoint (its parts and checksum record)."""
    return f"{checkpoint_prefix(job, step, incarnation)}rank-{rank:05d}/"


def manifest_key(job: str, step: int, incarnation: str = "") -> str:
    return f"{checkpoint_prefix(job, step, incarnation)}{MANIFEST}"


def committed_key(job: str, step: int, incarnation: str) -> str:
    return f"{checkpoint_prefix(job, step, incarnation)}{COMMITTED}"


def rank_meta_key(job: str, step: int, rank: int, incarnation: str = "") -> str:
    return f"{rank_prefix(job, step, rank, incarnation)}{CHECKSUMS}"


def parse_key(key: str) -> ParsedKey | None:
    """The parts of a key this layout wrote, or None for anything else (temp files, foreign keys)."""
    m = _KEY.match(key)
    if m is None:
        return None
    job, step, incarnation = m["job"], int(m["step"]), m["incarnation"] or ""
    if m["manifest"]:
        return ParsedKey(job, step, "manifest", incarnation=incarnation)
    if m["committed"]:
        return ParsedKey(job, step, "committed", incarnation=incarnation)
    if m["checksums"]:
        return ParsedKey(job, step, "checksums", int(m["rank"]), incarnation=incarnation)
    return ParsedKey(job, step, "part", int(m["rank"]), int(m["part"]), incarnation)


def part_count(nbytes: int, part_size: int) -> int:
    return -(-nbytes // part_size)


def part_range(nbytes: int, part_size: int, index: int) -> tuple[int, int]:
    """[start, end) of part `index` in a stream of `nbytes` bytes."""
    start = index * part_size
    return start, min(start + part_size, nbytes)
