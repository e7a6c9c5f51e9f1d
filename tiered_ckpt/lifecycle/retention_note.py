"""Where retention left off on a tier, kept in the index (`Index.put_note`), so that a new process's first pass
judges the window a steady pass judges instead of the whole history.

A pass leaves three things for the next (retention.py, `_remember`): the floor (the oldest step it judges
again), the older steps kept as best (asked for by name) and the steps from the floor on that it left complete
on the tier (expected to be listed again). Kept with a digest of the tier's rules: a note written under other
rules (keep_last lowered, keep_every raised since) is not used, and that tier's first pass judges the whole
history once. A note is written only once the pass that made it has finished its removals, so a crash part-way
leaves the previous note, whose window covers what the pass was removing. What a note cannot vouch for is caught
where it was before: a step it names that the index no longer lists sends the pass back to the whole history
(`Retention._window`), and an index that lost its notes (a Redis restarted empty) has none to give.
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import Any

from .rules import Rules

VERSION = 1


def note_name(tier: str) -> str:
    """The index note of `tier`'s retention (tier names are plain file names: config.validate_name)."""
    return f"retention.{tier}"


def rules_digest(rules: Rules) -> str:
    """The rules as one short string: equal digests, equal rules (a frozen dataclass's repr names every field)."""
    return hashlib.sha1(repr(rules).encode()).hexdigest()[:16]


@dataclass(frozen=True)
class Place:
    """What one pass left for the next on one tier (see the module's docstring)."""

    floor: int
    held: frozenset[int]
    seen: frozenset[int]

    def to_bytes(self, rules: Rules) -> bytes:
        return json.dumps({"v": VERSION, "rules": rules_digest(rules), "floor": self.floor,
                           "held": sorted(self.held), "seen": sorted(self.seen)}, separators=(",", ":")).encode()

    @classmethod
    def from_bytes(cls, data: bytes | None, rules: Rules) -> "Place | None":
        """The place a note records, or None: no note, a note of other rules, of another version, or unreadable."""
        if not data:
            return None
        try:
            note: Any = json.loads(data)
            if not isinstance(note, dict) or note.get("v") != VERSION or note.get("rules") != rules_digest(rules):
                return None
            floor, held, seen = note["floor"], note["held"], note["seen"]
            if not isinstance(floor, int) or not all(isinstance(s, int) for s in [*held, *seen]):
                return None
            return cls(floor, frozenset(held), frozenset(seen))
        except (ValueError, TypeError, KeyError):
            return None


NOWHERE = b"{}"  # the note of a tier whose next pass judges the whole history (nothing complete on it yet)
