"""Event-loop stalls against the tensor count: the longest time a task on the loop waited to run during each
save, load and close of N tensors of 16 floats.

The setup an application that keeps the loop busy sees: a task that sleeps 5 ms at a time runs beside the
engine and records the longest gap over its sleep (`--ticker`); 8 MiB parts, so a state of many tensors is many
parts; the loads go into tensors made just before them (a resume's fresh model), from the memory tier alone and
from the disk tier alone. Each run is a fresh process (a run's garbage and collector state do not leak into the
next), with Python's automatic collection on or off (`--gc`). Not a test: figures vary with the machine's load,
so compare trees run alternately in one session (docs/benchmarks.md, *Event-loop stalls against the tensor
count*).

    python -m tiered_ckpt.bench.stalls --tensors 100000,300000 --gc on,off [--json out.json]
    python -m tiered_ckpt.bench.stalls --tensors 1000000 --plans ddp,ddp-differing,hsdp
    python -m tiered_ckpt.bench.stalls --tensors 1000000 --load-steps

Besides the ticker's stall and the loop's CPU, a thread that wakes every millisecond reports its longest wait
for the GIL and the CPU that one other thread ran meanwhile (`_GilWatch`), with where that thread was: the
longest hold of the GIL by a worker thread, which the loop waits for as long. `--plans` measures the same for
the world plan of replicated layouts (DDP, HSDP) alone, which the engine bench (one rank) never compares;
`--load-steps` the steps of a load's planning that build maps of every tensor, each alone.
"""
from __future__ import annotations

import argparse
import asyncio
import gc
import json
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Awaitable, Callable

OPERATIONS = ("first save", "second save", "load (memory tier)", "load (disk tier)", "close")


async def _ticker(stop: asyncio.Event, gaps: list[float], period: float) -> None:
    last = time.perf_counter()
    while not stop.is_set():
        await asyncio.sleep(period)
        now = time.perf_counter()
        gaps.append(now - last - period)
        last = now


class _LoopCpu:
    """The most CPU time of the loop's thread that one callback took (time.thread_time, which neither waiting
    for the GIL nor other processes on the machine inflate): what the loop itself ran, where the ticker's gap
    also counts threads that held the GIL and a busy machine."""

    def __init__(self) -> None:
        self.longest = 0.0
        real = self._real = asyncio.events.Handle._run
        watch = self

        def timed(handle: asyncio.Handle) -> None:
            start = time.thread_time()
            try:
                real(handle)
            finally:
                watch.longest = max(watch.longest, time.thread_time() - start)

        asyncio.events.Handle._run = timed  # type: ignore[method-assign]


class _GilWatch:
    """The longest the GIL was held away from a thread that wants it every `period`, and who held it.

    A thread that sleeps `period` and wakes late waited for the GIL (or for a core, on a loaded machine). At each
    late wake it reads every other thread's CPU clock (`time.pthread_getcpuclockid`): the thread that ran the most
    CPU in the gap held the GIL through it, and its CPU there (which neither waiting nor other processes inflate)
    is the hold, where the ticker's stall is wall time. Where that thread was at the wake before and is just
    after (`sys._current_frames`) bracket the call. A thread that runs without the GIL (a tensor copy, a read)
    also counts CPU in a gap, and one that gives it back for a moment takes it again when the watcher is not on
    a core, so a hold named here is an upper bound; a C call that keeps the GIL shows as one hold of its whole
    length."""

    def __init__(self, loop_thread: int, period: float = 0.001, late: float = 0.010) -> None:
        self.loop_thread, self.period, self.late = loop_thread, period, late
        self.reset()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="gil-watch", daemon=True)
        self._thread.start()

    def reset(self) -> None:
        self.wait = 0.0  # the longest wake-up delay (wall)
        self.worker = (0.0, "")  # the most CPU one worker thread ran in one gap, and where it was after it
        self.holds: list[tuple[float, str]] = []  # every such hold over `late`, and where
        self.loop = 0.0  # the most CPU the loop's thread ran in one gap

    def close(self) -> None:
        self._stop.set()
        self._thread.join()

    def _clocks(self) -> dict[int, float]:
        out = {}
        for thread in threading.enumerate():
            if thread.ident is not None and thread is not self._thread:
                try:
                    out[thread.ident] = time.clock_gettime(time.pthread_getcpuclockid(thread.ident))
                except (OSError, ProcessLookupError):  # it ended meanwhile
                    pass
        return out

    def _watch(self) -> None:
        before, clocks = time.perf_counter(), self._clocks()
        while not self._stop.is_set():
            last = {ident: _where(frame) for ident, frame in sys._current_frames().items()}  # (where a hold began)
            time.sleep(self.period)
            now = time.perf_counter()
            wait = now - before - self.period
            if wait > self.late:
                after = self._clocks()
                ran = {ident: after[ident] - clocks[ident] for ident in after if ident in clocks}
                self.wait = max(self.wait, wait)
                self.loop = max(self.loop, ran.pop(self.loop_thread, 0.0))
                if ran:
                    ident, cpu = max(ran.items(), key=lambda item: item[1])
                    if cpu > self.late:
                        after_hold = _where(sys._current_frames().get(ident))
                        self.holds.append((cpu, f"{last.get(ident, '?')} -> {after_hold}"))
                        self.worker = max(self.worker, self.holds[-1])
                clocks = after
            else:
                clocks = self._clocks()
            before = time.perf_counter()


def _where(frame: Any) -> str:
    """The innermost frame of the package (or else the innermost), as file:line function."""
    chosen = frame
    while frame is not None:
        if "tiered_ckpt" in frame.f_code.co_filename:
            chosen = frame
            break
        frame = frame.f_back
    if chosen is None:
        return "?"
    name = chosen.f_code.co_filename.split("tiered_ckpt/")[-1]
    return f"{name}:{chosen.f_lineno} {chosen.f_code.co_name}"


async def _longest_stall(work: Awaitable[Any], period: float, cpu: _LoopCpu, gil: _GilWatch) -> list[Any]:
    """[seconds `work` took, the longest stall of the loop meanwhile, the most loop CPU one callback took, the
    longest GIL wait of a watching thread, the most CPU a worker thread ran in one such wait, and where, and the
    longest holds (ms, where)]."""
    stop, gaps = asyncio.Event(), [0.0]
    ticker = asyncio.create_task(_ticker(stop, gaps, period))
    await asyncio.sleep(4 * period)
    gaps[:] = [0.0]
    cpu.longest = 0.0
    gil.reset()
    start = time.perf_counter()
    await work
    seconds = time.perf_counter() - start
    stop.set()
    await ticker
    return [seconds, max(gaps), cpu.longest, gil.wait, gil.worker[0], gil.worker[1],
            [(round(held * 1e3), where) for held, where in sorted(gil.holds, reverse=True)[:8]]]


async def measure(count: int, folder: Path, shm: Path, *, period: float = 0.005, part_size: str = "8MiB",
                  ) -> dict[str, list[Any]]:
    """Saves 1 and 2 of `count` tensors to a memory and a disk tier, a load from each into fresh tensors, then
    close: {operation: `_longest_stall`'s figures}."""
    import torch

    from .. import Engine
    from ..config import parse_config

    config = parse_config({"engine": {"job": "stalls", "index": f"file://{folder}/index", "part_size": part_size},
                           "tiers": [{"name": "host", "kind": "memory", "path": str(shm), "keep_last": 2},
                                     {"name": "disk", "kind": "local", "path": str(folder / "parts"),
                                      "keep_last": 2}]})
    state = {f"layer{i}.scale": torch.full((16,), float(i)) for i in range(count)}
    out: dict[str, list[Any]] = {}
    cpu = _LoopCpu()
    gil = _GilWatch(threading.get_ident())
    engine = await Engine(config).open()

    async def save(step: int) -> None:
        await (await engine.save(step, state)).wait()

    out["first save"] = await _longest_stall(save(1), period, cpu, gil)
    out["second save"] = await _longest_stall(save(2), period, cpu, gil)
    for name, tier in (("load (memory tier)", "host"), ("load (disk tier)", "disk")):
        target = {k: torch.zeros(16) for k in state}  # fresh tensors, as a resumed process has
        out[name] = await _longest_stall(engine.load(target, tiers=[tier]), period, cpu, gil)
        if not torch.equal(target[f"layer{count - 1}.scale"], state[f"layer{count - 1}.scale"]):
            raise AssertionError(f"the {name} did not reproduce the state")
        del target
    out["close"] = await _longest_stall(engine.close(), period, cpu, gil)
    gil.close()
    return out


def _one(count: int, automatic_gc: bool, period: float, part_size: str) -> dict[str, Any]:
    if not automatic_gc:
        gc.disable()
    with tempfile.TemporaryDirectory() as folder, tempfile.TemporaryDirectory(dir="/dev/shm") as shm:
        figures = asyncio.run(measure(count, Path(folder), Path(shm), period=period, part_size=part_size))
    return {"tensors": count, "automatic_gc": automatic_gc, "figures": figures}


PLAN_LAYOUTS = ("ddp", "ddp-differing", "hsdp")


def _payloads(count: int, layout: str) -> list[tuple[Any, ...]]:
    """The plan gather's payloads of `count` tensors of 16 floats: DDP (2 ranks, every tensor replicated), DDP
    ranks whose structures differ by a tensor of their own (their shared boxes compared one by one), HSDP (4
    ranks: 2 shards of each tensor, each held by 2 replicas)."""
    from ..save.describe import describe

    def box(i: int, start: int, rows: int) -> tuple[Any, ...]:
        return (f"layer{i}.scale", "torch.float32", 4, (16,), (start,), (rows,), False)

    if layout == "ddp":
        ranks = [[box(i, 0, 16) for i in range(count)]] * 2
    elif layout == "ddp-differing":
        ranks = [[box(i, 0, 16) for i in range(count)] + [(f"extra{r}", "torch.float32", 4, (16,), (0,), (16,),
                                                           False)] for r in range(2)]
    else:
        ranks = [[box(i, 8 * (r % 2), 8) for i in range(count)] for r in range(4)]
    return [describe(descriptors, r).payload_for(None) for r, descriptors in enumerate(ranks)]


def _in_thread(work: Callable[[], Any]) -> tuple[Any, dict[str, Any]]:
    """work() in a thread of its own, automatic collection off (the engine pauses it for per-tensor work): its
    value, and the thread's CPU, the longest GIL wait of a watching thread, the most CPU the thread ran in one."""
    gc.disable()
    gil = _GilWatch(threading.get_ident())
    cpu: list[float] = []
    out: list[Any] = []

    def timed() -> None:
        start = time.thread_time()
        out.append(work())
        cpu.append(time.thread_time() - start)

    thread = threading.Thread(target=timed, name="work")
    thread.start()
    thread.join()
    gil.close()
    return out[0], {"cpu": cpu[0], "wait": gil.wait, "held": gil.worker[0],
                    "holds": [(round(held * 1e3), where) for held, where in sorted(gil.holds, reverse=True)[:4]]}


def _plan_one(count: int, layout: str) -> dict[str, Any]:
    """The world plan of `layout` made in a thread (_in_thread)."""
    from ..save.world_plan import plan_world

    payloads = _payloads(count, layout)
    _, figures = _in_thread(lambda: plan_world(payloads))
    return {"tensors": count, "layout": layout, **figures}


LOAD_STEPS = ("manifest check", "path index", "pairing", "read plan")


def _load_steps_one(count: int) -> list[dict[str, Any]]:
    """The steps of a load's planning that build maps of every tensor and chunk, each alone in a thread
    (_in_thread), for a manifest of `count` tensors of 16 floats loaded into fresh tensors of the same layout:
    the check that no path is listed twice, the index of the paths, the pairing of saved and given tensors, the
    read plan."""
    import torch

    from ..load.reads import plan_reads
    from ..manifest import ChunkMeta, Manifest, RankMeta, TensorMeta, _distinct
    from ..state.match import LoadTarget

    manifest = Manifest("j", 1, 1, 1 << 30, "crc32c",
                        [TensorMeta(f"layers.{i}.scale", "torch.float32", (16,), (ChunkMeta((0,), (16,), 0, 64 * i,
                                                                                            64),))
                         for i in range(count)], (RankMeta(0, 64 * count, (0,)),), b"", 0.0)
    given = [torch.zeros(16) for _ in range(count)]
    table = manifest.tensors

    def pair() -> LoadTarget:
        target = LoadTarget()
        for i, path in enumerate(table.paths):
            target.add(i, path, given[i])
        return target

    out, kept = [], []
    for step, work in zip(LOAD_STEPS, (lambda: _distinct(table.paths), table.index_by_path, pair)):
        value, figures = _in_thread(work)
        kept.append(value)  # (freed after: a free of 1M entries at once is a hold of its own, not the step's)
        out.append({"tensors": count, "step": step, **figures})
    _, figures = _in_thread(lambda: plan_reads(manifest, kept[-1].tensors))
    out.append({"tensors": count, "step": LOAD_STEPS[-1], **figures})
    return out


def load_steps(counts: list[int]) -> list[dict[str, Any]]:
    """Each count in a fresh process; a line per step."""
    out = []
    for count in counts:
        done = subprocess.run([sys.executable, "-m", "tiered_ckpt.bench.stalls", "--load-steps-one", str(count)],
                              capture_output=True, text=True, check=True)
        for r in json.loads(done.stdout.strip().splitlines()[-1]):
            out.append(r)
            print(f"load, {r['step']}, {count:,} tensors: {r['cpu']:.2f} s CPU, longest GIL wait "
                  f"{r['wait'] * 1e3:.0f} ms, most CPU of the step's thread in one {r['held'] * 1e3:.0f} ms"
                  + "".join(f"; {ms} ms at {where}" for ms, where in r["holds"][:2]), flush=True)
    return out


def plans(counts: list[int], layouts: list[str]) -> list[dict[str, Any]]:
    """Each (count, layout) in a fresh process; a line each."""
    out = []
    for count in counts:
        for layout in layouts:
            done = subprocess.run([sys.executable, "-m", "tiered_ckpt.bench.stalls", "--plan-one",
                                   f"{count},{layout}"], capture_output=True, text=True, check=True)
            r = json.loads(done.stdout.strip().splitlines()[-1])
            out.append(r)
            print(f"world plan, {layout}, {count:,} tensors: {r['cpu']:.2f} s CPU, longest GIL wait "
                  f"{r['wait'] * 1e3:.0f} ms, most planning-thread CPU in one {r['held'] * 1e3:.0f} ms"
                  + "".join(f"; {ms} ms at {where}" for ms, where in r["holds"][:2]), flush=True)
    return out


def run(counts: list[int], gcs: list[bool], *, period: float, part_size: str) -> list[dict[str, Any]]:
    """Each (count, gc) in a fresh process of this interpreter, with this process's import path."""
    runs = []
    for count in counts:
        for automatic_gc in gcs:
            done = subprocess.run([sys.executable, "-m", "tiered_ckpt.bench.stalls", "--one",
                                   f"{count},{int(automatic_gc)},{period},{part_size}"],
                                  capture_output=True, text=True, check=True)
            runs.append(json.loads(done.stdout.strip().splitlines()[-1]))
            print(report([runs[-1]]).splitlines()[-1], flush=True)
    return runs


def report(runs: list[dict[str, Any]]) -> str:
    """A row per run: each operation's seconds / longest stall / most loop CPU in one callback / longest GIL wait
    of the watching thread / most worker CPU in one such wait; then where each operation's longest worker hold
    was."""
    head = "| tensors | GC | " + " | ".join(OPERATIONS) + " |"
    lines = [head, "|---:|---|" + "---:|" * len(OPERATIONS)]
    for r in runs:
        cells = []
        for op in OPERATIONS:
            seconds, stall, cpu, wait, held = r["figures"][op][:5]
            cells.append(f"{seconds:.2f} s / **{stall * 1e3:.0f}** / {cpu * 1e3:.0f} / {wait * 1e3:.0f} / "
                         f"{held * 1e3:.0f} ms")
        lines.append(f"| {r['tensors']:,} | {'on' if r['automatic_gc'] else 'off'} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def holders(runs: list[dict[str, Any]]) -> str:
    """Where the worker threads with the longest holds of each operation were before and after them."""
    return "\n".join(f"{r['tensors']:,} GC {'on' if r['automatic_gc'] else 'off'}, {op}: "
                     + "; ".join(f"{ms} ms at {where}" for ms, where in r["figures"][op][6][:4])
                     for r in runs for op in OPERATIONS)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tiered_ckpt.bench.stalls", description=__doc__.split("\n\n")[0])
    p.add_argument("--tensors", default="100000,300000,1000000", help="comma-separated tensor counts")
    p.add_argument("--gc", default="on,off", help="automatic garbage collection: on, off or on,off")
    p.add_argument("--ticker", type=float, default=0.005, help="the watching task's sleep, seconds")
    p.add_argument("--part-size", default="8MiB")
    p.add_argument("--json", type=Path, help="also write the figures here")
    p.add_argument("--plans", help="instead: the world plan's GIL holds for these layouts (comma-separated: "
                   f"{', '.join(PLAN_LAYOUTS)}) at each --tensors count")
    p.add_argument("--load-steps", action="store_true",
                   help="instead: the GIL holds of a load's planning steps, each alone, at each --tensors count")
    p.add_argument("--load-steps-one", type=int, help=argparse.SUPPRESS)  # count: JSON on stdout
    p.add_argument("--one", help=argparse.SUPPRESS)  # count,gc,period,part_size: one run, JSON on stdout
    p.add_argument("--plan-one", help=argparse.SUPPRESS)  # count,layout: one world plan, JSON on stdout
    args = p.parse_args(argv)
    if args.plan_one:
        count, layout = args.plan_one.split(",")
        print(json.dumps(_plan_one(int(count), layout)))
        return 0
    if args.load_steps_one:
        print(json.dumps(_load_steps_one(args.load_steps_one)))
        return 0
    if args.load_steps:
        runs = load_steps([int(n) for n in args.tensors.split(",")])
        if args.json:
            args.json.write_text(json.dumps(runs, indent=1))
        return 0
    if args.plans:
        runs = plans([int(n) for n in args.tensors.split(",")], args.plans.split(","))
        if args.json:
            args.json.write_text(json.dumps(runs, indent=1))
        return 0
    if args.one:
        count, automatic_gc, period, part_size = args.one.split(",")
        print(json.dumps(_one(int(count), automatic_gc == "1", float(period), part_size)))
        return 0
    print(f"seconds / longest event-loop stall ({args.ticker * 1e3:.0f} ms ticker) / most loop CPU in one callback / "
          f"longest GIL wait of a thread that wakes every 1 ms / most CPU one worker thread ran in it, "
          f"{args.part_size} parts")
    print(report([]))
    runs = run([int(n) for n in args.tensors.split(",")], [g == "on" for g in args.gc.split(",")],
               period=args.ticker, part_size=args.part_size)
    print(holders(runs))
    if args.json:
        args.json.write_text(json.dumps(runs, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
