"""The load's metadata phase at thousands of ranks: what one loading rank pays to read a checkpoint's manifest and
every saved rank's checksum record through the real `Catalog.read_manifest`, against a real redis-server and a
file index. A checkpoint of R synthetic ranks is written first (a manifest and R sealed records of the size a
real save writes: 4 parts, a digest per 4 MiB chunk, a small skeleton); then one loading rank reads it.

Reported per R: index round trips of that read (every index call counted), its CPU and wall time, and the slope
of each against R fitted on a log-log scale (1.0: linear, 0: flat). With several ranks only rank 0 makes that
read and hands the manifest on (load/shared.py): also reported, rank 0's CPU to encode it, the bytes it sends,
and the CPU another rank spends decoding and checking it (no index call).

    python -m tiered_ckpt.bench.load_metadata --ranks 64 256 1024 4096 10240
"""
from __future__ import annotations

import argparse
import asyncio
import math
import tempfile
import time
from pathlib import Path
from typing import Any

from ..layout import incarnation_dir, new_session
from ..load.catalog import Catalog
from ..manifest import Manifest, RankMeta
from ..storage.index.file import FileIndex
from ..testing.counting import CountingIndex

JOB = "bench"
STEP = 1
PART = 64 << 20
CHUNK = 4 << 20
PARTS = 4


async def write_checkpoint(index: Any, ranks: int, *, job: str = JOB, step: int = STEP, tensors: Any = ()
                           ) -> Manifest:
    """A committed-looking checkpoint of `ranks` ranks in `index` (its manifest, listing `tensors`, and every rank's
    record); the records are written in batches of concurrent calls, as the ranks of a save write them."""
    nbytes = PARTS * PART
    manifest = Manifest(job=job, step=step, world_size=ranks, part_size=PART, checksum="crc32c", tensors=tensors,
                        ranks=tuple(RankMeta(r, nbytes) for r in range(ranks)), skeleton=b"", created=time.time(),
                        index=index.identity, incarnation=incarnation_dir(index.identity, new_session()),
                        chunk_size=CHUNK)
    await index.begin(job, step, ["disk"])
    await index.put_manifest(job, step, manifest.to_bytes())
    chunks = PARTS * (PART // CHUNK)

    def record(r: int) -> bytes:
        return RankMeta(r, nbytes, tuple(range(r, r + PARTS)), b"s" * 200, (r % 256).to_bytes(1, "little") * 8 * chunks,
                        f"node{r // 8}").to_bytes()
    for start in range(0, ranks, 256):
        batch = range(start, min(ranks, start + 256))
        await asyncio.gather(*(index.put_rank_meta(job, step, r, record(r)) for r in batch))
    return manifest


async def read_metadata(index: Any, *, job: str = JOB, step: int = STEP) -> tuple[Manifest, int, float, float]:
    """One loading rank's read of the manifest and every record, verified: (manifest, index round trips, CPU s,
    wall s). Reads the index only (no tier is listed)."""
    counting = CountingIndex(index)
    catalog = Catalog(job, counting, None)  # type: ignore[arg-type]  # (no tier: the index holds every record)
    cpu, wall = time.process_time(), time.perf_counter()
    manifest = await catalog.read_manifest(step)
    return manifest, counting.total, time.process_time() - cpu, time.perf_counter() - wall


def _handed_on(manifest: Manifest) -> tuple[float | None, float | None, int]:
    """With several ranks, rank 0 hands the manifest it read to the others (load/shared.py): its CPU to encode it,
    another rank's to decode and check it, and the bytes sent. (None, None, 0) in a release without it."""
    try:
        from ..load.shared import SharedManifest  # noqa: F401
    except ImportError:
        return None, None, 0
    cpu = time.process_time()
    data = manifest.to_bytes()
    encode = time.process_time() - cpu
    cpu = time.process_time()
    Manifest.from_bytes(data, source="bench").expect(manifest.job, manifest.step, "bench")
    return encode, time.process_time() - cpu, len(data)


def slope(xs: list[int], ys: list[float]) -> float:
    """Least-squares slope of log y against log x."""
    lx, ly = [math.log(x) for x in xs], [math.log(max(y, 1e-9)) for y in ys]
    mx, my = sum(lx) / len(lx), sum(ly) / len(ly)
    return sum((a - mx) * (b - my) for a, b in zip(lx, ly)) / sum((a - mx) ** 2 for a in lx)


async def run(sizes: list[int], url: str | None, tensors: int = 0, layout: str = "fsdp") -> None:
    from ..storage.index.redis import RedisIndex
    from ..testing.redis_local import LocalServer

    with tempfile.TemporaryDirectory() as d, (LocalServer() if url is None else _Given(url)) as server:
        for name, make in (("redis", lambda: RedisIndex(server.url, timeout=60)),
                           ("file", lambda: FileIndex(Path(d) / "index"))):
            rows = []
            for n, ranks in enumerate(sizes):
                index = make()
                await index.open()
                index.epoch = await index.fence(f"{JOB}{n}")
                await write_checkpoint(index, ranks, job=f"{JOB}{n}", tensors=_table(tensors, layout, ranks))
                manifest, trips, cpu, wall = await read_metadata(index, job=f"{JOB}{n}")
                assert len(manifest.ranks) == ranks
                await index.close()
                handed = _handed_on(manifest)
                rows.append((ranks, trips, cpu, wall, *handed))
                print(f"{name:5} R={ranks:6d}  round trips {trips:6d}  CPU {cpu:8.3f} s  wall {wall:8.3f} s"
                      + ("" if handed[0] is None else f"  | rank 0 encodes {handed[0]:.3f} s CPU, "
                         f"{handed[2] / 1e6:.1f} MB sent; each other rank decodes {handed[1]:.3f} s CPU, "
                         f"0 round trips"), flush=True)
            xs = [r[0] for r in rows]
            fits = [f"{what} {slope(xs, [r[i] for r in rows]):.2f}" for what, i in
                    (("round trips", 1), ("CPU", 2), ("wall", 3), ("decode CPU", 5)) if rows[0][i] is not None]
            print(f"{name:5} slope vs R: {', '.join(fits)}", flush=True)


def _table(tensors: int, layout: str, ranks: int) -> Any:
    """No tensors, or the table of a save of `tensors` tensors a rank in this layout planned for the world (the
    planning bench's synthetic ranks: under FSDP2 every tensor is cut into R chunks, a 126 MB manifest at
    10,240 ranks x 1,000 tensors)."""
    if not tensors:
        return ()
    from .plan_scale import world_plan

    return world_plan(layout, tensors, ranks).tensors


class _Given:
    def __init__(self, url: str):
        self.url = url

    def __enter__(self) -> "_Given":
        return self

    def __exit__(self, *exc: object) -> None:
        pass


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", type=int, nargs="+", default=[64, 256, 1024, 4096, 10240])
    parser.add_argument("--url", help="a Redis index to use instead of a local redis-server")
    parser.add_argument("--tensors", type=int, default=0,
                        help="tensors a rank in the manifest (default 0: the manifest lists none)")
    parser.add_argument("--layout", default="fsdp", help="their layout, as plan_scale makes it (fsdp, ddp, hsdp)")
    args = parser.parse_args()
    asyncio.run(run(args.ranks, args.url, args.tensors, args.layout))


if __name__ == "__main__":
    main()
