"""Run a function on N real processes joined by a gloo process group (CPU), and collect results.

    results = run_ranks(fn, world_size, *args)      # fn(rank, world_size, *args), sync or async

fn must be importable (defined at module level). Each rank's return value comes back pickled; an
exception on any rank fails the call with every rank's traceback; a hang is killed after `timeout`.
`may_die` lists ranks that are expected to exit abnormally (killed-rank tests); `env(rank)` adds
environment variables per rank (e.g. TIERED_CKPT_HOST to place ranks on simulated nodes); `exitcodes`, a dict,
receives each rank's exit code (negative: the signal that ended it).
"""
from __future__ import annotations

import asyncio
import datetime
import inspect
import os
import pickle
import shutil
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any, Callable

import torch.multiprocessing as mp


def run_ranks(fn: Callable[..., Any], world_size: int, *args: Any, timeout: float = 180.0,
              may_die: frozenset[int] = frozenset(), env: Callable[[int], dict[str, str]] | None = None,
              exitcodes: dict[int, int | None] | None = None) -> list[Any]:
    ctx = mp.get_context("spawn")
    tmp = Path(tempfile.mkdtemp(prefix="tiered_ckpt-ranks-"))
    procs = [ctx.Process(target=_entry, args=(fn, r, world_size, str(tmp), args, env(r) if env else {}), daemon=True)
             for r in range(world_size)]
    try:
        for p in procs:
            p.start()
        deadline = time.monotonic() + timeout
        for p in procs:
            p.join(max(deadline - time.monotonic(), 0.1))
        hung = [r for r, p in enumerate(procs) if p.is_alive()]
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join()
        results, errors = [], []
        if exitcodes is not None:
            exitcodes.update({r: p.exitcode for r, p in enumerate(procs)})
        for r, p in enumerate(procs):
            out = tmp / f"rank{r}.pkl"
            if not out.exists():
                if r not in may_die:
                    errors.append(f"rank {r}: {'hung' if r in hung else f'exited {p.exitcode}'} without a result")
                results.append(None)
                continue
            status, value = pickle.loads(out.read_bytes())
            if status == "error":
                errors.append(f"rank {r} raised:\n{value}")
            results.append(value)
        if errors:
            raise AssertionError("\n".join(errors))
        return results
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _entry(fn: Callable[..., Any], rank: int, world_size: int, tmp: str, args: tuple[Any, ...],
           env: dict[str, str]) -> None:
    os.environ.update(env)
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{tmp}/store", rank=rank, world_size=world_size,
                            timeout=datetime.timedelta(seconds=120))
    try:
        result = fn(rank, world_size, *args)
        if inspect.iscoroutine(result):
            result = asyncio.run(result)
        payload = ("ok", result)
    except BaseException:
        payload = ("error", traceback.format_exc())
    Path(tmp, f"rank{rank}.pkl.tmp").write_bytes(pickle.dumps(payload))
    os.replace(Path(tmp, f"rank{rank}.pkl.tmp"), Path(tmp, f"rank{rank}.pkl"))
    dist.destroy_process_group()
