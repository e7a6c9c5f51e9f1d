"""What a job's history costs: one save's bookkeeping, one load's pick, `tiered-ckpt ls`, `gc --dry-run` and `gc`
at 100, 1,000 and 10,000 checkpoints, on a real redis-server (started on a free port) and a file index.

Each history is made through the index's own calls (begin with rank 0's info, the manifest of a real save of
1,000 tensors, the rank record, the commit) and, on a local tier, the keys a save leaves (manifest, rank record,
committed marker, one part), so making 10,000 takes seconds, not 10,000 saves; a few of them get a zombie's folder
beside the committed one (what gc removes). Then, in a fresh process per history: real saves of a tiny state
(keep_last = 2 and keep_every = 1 on the tier: the job keeps its whole history, as a run keeping every checkpoint
on S3 does) and real loads, each
measured in CPU seconds (the engine's open, alone; the median of 5 saves, after 2 that warm up: a writer's first save, in a process started after
the writer that made the history saved once more, is reported alone, "1st save", with its longest stall; of 7
loads), with
the longest event-loop stall seen meanwhile (a 5 ms ticker); then `tiered-ckpt ls` (and, file index, `ls` again
without the index's summary file: "ls cold", as the first listing ever), `gc --dry-run` and `gc` as
the CLI runs them (the child's CPU seconds and wall seconds, start-up included: "CLI start" is an `ls` of a job
without checkpoints; with bytecode caches, as an installed package has them, written by a first unmeasured
start) and `Engine.gc(dry_run=True)` in process (wall seconds, and its stall).
That one more save of the writer that made the history is reported alone too ("unjudged"): the first to judge what
the fill added behind retention's back, it looks at every checkpoint, as a first run on an index of an earlier
release, or on an index that lost retention's notes, does. The fitted slope of each against the history (log-log:
1.0 linear, 0 flat) closes each table.

`--before PATH` runs the same measurements with the code at PATH (a checkout of an earlier commit: public API
only is used) in the same run, for a before/after table; `--gc-up-to N` leaves gc out above N checkpoints there
(the landed code took 159 s / 245 s for a dry run at 10,000).

    python -m tiered_ckpt.bench.history_scale --sizes 100 1000 10000 [--before /path/to/old/checkout]
"""
from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

JOB = "hist"
ZOMBIES = 5  # checkpoints given a zombie's folder beside the committed one (what gc removes)
STEP = 10  # the history's steps: 10, 20, ...
SAVES, LOADS = 5, 7  # saves measured (after 2 that warm up) and loads; the median of each is reported
TENSORS = 1000  # tensors in the manifest each checkpoint of the history holds (a model's: ~36 B each)


def _ticker() -> tuple[asyncio.Task[None], list[float]]:
    """A 5 ms ticker on the running loop; [longest lateness seen] (seconds), reset by the caller."""
    worst = [0.0]

    async def tick() -> None:
        while True:
            t = time.perf_counter()
            await asyncio.sleep(0.005)
            worst[0] = max(worst[0], time.perf_counter() - t - 0.005)
    return asyncio.ensure_future(tick()), worst


async def _fill(index: Any, tier_root: Path, size: int, manifest: bytes) -> None:
    """`size` complete checkpoints of one rank on tier "disk": index records and the tier's keys. `manifest`: a
    real save's manifest (of TENSORS tensors), stored as each one's: gc of the landed code decodes each."""
    from tiered_ckpt.layout import PartKey, committed_key, incarnation_dir, manifest_key, new_session, rank_meta_key
    from tiered_ckpt.manifest import Manifest, RankMeta

    folder = Manifest.from_bytes(manifest, source="bench").incarnation  # the folder the manifest names, as a save's
    record = RankMeta(0, 64, (0,), b"", b"\0" * 8, "node0").to_bytes()
    for n in range(1, size + 1):
        step = n * STEP
        await index.begin(JOB, step, ["disk"], {"nbytes": 64, "metadata": {"loss": 1.0 / n}, "folder": folder})
        await index.put_manifest(JOB, step, manifest)
        await index.put_rank_meta(JOB, step, 0, record)
        assert await index.mark_durable(JOB, step, "disk", 0, 1, "filled")
        keys = {manifest_key(JOB, step, folder): manifest, rank_meta_key(JOB, step, 0, folder): record,
                committed_key(JOB, step, folder): b"", PartKey(JOB, step, 0, 0, folder).path: b"\0" * 64}
        if n % max(1, size // ZOMBIES) == 0:
            keys[PartKey(JOB, step, 0, 0, incarnation_dir(index.identity, new_session())).path] = b"\0" * 64
        for key, data in keys.items():
            path = tier_root / key
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(data)


def _config(work: Path, url: str) -> Path:
    text = (f'[engine]\njob = "{JOB}"\nindex = "{url}"\npart_size = "64KiB"\n\n'
            f'[[tiers]]\nname = "disk"\nkind = "local"\npath = "{work / "disk"}"\nkeep_last = 2\nkeep_every = 1\n')
    path = work / "config.toml"
    path.write_text(text)
    return path


async def _child(kind: str, size: int, url: str, work: Path, gc: bool) -> dict[str, Any]:
    import torch

    import tiered_ckpt as tc
    from tiered_ckpt.config import load_config
    from tiered_ckpt.storage.index import open_index

    index_url = f"file://{work / 'index'}" if kind == "file" else url
    config = _config(work, index_url)
    async with tc.Engine(load_config(config)) as engine:  # a real manifest of TENSORS tensors, as a model's
        await (await engine.save(1, {f"layer{i}.w": torch.zeros(4) for i in range(TENSORS)})).wait()
        manifest = await engine.store.index.get_manifest(JOB, 1)
    index = open_index(index_url)
    await index.open()
    index.epoch = await index.fence(JOB)
    t = time.perf_counter()
    await _fill(index, work / "disk", size, manifest)
    fill = time.perf_counter() - t
    await index.close()
    out: dict[str, Any] = {"kind": kind, "size": size, "fill_s": fill}
    state = {"w": torch.zeros(16)}
    ticker, worst = _ticker()
    try:
        async with tc.Engine(load_config(config)) as engine:  # the writer that made the history, its last save
            # (its retention judges what the fill added: a writer that keeps its place in the index leaves it there)
            worst[0] = 0.0
            t = time.process_time()
            await (await engine.save(size * STEP + 1, state)).wait()
            out.update(unjudged_save_cpu_s=time.process_time() - t, unjudged_save_stall_s=worst[0])
        opening = tc.Engine(load_config(config))  # a new process: the job restarted
        t = time.process_time()
        await opening.open()
        out["open_cpu_s"] = time.process_time() - t
        await opening.close()
        async with tc.Engine(load_config(config)) as engine:
            step = (size + 1) * STEP
            saves, loads, stalls = [], [], []
            for n in range(2 + SAVES):
                worst[0] = 0.0
                t = time.process_time()
                await (await engine.save(step + n, state)).wait()
                if n == 0:  # the writer's first save: its start's clean-up and retention's first pass look at all
                    out.update(first_save_cpu_s=time.process_time() - t, first_save_stall_s=worst[0])
                if n >= 2:
                    saves.append(time.process_time() - t)
                    stalls.append(worst[0])
            for _ in range(LOADS):
                worst[0] = 0.0
                t = time.process_time()
                info = await engine.load({"w": torch.ones(16)})
                loads.append(time.process_time() - t)
                stalls.append(worst[0])
                assert info.step == step + 1 + SAVES
            out.update(save_cpu_s=statistics.median(saves), load_cpu_s=statistics.median(loads))
            if gc:
                worst[0] = 0.0
                t = time.perf_counter()
                report = await engine.gc(dry_run=True)
                out["engine_gc_dry_s"] = time.perf_counter() - t
                out["engine_gc_removed"] = len(report.removed)
                stalls.append(worst[0])
            out["stall_s"] = max(stalls)
    finally:
        ticker.cancel()
    env = dict(os.environ)
    env.pop("PYTHONDONTWRITEBYTECODE", None)  # as installed: with bytecode caches (not compiling at each start)
    subprocess.run([sys.executable, "-m", "tiered_ckpt.cli", "-c", str(config), "--job", "nobody", "ls"], env=env,
                   capture_output=True, timeout=600, cwd=work)  # writes the caches where missing (not measured)
    summary = work / "index" / JOB / "status-summary"  # the file index's cache of settled statuses, if kept
    runs = [("startup", ["--job", "nobody", "ls"]), ("ls", ["ls"])]
    runs += [("ls_cold", ["ls"])] if kind == "file" else []  # without the summary: as the first listing ever
    runs += [("gc_dry_run", ["gc", "--dry-run", "--json"]), ("gc", ["gc", "--json"])] if gc else []
    for name, argv in runs:
        if name == "ls_cold":
            summary.unlink(missing_ok=True)
        t, before = time.perf_counter(), resource.getrusage(resource.RUSAGE_CHILDREN)
        done = subprocess.run([sys.executable, "-m", "tiered_ckpt.cli", "-c", str(config), *argv], env=env,
                              capture_output=True, text=True, timeout=1800, cwd=work)  # (`-m` imports from cwd first)
        wall, after = time.perf_counter() - t, resource.getrusage(resource.RUSAGE_CHILDREN)
        if done.returncode not in (0, 1):
            raise RuntimeError(f"tiered-ckpt {' '.join(argv)}: exit {done.returncode}: {done.stderr[-2000:]}")
        out[f"{name}_s"] = wall
        out[f"{name}_cpu_s"] = after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime
        if argv[0] == "gc":
            out[f"{name}_removed"] = len(json.loads(done.stdout)["removed"])
    return out


def _slope(xs: list[int], ys: list[float]) -> float:
    lx, ly = [math.log(x) for x in xs], [math.log(max(y, 1e-6)) for y in ys]
    mx, my = sum(lx) / len(lx), sum(ly) / len(ly)
    den = sum((x - mx) ** 2 for x in lx)
    return sum((x - mx) * (y - my) for x, y in zip(lx, ly)) / den if den else 0.0


COLUMNS = [("open_cpu_s", "open CPU"), ("unjudged_save_cpu_s", "unjudged CPU"), ("first_save_cpu_s", "1st save CPU"),
           ("first_save_stall_s", "1st save stall"), ("save_cpu_s", "save CPU"),
           ("load_cpu_s", "load CPU"), ("startup_cpu_s", "CLI start CPU"),
           ("ls_cpu_s", "ls CPU"), ("ls_s", "ls wall"), ("ls_cold_cpu_s", "ls cold CPU"),
           ("gc_dry_run_cpu_s", "gc -n CPU"),
           ("gc_dry_run_s", "gc -n wall"), ("gc_cpu_s", "gc CPU"), ("gc_s", "gc wall"),
           ("engine_gc_dry_s", "Engine.gc -n"), ("stall_s", "longest stall")]


def _report(label: str, rows: list[dict[str, Any]]) -> None:
    for kind in sorted({r["kind"] for r in rows}):
        mine = sorted((r for r in rows if r["kind"] == kind), key=lambda r: r["size"])
        print(f"\n{label}, {kind} index")
        print(f"{'checkpoints':>11}  " + "  ".join(f"{title:>13}" for _, title in COLUMNS))
        for r in mine:
            print(f"{r['size']:>11}  " + "  ".join(f"{r[key]:>12.3f}s" if key in r else f"{'-':>13}"
                                                   for key, _ in COLUMNS))
        fits = []
        for key, title in COLUMNS:
            have = [r for r in mine if key in r]
            if len(have) >= 2:
                fits.append(f"{title} {_slope([r['size'] for r in have], [r[key] for r in have]):.2f}")
        print(f"{'slope':>11}  {', '.join(fits)}", flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[100, 1000, 10000])
    parser.add_argument("--indexes", nargs="+", default=["file", "redis"], choices=["file", "redis"])
    parser.add_argument("--before", type=Path, help="a checkout of the code to compare with (its repository root)")
    parser.add_argument("--gc-up-to", type=int, default=None, help="with --before: its gc only up to this history")
    parser.add_argument("--json", type=Path, help="also write every row here")
    parser.add_argument("--child", nargs=4, metavar=("KIND", "SIZE", "URL", "GC"), help=argparse.SUPPRESS)
    parser.add_argument("--work", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        kind, size, url, gc = args.child
        print(json.dumps(asyncio.run(_child(kind, int(size), url, args.work, gc == "1"))))
        return 0
    from tiered_ckpt.testing.redis_local import LocalServer

    here = Path(__file__).resolve().parents[2]
    codes = [("after (this code)", here)] + ([("before", args.before.resolve())] if args.before else [])
    everything = []
    base = "/dev/shm" if Path("/dev/shm").is_dir() else None
    with LocalServer() as server:
        for label, code in codes:
            rows = []
            for kind in args.indexes:
                for size in args.sizes:
                    gc = label.startswith("after") or args.gc_up_to is None or size <= args.gc_up_to
                    work = Path(tempfile.mkdtemp(prefix="tiered_ckpt-history-", dir=base))
                    subprocess.run(["redis-cli", "-p", str(server.server.port), "FLUSHALL"], check=True,
                                   capture_output=True)
                    try:
                        env = {**os.environ, "PYTHONPATH": str(code)}
                        done = subprocess.run([sys.executable, str(Path(__file__).resolve()), "--child", kind,
                                               str(size), server.url, "1" if gc else "0", "--work", str(work)],
                                              env=env, capture_output=True, text=True, timeout=3600)
                        if done.returncode != 0:
                            print(done.stderr[-3000:], file=sys.stderr)
                            raise SystemExit(f"{label} {kind} {size}: exit {done.returncode}")
                        row = json.loads(done.stdout.strip().splitlines()[-1])
                    finally:
                        shutil.rmtree(work, ignore_errors=True)
                    row["code"] = label
                    rows.append(row)
                    print(json.dumps(row), flush=True)
            _report(label, rows)
            everything += rows
    if args.json:
        args.json.write_text(json.dumps(everything, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
