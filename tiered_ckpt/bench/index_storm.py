"""A commit storm against the Redis index: N simulated ranks (asyncio tasks sharing one index client and its
connection pool) go through one save's index traffic exactly as the engine's ranks do (`commit.Committer`):
every rank begins the step, rank 0 stores the manifest, every rank its checksum record, then, for each tier,
every rank marks its parts durable at the same instant (the storm) and waits until the tier is complete
(polling `tier_state` with the engine's backoff). Then `list()`.

Reported: mark_durable latency (p50, p99), the time from the storm's start until the commit (the marker that
completes the tier returns) and until every rank saw it, list() of that job, index memory per checkpoint
(INFO used_memory before/after, and MEMORY USAGE of the job's keys), and after removing the checkpoint as
retention does (bury, delete, unbury) that no record of it is left. Separately: list() of a job holding
10,000 checkpoints.

    python -m tiered_ckpt.bench.index_storm --ranks 1024 4096            # local redis-server and a 3-master cluster
    python -m tiered_ckpt.bench.index_storm --ranks 1024 --url redis://host:6379/0
    tiered-ckpt bench --index-storm 1024,4096
"""
from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import time
from contextlib import ExitStack
from typing import Any

from . import MET_LEGEND
from ..save.commit import Committer
from ..storage.index.redis import RedisIndex
from ..layout import new_session

TIERS = ("host", "disk")


def _with_option(url: str, **options: Any) -> str:
    sep = "&" if "?" in url else "?"
    return url + sep + "&".join(f"{k}={v}" for k, v in options.items())


async def _job_memory(index: RedisIndex, job: str) -> tuple[int, int]:
    """(number of keys of `job`, their MEMORY USAGE in bytes) on every master."""
    client, pattern = index._client, index._k(job, "*")
    keys = [k async for k in client.scan_iter(match=pattern, count=1000)]
    sizes = [await client.memory_usage(k, samples=0) for k in keys]
    return len(keys), sum(s or 0 for s in sizes)


async def _used_memory(index: RedisIndex) -> int:
    return sum(int(info.get("used_memory", 0)) for _, info in await index._redis.masters_info())


def _pct(values: list[float], p: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(p / 100 * (len(ordered) - 1))))]


async def storm(url: str, ranks: int, *, connections: int = 64, job: str = "storm", step: int = 1000,
                rank_meta_bytes: int = 1024, manifest_bytes: int = 64 * 1024) -> dict[str, Any]:
    """One save's index traffic from `ranks` ranks sharing one client of `connections` connections."""
    index = RedisIndex(_with_option(url, max_connections=connections))
    await index.open()
    try:
        await index.fence(job)
        for s in [s.step for s in await index.list(job)]:  # a previous run's leftovers
            await index.delete(job, s)
        # the pool's connections exist before the first measure (their buffers are not the index's memory)
        await asyncio.gather(*(index._call("warming up", lambda: index._client.ping()) for _ in range(4 * connections)))
        keys0, bytes0 = await _job_memory(index, job)
        used0 = await _used_memory(index)
        session = new_session()
        committers = [Committer(index, job, rank=r, world_size=ranks, session=session, timeout=600.0)
                      for r in range(ranks)]
        meta = os.urandom(rank_meta_bytes)
        out: dict[str, Any] = {"ranks": ranks, "connections": connections, "tiers": len(TIERS)}

        t = time.perf_counter()
        await asyncio.gather(*(c.begin(step, list(TIERS)) for c in committers))
        await committers[0].put_manifest(step, os.urandom(manifest_bytes))
        await asyncio.gather(*(c.put_rank_meta(step, meta) for c in committers))
        out["begin_and_records_s"] = time.perf_counter() - t

        marks: list[float] = []
        for tier in TIERS:
            start = time.perf_counter()
            committed: list[float] = []

            async def rank_storm(c: Committer, tier: str = tier, start: float = start,
                                 committed: list[float] = committed) -> None:
                t0 = time.perf_counter()
                done = await index.mark_durable(job, step, tier, c.rank, ranks, session)
                now = time.perf_counter()
                marks.append(now - t0)
                if done:
                    committed.append(now - start)
                await c.wait_complete(step, tier)  # every rank polls until it sees the commit (the engine's wait)

            await asyncio.gather(*(rank_storm(c) for c in committers))
            assert len(committed) == 1, f"{len(committed)} markers completed tier {tier}"
            out[f"commit_s.{tier}"] = committed[0]
            out[f"all_ranks_saw_it_s.{tier}"] = time.perf_counter() - start
        out["mark_p50_ms"] = statistics.median(marks) * 1e3
        out["mark_p99_ms"] = _pct(marks, 99) * 1e3
        out["commit_s"] = max(out[f"commit_s.{t}"] for t in TIERS)
        out["all_ranks_saw_it_s"] = max(out[f"all_ranks_saw_it_s.{t}"] for t in TIERS)

        t = time.perf_counter()
        [status] = await index.list(job)
        out["list_one_s"] = time.perf_counter() - t
        assert status.complete == frozenset(TIERS), status

        keys1, bytes1 = await _job_memory(index, job)
        used1 = await _used_memory(index)
        out["keys_per_checkpoint"] = keys1 - keys0
        out["memory_usage_per_checkpoint"] = bytes1 - bytes0  # MEMORY USAGE of the job's keys
        out["used_memory_per_checkpoint"] = used1 - used0  # INFO memory, the whole server(s)

        await index.bury(job, step)  # what retention does to the last tier of a checkpoint
        for tier in TIERS:
            await index.unmark(job, step, tier)
        await index.delete(job, step)
        await index.unbury(job, step)
        keys2, bytes2 = await _job_memory(index, job)
        used2 = await _used_memory(index)
        out["keys_left_after_delete"] = keys2 - keys0
        out["memory_usage_left_after_delete"] = bytes2 - bytes0
        out["used_memory_left_after_delete"] = used2 - used0
        return out
    finally:
        await index.close()


async def list_many(url: str, checkpoints: int = 10_000, *, world: int = 8, job: str = "many",
                    rank_meta_bytes: int = 256, repeats: int = 5, connections: int = 64) -> dict[str, Any]:
    """list() of a job holding `checkpoints` complete checkpoints of `world` ranks on two tiers, written through
    the index as the engine writes them. The median of `repeats` calls."""
    index = RedisIndex(_with_option(url, max_connections=connections))
    await index.open()
    try:
        await index.fence(job)
        present = {s.step for s in await index.list(job)}
        session = new_session()
        meta = os.urandom(rank_meta_bytes)
        info = {"nbytes": 7 * 2**30, "metadata": {"loss": 1.25, "name": "run"}}

        async def one(step: int) -> None:
            await asyncio.gather(*(index.begin(job, step, list(TIERS), *([info] if r == 0 else []))
                                   for r in range(world)))
            await index.put_manifest(job, step, meta * 4)
            await asyncio.gather(*(index.put_rank_meta(job, step, r, meta) for r in range(world)))
            for tier in TIERS:
                await asyncio.gather(*(index.mark_durable(job, step, tier, r, world, session) for r in range(world)))

        todo = [s for s in range(checkpoints) if s not in present]
        t = time.perf_counter()
        for i in range(0, len(todo), 256):
            await asyncio.gather(*(one(s) for s in todo[i:i + 256]))
        filled = time.perf_counter() - t
        times = []
        for _ in range(repeats):
            t = time.perf_counter()
            statuses = await index.list(job)
            times.append(time.perf_counter() - t)
        assert len(statuses) >= checkpoints and all(s.is_complete for s in statuses[:checkpoints])
        keys, nbytes = await _job_memory(index, job)
        return {"checkpoints": len(statuses), "world": world, "list_s": statistics.median(times),
                "list_min_s": min(times), "fill_s": filled, "job_memory_usage": nbytes, "job_keys": keys}
    finally:
        await index.close()


def report(name: str, storms: list[dict[str, Any]], listing: dict[str, Any] | None) -> str:
    lines = [f"Index commit storm, {name}: ranks share one client of {storms[0]['connections'] if storms else '?'} "
             f"connections; {len(TIERS)} tiers; every rank marks at once, then polls until complete", "",
             "| ranks | begin + records (s) | mark_durable p50 (ms) | p99 (ms) | commit (s) | every rank saw it (s) "
             "| list() (ms) | index bytes / checkpoint | used_memory / checkpoint | left after delete: keys, bytes "
             "(used_memory) |", "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in storms:
        lines.append(f"| {r['ranks']} | {r['begin_and_records_s']:.3f} | {r['mark_p50_ms']:.2f} | {r['mark_p99_ms']:.2f} "
                     f"| {r['commit_s']:.3f} | {r['all_ranks_saw_it_s']:.3f} | {r['list_one_s'] * 1e3:.2f} "
                     f"| {r['memory_usage_per_checkpoint']:,} | {r['used_memory_per_checkpoint']:,} "
                     f"| {r['keys_left_after_delete']}, {r['memory_usage_left_after_delete']} "
                     f"({r['used_memory_left_after_delete']:+,}) |")
    if listing:
        lines += ["", f"list() of {listing['checkpoints']:,} checkpoints ({listing['world']} ranks, {len(TIERS)} tiers "
                      f"each): median {listing['list_s'] * 1e3:.1f} ms (best {listing['list_min_s'] * 1e3:.1f} ms); the "
                      f"job's index holds {listing['job_memory_usage'] / 2**20:.1f} MiB in {listing['job_keys']} keys "
                      f"(filled in {listing['fill_s']:.1f} s)"]
    targets = [(f"{r['ranks']}-rank commit (s)", r["commit_s"], 1.0) for r in storms if r["ranks"] == 1024]
    if listing:
        targets.append((f"list() of {listing['checkpoints']:,} (s)", listing["list_s"], 0.1))
    if targets:
        lines += ["", "| target | measured | target | met |", "|---|---:|---:|:---:|"]
        lines += [f"| {label} | {value:.3f} | < {goal} | {'yes' if value < goal else 'NO'} |" for label, value, goal in targets]
        lines += ["", MET_LEGEND]
    return "\n".join(lines)


async def run(urls: dict[str, str], ranks: list[int], *, list_checkpoints: int, connections: int) -> str:
    out = []
    for name, url in urls.items():
        storms = []
        for n in ranks:
            print(f"  {name}: storm of {n} ranks ...", file=sys.stderr, flush=True)
            storms.append(await storm(url, n, connections=connections))
        listing = None
        if list_checkpoints:
            print(f"  {name}: list() of {list_checkpoints} checkpoints ...", file=sys.stderr, flush=True)
            listing = await list_many(url, list_checkpoints, connections=connections)
        out.append(report(name, storms, listing))
    return "\n\n".join(out)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--ranks", type=int, nargs="+", default=[1024, 4096], help="simulated ranks per storm")
    p.add_argument("--url", action="append", default=[],
                   help="index URL(s) to storm (default: a local redis-server and a local 3-master cluster)")
    p.add_argument("--connections", type=int, default=64, help="connections the ranks share (default 64)")
    p.add_argument("--list-checkpoints", type=int, default=10_000,
                   help="checkpoints for the list() measurement (0 skips it)")
    p.add_argument("--no-cluster", action="store_true", help="only the local single server")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tiered_ckpt.bench.index_storm", description=__doc__.split("\n\n")[0])
    add_arguments(p)
    args = p.parse_args(argv)
    return run_cli(args.ranks, args.url, args.connections, args.list_checkpoints, not args.no_cluster)


def run_cli(ranks: list[int], urls: list[str], connections: int, list_checkpoints: int, cluster: bool = True) -> int:
    import uvloop

    from ..testing.redis_local import LocalCluster, LocalServer

    with ExitStack() as stack:
        targets: dict[str, str] = {}
        for url in urls:
            targets[url.split("?")[0]] = url
        if not urls:
            server = stack.enter_context(LocalServer())
            targets["one local redis-server"] = server.url
            if cluster:
                targets["a local 3-master Redis Cluster"] = stack.enter_context(LocalCluster(3)).url
        print(uvloop.run(run(targets, ranks, list_checkpoints=list_checkpoints, connections=connections)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
