"""Helpers shared by the unit tests."""
import asyncio
import time

import torch


def state_of(value: float, n: int = 50_000):
    return {"w": torch.full((n,), value), "b": torch.full((7, 3), value, dtype=torch.float64), "step": int(value)}


async def load_values(engine, step=None, tiers=None):
    out = state_of(-1.0)
    info = await engine.load(out, step=step, tiers=tiers)
    return info, out


async def wait_until(condition, timeout: float = 30.0, what: str = "the condition"):
    """Poll `condition()` (a visible counter or state, never wall-clock guesses) until it holds."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} did not hold within {timeout}s")
        await asyncio.sleep(0.005)
