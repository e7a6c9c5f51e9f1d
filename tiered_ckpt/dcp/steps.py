"""The step a DCP checkpoint_id names: an int, or a path or id whose last component ends in digits
("step-1000", "/ckpt/1000", "tiered_ckpt://gpt/1000"), as torchtitan's and Accelerate's folders are named."""
from __future__ import annotations

import os
import re

_TRAILING = re.compile(r"(\d+)$")
SCHEME = "tiered_ckpt://"


def step_of(checkpoint_id: str | os.PathLike[str] | int) -> int:
    if isinstance(checkpoint_id, int) and not isinstance(checkpoint_id, bool):
        return checkpoint_id
    text = os.fspath(checkpoint_id).rstrip("/")
    found = _TRAILING.search(text.rsplit("/", 1)[-1])
    if found is None:
        raise ValueError(f"checkpoint_id {text!r} names no step: tiered_ckpt's writer and reader take an int step, "
                         f"or an id whose last component ends in the step (e.g. 'step-1000')")
    return int(found.group(1))


def checkpoint_id(job: str, step: int) -> str:
    return f"{SCHEME}{job}/{step}"
