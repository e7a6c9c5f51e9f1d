"""What checkpointing takes from the training loop: the same small GPT trained for the same steps with no
checkpoint, with tiered_ckpt saving lazily every few steps (memory + disk tiers), with DCP saving
synchronously, and with no checkpoint but a few milliseconds of pure Python handed to a background thread at
each save point, interleaved A B C D A B C D, in one process; the slowdown of each against no checkpoint.

The last run is the yardstick for the others: the training thread runs Python between its kernels, so any
Python another thread runs meanwhile (the engine's event loop, its pipelines, the index) holds the GIL that the
training thread then waits for. The report splits tiered_ckpt's cost per save into the `save()` call, the wait
for the lazy copy and the slower step after a save, and gives the CPU each group of the engine's threads used
per save (Linux).

`--agent` adds a run with `[engine] agent = "on"` beside the in-process one, in the same interleaving: the
trainer commits the memory tier and hands the disk tier to a node agent (a process of its own, in a private
folder started for this run). Both runs report their time to durable per tier (save() to the tier committed,
medians over the saves the tier committed) and, for the agent run, the agent process's CPU per save.

    python -m tiered_ckpt.bench.loop_share [--steps 60] [--every 3] [--repeats 3] [--agent] [--no-dcp] [--json]
"""
from __future__ import annotations

import os
import queue
import re
import shutil
import statistics
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch
import torch.nn.functional as F

from ..config import parse_config
from ..sync import Checkpointer


class _Block(torch.nn.Module):
    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.ln1, self.ln2 = torch.nn.LayerNorm(dim), torch.nn.LayerNorm(dim)
        self.attn = torch.nn.MultiheadAttention(dim, heads, batch_first=True)
        self.mlp = torch.nn.Sequential(torch.nn.Linear(dim, 4 * dim), torch.nn.GELU(), torch.nn.Linear(4 * dim, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.ln1(x)
        mask = torch.triu(torch.ones(x.shape[1], x.shape[1], dtype=torch.bool), 1)
        x = x + self.attn(h, h, h, attn_mask=mask, need_weights=False)[0]
        return x + self.mlp(self.ln2(x))


def gpt(vocab: int = 256, ctx: int = 64, dim: int = 208, layers: int = 4, heads: int = 4) -> torch.nn.Module:
    """A GPT-2-shaped model of about 2.2M parameters (the README's example is of this kind)."""
    model = torch.nn.Sequential(torch.nn.Embedding(vocab, dim), *[_Block(dim, heads) for _ in range(layers)],
                                torch.nn.LayerNorm(dim), torch.nn.Linear(dim, vocab))
    return model


@dataclass
class Run:
    """One training run: its seconds, and per save (runs that save): how long `save()` took to return, how
    long the step waited for the lazy copy before `optimizer.step()`, and each step's seconds, those right
    after a save apart from the others (background work runs mostly then)."""

    seconds: float
    save_calls: list[float] = field(default_factory=list)
    staged_waits: list[float] = field(default_factory=list)
    steps_after_save: list[float] = field(default_factory=list)
    other_steps: list[float] = field(default_factory=list)


def _python_for(ms: float) -> None:
    """`ms` of pure Python (no call that releases the GIL)."""
    end = time.perf_counter() + ms / 1000
    while time.perf_counter() < end:
        sum(i * i for i in range(64))


def _train(steps: int, every: int, save: Callable[[int, dict[str, Any]], Any] | None,
           before_save: Callable[[int], None] | None = None) -> Run:
    """Train for `steps` steps, saving every `every` steps through `save` (None: never); `before_save(step)` is
    called before each save, outside the timed call."""
    torch.manual_seed(0)
    model = gpt()
    optim = torch.optim.AdamW(model.parameters(), lr=1e-3)
    state = {"model": model, "optim": optim}
    g = torch.Generator().manual_seed(0)
    pending = None
    run = Run(0.0)
    saved_before = False
    start = time.perf_counter()
    for step in range(1, steps + 1):
        began = time.perf_counter()
        x = torch.randint(0, 256, (16, 65), generator=g)
        loss = F.cross_entropy(model(x[:, :-1]).reshape(-1, 256), x[:, 1:].reshape(-1))
        loss.backward()
        if pending is not None and hasattr(pending, "staged"):
            waited = time.perf_counter()
            pending.staged()  # the lazy copy is done before the weights change
            run.staged_waits.append(time.perf_counter() - waited)
        pending = None
        optim.step()
        optim.zero_grad(set_to_none=True)
        (run.steps_after_save if saved_before else run.other_steps).append(time.perf_counter() - began)
        saved_before = False
        if save is not None and step % every == 0:
            if before_save is not None:
                before_save(step)
            called = time.perf_counter()
            pending = save(step, state)
            run.save_calls.append(time.perf_counter() - called)
            saved_before = True
    run.seconds = time.perf_counter() - start
    return run


class BackgroundPython:
    """A "save" that hands `ms` of pure Python to a background thread and returns at once: what any Python
    work beside the training thread costs it (the GIL), with no checkpoint at all. `close()` waits for the
    last job and ends the thread, so nothing of it runs into the next run."""

    def __init__(self, ms: float):
        self.ms = ms
        self._work: queue.SimpleQueue[float | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._serve, daemon=True, name="loop-share-background-python")
        self._thread.start()

    def _serve(self) -> None:
        while (job := self._work.get()) is not None:
            _python_for(job)

    def __call__(self, step: int, state: dict[str, Any]) -> None:
        self._work.put(self.ms)

    def close(self) -> None:
        self._work.put(None)
        self._thread.join()


def thread_cpu() -> dict[int, tuple[str, float, float]]:
    """Each live thread of this process by its native id: its name and CPU seconds, user and system (Linux:
    /proc; elsewhere {}). By id, not name: a closed engine's threads may outlive it under the same names."""
    tick = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
    out: dict[int, tuple[str, float, float]] = {}
    for t in threading.enumerate():
        if t.native_id is None:
            continue
        try:
            with open(f"/proc/self/task/{t.native_id}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        out[t.native_id] = (t.name, int(fields[11]) / tick, int(fields[12]) / tick)
    return out


def _thread_group(name: str) -> str:
    """The engine's threads by job: its event loop, the copy, the CPU pool, each tier's I/O, the default
    executor (the index's file operations, the walk)."""
    if name == "tiered_ckpt-loop":
        return "event loop"
    if name.startswith("tiered_ckpt-events"):
        return "event log"
    if name.startswith("tiered_ckpt-copy"):
        return "staging copy"
    if name.startswith("tiered_ckpt-hash") or re.fullmatch(r"tiered_ckpt_\d+", name):
        return "checksums and scatters"
    if name.startswith("tiered_ckpt-"):
        return f"tier {name[len('tiered_ckpt-'):].rsplit('_', 1)[0]}"
    if name.startswith(("asyncio_", "uvloop_", "ThreadPoolExecutor-")):
        return "default executor (index files, the walk)"
    return ""


def process_cpu(pid: int | None) -> float | None:
    """A process's CPU seconds, user and system (Linux /proc; None when it is gone or unknown)."""
    if pid is None:
        return None
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _agent_pid(folder: Path) -> int | None:
    try:
        return int((folder / "agent.lock").read_text() or 0) or None
    except (FileNotFoundError, ValueError):
        return None


def measure(steps: int = 60, every: int = 3, repeats: int = 3, base: Path | None = None, shm: str = "/dev/shm",
            dcp: bool = True, calibrate_ms: float = 10.0, agent: bool = False) -> dict[str, Any]:
    """Interleaved runs A B (B') C D (no checkpoint, tiered_ckpt, with `agent` tiered_ckpt with the node agent,
    DCP, background Python), `repeats` times."""
    if every < 1 or steps < 2 * every:
        raise ValueError(f"steps ({steps}) must be at least twice every ({every}): the split of a save's cost "
                         f"needs two saves (the first one plans and makes the buffers)")
    if base is not None:
        base.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="loop-", dir=base))
    shm_dir = Path(tempfile.mkdtemp(prefix="tiered_ckpt-loop-", dir=shm))
    nbytes = sum(p.numel() * p.element_size() for p in gpt().parameters()) * 3  # weights and two AdamW moments
    config = parse_config({"engine": {"job": "loop", "index": f"file://{work}/index"},
                           "tiers": [{"name": "host", "kind": "memory", "path": str(shm_dir), "keep_last": 2},
                                     {"name": "disk", "kind": "local", "path": str(work / "disk"), "keep_last": 2}]})
    runs: dict[str, list[Run]] = {"none": [], "tiered_ckpt": [], "tiered_ckpt_agent": [], "dcp": [], "python": []}
    # per variant, per thread group: (user, system) per save, one per repeat
    cpu: dict[str, dict[str, list[tuple[float, float]]]] = {"tiered_ckpt": {}, "tiered_ckpt_agent": {}}
    durable: dict[str, dict[str, list[float]]] = {"tiered_ckpt": {}, "tiered_ckpt_agent": {}}  # tier → seconds
    agent_cpu: list[float] = []  # the agent process's CPU per save, one per repeat
    agent_folder = work / "agent"  # a private agent for these runs (0700), gone when idle
    saved_env = {k: os.environ.get(k) for k in ("TIERED_CKPT_AGENT_DIR", "TIERED_CKPT_AGENT_IDLE")}
    if agent:
        agent_folder.mkdir(mode=0o700)
        os.environ.update(TIERED_CKPT_AGENT_DIR=str(agent_folder), TIERED_CKPT_AGENT_IDLE="60")

    def tiered(r: int, variant: str) -> None:
        engine = {"job": f"loop{r}{variant}", "agent": "on" if variant == "tiered_ckpt_agent" else "off"}
        handles: list[Any] = []
        with Checkpointer(config.replace_engine(**engine)) as ckpt:
            marks: dict[str, Any] = {}

            def mark(step: int) -> None:
                if step == 2 * every:  # from the second save on: the first one plans and makes the buffers
                    marks["before"] = thread_cpu()
                if variant == "tiered_ckpt_agent" and step >= 2 * every and marks.get("agent_cpu") is None:
                    # the agent the first save started may still be starting: from the first save it serves
                    marks["agent"] = _agent_pid(agent_folder)
                    marks["agent_cpu"] = process_cpu(marks["agent"])
                    marks["agent_from"] = step

            def save(step: int, state: dict[str, Any]) -> Any:
                handles.append(ckpt.save(step, state, lazy=True))
                return handles[-1]

            run = _train(steps, every, save, mark)
            ckpt.wait_all()  # the last save's background work counts too
            after, before = thread_cpu(), marks["before"]
            agent_after = process_cpu(marks.get("agent"))
        runs[variant].append(run)
        counted = len(run.save_calls) - 1
        if marks.get("agent_cpu") is not None and agent_after is not None:
            agent_cpu.append((agent_after - marks["agent_cpu"]) / (steps // every - marks["agent_from"] // every + 1))
        for h in handles[1:]:
            inner = h._handle
            for tier in inner.committed_on:
                if tier in inner.durable_at:
                    durable[variant].setdefault(tier, []).append(inner.durable_at[tier])
        groups: dict[str, list[float]] = {}
        for tid, (name, user, system) in after.items():
            group = _thread_group(name)
            if group:
                _, u0, s0 = before.get(tid, (name, 0.0, 0.0))
                g = groups.setdefault(group, [0.0, 0.0])
                g[0] += user - u0
                g[1] += system - s0
        for group, (user, system) in groups.items():
            cpu[variant].setdefault(group, []).append((user / counted, system / counted))

    try:
        _train(5, every, None)  # warm up the allocator and the kernels
        for r in range(repeats):
            runs["none"].append(_train(steps, every, None))
            tiered(r, "tiered_ckpt")
            if agent:
                tiered(r, "tiered_ckpt_agent")
            if dcp:
                import torch.distributed.checkpoint as dcp_

                def dcp_save(step: int, state: dict[str, Any], r: int = r) -> None:
                    dcp_.save({"model": state["model"].state_dict(), "optim": state["optim"].state_dict()},
                              checkpoint_id=str(work / f"dcp{r}-{step}"), no_dist=True)

                runs["dcp"].append(_train(steps, every, dcp_save))
            if calibrate_ms > 0:
                background = BackgroundPython(calibrate_ms)
                try:
                    runs["python"].append(_train(steps, every, background))
                finally:
                    background.close()
    finally:
        if agent:  # the private agent goes now, not after its idle time (it drains nothing any more)
            pid = _agent_pid(agent_folder)
            if pid is not None and process_cpu(pid) is not None:
                import signal

                os.kill(pid, signal.SIGTERM)
                for _ in range(100):
                    if process_cpu(pid) is None or "Z" in Path(f"/proc/{pid}/stat").read_text().split()[2]:
                        break
                    time.sleep(0.05)
        for k, v in saved_env.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        shutil.rmtree(work, ignore_errors=True)
        shutil.rmtree(shm_dir, ignore_errors=True)
    saves = steps // every

    def per_save_cost(name: str) -> float:
        """What the loop lost per save: the median of the pairs' (run - no checkpoint) / saves."""
        return statistics.median((a.seconds - b.seconds) / saves for a, b in zip(runs[name], runs["none"]))

    def step_after(name: str) -> float:
        """How much slower the step after a save is than the run's other steps (medians; within one run, so
        the machine's drift between runs cancels)."""
        return statistics.median(statistics.median(r.steps_after_save) - statistics.median(r.other_steps)
                                 for r in runs[name])

    def breakdown_of(name: str) -> dict[str, float]:
        tiered = runs[name]
        b = {
            "save_call": statistics.median(x for r in tiered for x in r.save_calls[1:]),  # (the first one plans)
            "staged_wait": statistics.median(x for r in tiered for x in r.staged_waits),
            "step_after_save": step_after(name),
            "per_save": per_save_cost(name),
            "step": statistics.median(statistics.median(r.other_steps) for r in tiered),
        }
        # the split's share of the loop: steadier than the whole runs' ratio, whose runs the machine's drift moves
        b["split_share"] = (b["save_call"] + b["step_after_save"]) / (every * b["step"])
        return b

    def cpu_of(name: str) -> dict[str, tuple[float, float]]:
        return {g: (statistics.median(u for u, _ in v), statistics.median(s for _, s in v))
                for g, v in sorted(cpu[name].items())}

    breakdown = breakdown_of("tiered_ckpt")
    return {"agent": {"breakdown": breakdown_of("tiered_ckpt_agent"), "background_cpu_per_save": cpu_of(
                "tiered_ckpt_agent"), "agent_cpu_per_save": statistics.median(agent_cpu) if agent_cpu else None}
            if agent else None,
            "durable": {name: {t: statistics.median(v) for t, v in tiers.items()} for name, tiers in durable.items()
                        if tiers},
            "steps": steps, "every": every, "state_bytes": nbytes, "calibrate_ms": calibrate_ms,
            "seconds": {k: statistics.median(r.seconds for r in v) for k, v in runs.items() if v},
            "slowdown": {k: statistics.median(a.seconds / b.seconds - 1 for a, b in zip(v, runs["none"]))
                         for k, v in runs.items() if v and k != "none"},
            "breakdown": breakdown,
            "python_per_save": per_save_cost("python") if runs["python"] else None,
            "python_step_after": step_after("python") if runs["python"] else None,
            "background_cpu_per_save": cpu_of("tiered_ckpt"),
            "runs": {k: [r.seconds for r in v] for k, v in runs.items()}}


def report(r: dict[str, Any]) -> str:
    lines = [f"training loop: {r['steps']} steps of a ~2.2M-parameter GPT (a {r['state_bytes'] / 2**20:.0f} MiB "
             f"state with AdamW), a save every {r['every']} steps; interleaved runs, slowdown = median of the "
             f"runs' ratios to the run without checkpoints beside them", "",
             "| run | seconds | slowdown |", "|---|---:|---:|", f"| no checkpoint | {r['seconds']['none']:.2f} | |"]
    labels = (("tiered_ckpt", "tiered_ckpt, lazy saves (memory + disk)"),
              ("tiered_ckpt_agent", "tiered_ckpt, lazy saves, agent on (the disk tier drained by the node agent)"),
              ("dcp", "DCP save, synchronous"),
              ("python", f"no checkpoint; {r['calibrate_ms']:g} ms of pure Python on a background thread at each save"))
    for name, label in labels:
        if name in r["slowdown"]:
            lines.append(f"| {label} | {r['seconds'][name]:.2f} | {100 * r['slowdown'][name]:.1f}% |")
    b = r["breakdown"]
    lines += ["", "tiered_ckpt, per save (ms, medians):", "", "| where | ms |", "|---|---:|",
              f"| `save()` returns (the walk, the cached plan, handing the copy on) | {1000 * b['save_call']:.2f} |",
              f"| waiting for the lazy copy before `optimizer.step()` | {1000 * b['staged_wait']:.2f} |",
              f"| the step after a save, beyond the other steps (the wait above included) | "
              f"{1000 * b['step_after_save']:.2f} |",
              f"| all the loop lost per save (run minus no checkpoint, / saves) | {1000 * b['per_save']:.2f} |",
              f"| the share of the loop by this split: the call and the step after it, over {r['every']} steps | "
              f"{100 * b['split_share']:.1f}% |"]
    if r.get("python_per_save") is not None:
        lines += [f"| for comparison, {r['calibrate_ms']:g} ms of background Python at each save point: the step "
                  f"after it, beyond the other steps | {1000 * r['python_step_after']:.2f} |",
                  f"| the same: all the loop lost per save point | {1000 * r['python_per_save']:.2f} |"]
    if r.get("background_cpu_per_save"):
        lines += ["", "the engine's threads, CPU per save from the second save on (ms):", "", "| threads | user | system |",
                  "|---|---:|---:|"]
        lines += [f"| {g} | {1000 * u:.1f} | {1000 * s:.1f} |" for g, (u, s) in r["background_cpu_per_save"].items()]
    a = r.get("agent")
    if a:
        b2 = a["breakdown"]
        lines += ["", "agent off vs on, per save (ms, medians):", "", "| where | agent off | agent on |",
                  "|---|---:|---:|"]
        for key, label in (("save_call", "`save()` returns"), ("staged_wait", "waiting for the lazy copy"),
                           ("step_after_save", "the step after a save, beyond the other steps"),
                           ("per_save", "all the loop lost per save")):
            lines.append(f"| {label} | {1000 * b[key]:.2f} | {1000 * b2[key]:.2f} |")
        lines.append(f"| the share of the loop by the split | {100 * b['split_share']:.1f}% | "
                     f"{100 * b2['split_share']:.1f}% |")
        off, on = r["background_cpu_per_save"], a["background_cpu_per_save"]
        for g in sorted(set(off) | set(on)):
            u_off, s_off = off.get(g, (0.0, 0.0))
            u_on, s_on = on.get(g, (0.0, 0.0))
            lines.append(f"| trainer thread CPU: {g} (user + system) | {1000 * (u_off + s_off):.1f} | "
                         f"{1000 * (u_on + s_on):.1f} |")
        if a.get("agent_cpu_per_save") is not None:
            lines.append(f"| the agent process's CPU | | {1000 * a['agent_cpu_per_save']:.1f} |")
    for name, tiers in r.get("durable", {}).items():
        lines.append("")
        lines.append(f"time to durable, {name} (save() to the tier committed, medians, ms): " +
                     ", ".join(f"{t} {1000 * v:.0f}" for t, v in sorted(tiers.items())))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    import argparse
    import json
    import warnings

    parser = argparse.ArgumentParser(prog="python -m tiered_ckpt.bench.loop_share",
                                     description="the training loop's share taken by checkpointing (module docstring)")
    parser.add_argument("--steps", type=int, default=60, help="training steps per run (default 60)")
    parser.add_argument("--every", type=int, default=3, help="a save every this many steps (default 3)")
    parser.add_argument("--repeats", type=int, default=3, help="interleaved repeats of every run (default 3)")
    parser.add_argument("--agent", action="store_true", help="also a run with [engine] agent = \"on\"")
    parser.add_argument("--no-dcp", action="store_true", help="leave the DCP run out")
    parser.add_argument("--calibrate-ms", type=float, default=10.0,
                        help="ms of background Python per save point in the yardstick run (0: no such run)")
    parser.add_argument("--json", action="store_true", help="the figures as JSON instead of the report")
    args = parser.parse_args(argv)
    warnings.filterwarnings("ignore")
    result = measure(args.steps, args.every, args.repeats, dcp=not args.no_dcp, calibrate_ms=args.calibrate_ms,
                     agent=args.agent)
    print(json.dumps(result, indent=1) if args.json else report(result))


if __name__ == "__main__":
    main()
