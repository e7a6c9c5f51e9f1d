"""What `ls` says about the RAM jobs hold in the memory tier(s) on this machine (lifecycle/host_memory.py);
`tiered-ckpt free` (cli/free.py) gives it back. Reads only; nothing here imports torch."""
from __future__ import annotations

from typing import Any

from ..lifecycle.host_memory import held, jobs_in, memory_tiers
from ..sizes import format_size
from ..job_store import JobStore


def host_memory(checkpoints: JobStore) -> list[dict[str, Any]]:
    """Per memory tier of the stack: the RAM the job holds there (HostMemory.as_json) and, under `other_jobs`,
    what every other job in that folder holds ({job: bytes}). Reads only."""
    out = []
    for name, root in memory_tiers(checkpoints.io):
        entry = held(name, root, checkpoints.job).as_json()
        entry["other_jobs"] = {job: held(name, root, job).nbytes for job in jobs_in(root) if job != checkpoints.job}
        out.append(entry)
    return out


def print_host_memory(entries: list[dict[str, Any]], job: str, budget: int | None = None) -> None:
    """`ls`'s lines on RAM, printed only where some job holds some: none for a stack without a memory tier; and
    the job's budget ([engine] host_memory) when one is set."""
    if budget is not None:
        held_here = sum(e["nbytes"] for e in entries)
        print(f"host_memory budget on this machine: {format_size(budget)}; the memory tier(s) hold "
              f"{format_size(held_here)} of it (checkpoints and staging files; live processes' read buffers and any "
              f"anonymous staging come on top)")
    for e in entries:
        others = {j: n for j, n in e["other_jobs"].items() if n}
        if not e["nbytes"] and not others:
            continue
        dead = (f" ({format_size(e['staging_dead'])} left by processes that died: `tiered-ckpt gc` frees it)"
                if e["staging_dead"] else "")
        hint = "; `tiered-ckpt free` gives it back" if e["nbytes"] else ""
        print(f"RAM on this machine, memory tier {e['tier']} ({e['path']}): job {job!r} holds "
              f"{format_size(e['nbytes'])}: checkpoints {format_size(e['checkpoints'])}, staging buffers "
              f"{format_size(e['staging'])}{dead}{hint}")
        if others:
            print(f"  other jobs there: {', '.join(f'{j} {format_size(n)}' for j, n in sorted(others.items()))} "
                  f"(`tiered-ckpt free --all-jobs` frees every job's)")
