"""The step a DCP checkpoint_id names: an int, or a path or id whose last component ends in digits
("step-1000", "/ckpt/1000", "tiered_ckpt://gpt/1000"), as torchtitan's and Accelerate's folders are named."""
from __future__ import annotations

import os
import re
import sys
from typing import Any

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


_ASYNC_SAVE = ("torch.distributed.checkpoint.state_dict_saver", "async_save")


def async_save_call(stager: Any, depth: int = 8) -> dict[str, Any] | None:
    """The arguments of the dcp.async_save call staging through `stager` now (its `checkpoint_id`,
    `async_checkpointer_type`, ...), or None when stage() was not called by async_save. async_save calls
    stage() before it hands the checkpoint_id to the writer (reset(), in its own thread), so stage() reads them
    from that call's frame, a few frames up."""
    frame = sys._getframe(1)
    for _ in range(depth):
        if frame is None:
            return None
        names = frame.f_globals.get("__name__"), frame.f_code.co_name
        if names == _ASYNC_SAVE and frame.f_locals.get("async_stager") is stager:
            return dict(frame.f_locals)
        frame = frame.f_back
    return None
