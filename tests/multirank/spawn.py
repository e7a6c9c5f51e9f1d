"""Run a function on N real processes joined by a gloo process group (CPU), and collect results.

    results = run_ranks(fn, world_size, *args)      # fn(rank, world_size, *args), sync or async

fn must be importable (defined at module level). Each rank's return value comes back pickled; an
exception on any rank fails the call with every rank's traceback; a hang is killed after `timeout`.

`may_die` lists ranks that are expected to exit abnormally (killed-rank tests); `env(rank)` adds
environment variables per rank (e.g. TIERED_CKPT_HOST to place ranks on simulated nodes); `exitcodes`, a dict,
receives each rank's exit code (negative: the signal that ended it).

Ranks are forked from multiprocessing's fork server, which imports torch and torch.distributed once per test
process: importing them costs each fresh interpreter ~4 s of CPU on a 2-core machine, most of the multi-rank
suite's time under "spawn". tiered_ckpt and the test module are imported in each rank, after its environment is
set; each rank gets the caller's environment and working directory as they are at the call (the server's are
those of its start).
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
    ctx = _context()
    tmp = Path(tempfile.mkdtemp(prefix="tiered_ckpt-ranks-"))
    here = (dict(os.environ), os.getcwd())
    procs = [ctx.Process(target=_entry, args=(fn, r, world_size, str(tmp), args, here, env(r) if env else {}),
                         daemon=True) for r in range(world_size)]
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


# imported once in the fork server, before any rank forks from it; nothing of tiered_ckpt (it reads some
# environment variables at import: a rank's must be in place first)
PRELOAD = ["torch", "torch.distributed", "torch.distributed.tensor", "torch.distributed.checkpoint", "numpy"]


def _context() -> Any:
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)  # read when the server starts (the first call), ignored after
    return ctx


def _entry(fn: Callable[..., Any], rank: int, world_size: int, tmp: str, args: tuple[Any, ...],
           here: tuple[dict[str, str], str], env: dict[str, str]) -> None:
    environ, cwd = here
    os.environ.clear()
    os.environ.update(environ)
    os.environ.update(env)
    os.chdir(cwd)
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
