"""Test-only fault points: a process SIGKILLs itself at a named point of a save, so that a test can kill the trainer
or the node agent (a detached process, out of reach of a test's patches) in each phase of a save.

    TIERED_CKPT_FAULT="trainer:committed:host@2"           # the trainer, right after step 2 committed on host
    TIERED_CKPT_FAULT="agent:part-written:disk@2"          # the agent, once the first part of step 2 is on disk

Each fault is `<role>:<point>[@<step>]`, several separated by commas. The role is the process's: "agent" in the
node agent (server.run_agent sets it), "trainer" elsewhere; an agent the trainer starts inherits the variable and
acts on its own role's faults only. The variable is read once per process; unset (always, outside tests) a point
costs one attribute test.

The points, in a save's order (`<tier>` is the tier's name):
  trainer: staged                   the state copied into the staging buffer; nothing committed
           records-written:<tier>   the parts and records on the tier, not committed (the memory tier: not yet
                                    handed to the agent either)
           handed-off               the agent accepted the slower tiers; the memory tier not yet committed
           committed:<tier>         the tier committed (the memory tier: the agent drains from here on)
  agent:   accepted                 the order journaled and accepted; nothing drained
           part-written:<tier>      one part on the tier, the others in flight or not started
           records-written:<tier>   every part and the records on the tier; not committed
           committed:<tier>         the tier committed
           drained                  every tier settled; the journal entry not yet removed
"""
from __future__ import annotations

import os
import signal
import sys

ENV = "TIERED_CKPT_FAULT"
role = "trainer"  # the agent's entry point sets "agent"
_armed: dict[str, int | None] | None = None  # "role:point" -> the step it acts on (None: any); parsed once


def _parse(text: str) -> dict[str, int | None]:
    armed: dict[str, int | None] = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        name, _, step = item.partition("@")
        armed[name] = int(step) if step else None
    return armed


def reached(point: str, step: int | None = None) -> None:
    """SIGKILL this process if `TIERED_CKPT_FAULT` names `point` for its role (and `step`, if it names one)."""
    global _armed
    if _armed is None:
        _armed = _parse(os.environ.get(ENV, ""))
    if not _armed:
        return
    name = f"{role}:{point}"
    if name not in _armed:
        return
    wanted = _armed[name]
    if wanted is not None and wanted != step:
        return
    sys.stderr.write(f"tiered_ckpt fault point {name} (step {step}): SIGKILL pid {os.getpid()}\n")
    sys.stderr.flush()
    os.kill(os.getpid(), signal.SIGKILL)
