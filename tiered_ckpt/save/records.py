"""A save's records: its part checksums, this rank's checksum record and (rank 0) the manifest. Each is built
once, stored in the index once, and its bytes are written to every tier the save targets."""
from __future__ import annotations

import asyncio
import concurrent.futures
import math
import time
from typing import Any

from ..checksum import CHUNK_SIZE, Running, chunk_digest, of_chunk_digests, part_digests
from ..layout import manifest_key, rank_meta_key
from ..manifest import Manifest, RankMeta
from ..state import encode_skeleton
from ..gc_pause import automatic_gc_paused
from ..storage.tier_io import TierIO
from ..storage.tiers.base import machine_name
from .commit import Committer
from .plan import Plan


def chunk_size_for(part_size: int) -> int:
    """The chunk that divides every part evenly: CHUNK_SIZE, or the largest power of two dividing `part_size`
    below it; none (0) under 4 KiB (such parts are read whole)."""
    chunk = math.gcd(part_size, CHUNK_SIZE)
    return chunk if chunk >= 4096 else 0


class PartStream:
    """The parts' checksums and chunk digests of a staging buffer, fed in order, a range of whole chunks at a
    time (the hashing thread runs one feed after the other)."""

    def __init__(self, plan: Plan, algorithm: str, chunk_size: int):
        self.plan, self.algorithm, self.chunked = plan, algorithm, chunk_size > 0
        self.step = chunk_size or plan.part_size
        self.results: list[tuple[int, bytes]] = []  # per finished part: (checksum, chunk digests)
        self._part = 0
        self._whole = Running(algorithm)  # a part not cut into chunks
        self._chunks = bytearray()

    def feed(self, view: memoryview, a: int, b: int) -> None:
        """Bytes [a, b) of the buffer, which start where the last feed ended and end on a chunk boundary (or
        at the end of the buffer)."""
        for at in range(a, b, self.step):
            piece = view[at:min(at + self.step, b)]
            if self.chunked:
                self._chunks += chunk_digest(piece, self.algorithm).to_bytes(8, "little")
            else:
                self._whole.update(piece)
            if at + len(piece) == self.plan.part_range(self._part)[1]:  # the part's last byte
                sums = bytes(self._chunks)
                whole = of_chunk_digests(sums, self.algorithm) if self.chunked else self._whole.value()
                self.results.append((whole, sums))
                self._part += 1
                self._whole, self._chunks = Running(self.algorithm), bytearray()


class Records:
    def __init__(self, io: TierIO, commit: Committer, step: int, plan: Plan, skeleton: Any, metadata: dict[str, Any],
                 algorithm: str):
        self.io = io
        self.commit = commit
        self.step = step
        self.plan = plan
        self.skeleton = skeleton
        self.metadata = metadata
        self.algorithm = algorithm
        self.chunk_size = chunk_size_for(plan.part_size)
        # per part: (its checksum, its chunks' digests), hashed after the copy (one thread a part) ...
        self._part_sums: list[concurrent.futures.Future[tuple[int, bytes]]] = []
        # ... or streamed: chunk after chunk on the hashing thread, right behind the copy
        self._stream = PartStream(plan, self.algorithm, self.chunk_size)
        self._submitted = 0  # bytes handed to the stream
        self._streamed: concurrent.futures.Future[None] | None = None  # the last piece handed over
        self._checksums: asyncio.Task[list[tuple[int, bytes]]] | None = None
        self._manifest: asyncio.Task[bytes] | None = None
        self._rank_meta: asyncio.Task[bytes] | None = None

    # -- checksums -------------------------------------------------------------------------------
    def hash_staged(self, view: memoryview, up_to: int) -> None:
        """The first `up_to` bytes of `view` are staged (called from the staging thread as the copy goes on):
        hash every whole chunk among them now, in order, on the hashing thread, while it is still in cache."""
        step, total = self.chunk_size or self.plan.part_size, self.plan.nbytes
        end = total if up_to >= total else up_to // step * step
        if end > self._submitted:
            self._streamed = self.io.submit_hashing(self._stream.feed, view, self._submitted, end)
            self._submitted = end

    def start_checksums(self, view: memoryview) -> None:
        """The whole buffer is staged: hash what is left, once. Without hashing during the copy, every part
        is hashed at once, each in a thread of its own."""
        if self._checksums is not None:
            return
        if self._submitted:  # streamed while staging: finish the stream
            self.hash_staged(view, self.plan.nbytes)
        else:
            for p in range(self.plan.num_parts):
                a, b = self.plan.part_range(p)
                self._part_sums.append(self.io.submit_blocking(part_digests, view[a:b], self.algorithm,
                                                              self.chunk_size))
        self._checksums = asyncio.ensure_future(self._gather())

    async def _gather(self) -> list[tuple[int, bytes]]:
        if self._streamed is not None:
            await asyncio.wrap_future(self._streamed)
            return self._stream.results
        return list(await asyncio.gather(*(asyncio.wrap_future(f) for f in self._part_sums)))

    async def part_sums(self) -> list[tuple[int, bytes]]:
        """Each part's (checksum, chunk digests), once hashed (the list is shared: do not change it)."""
        assert self._checksums is not None, "start_checksums() first"
        return await asyncio.shield(self._checksums)

    async def checksums(self) -> list[int]:
        """Each part's checksum."""
        return [whole for whole, _ in await self.part_sums()]

    async def chunk_sums(self) -> bytes:
        """Every chunk's digest, part after part (empty when parts are not cut into chunks)."""
        return b"".join(chunks for _, chunks in await self.part_sums()) if self.chunk_size else b""

    async def hashing_done(self) -> None:
        """Wait until no hashing thread reads the staging buffer any more (success or not)."""
        if self._part_sums:
            await asyncio.wait([asyncio.wrap_future(f) for f in self._part_sums])
        if self._streamed is not None:
            await asyncio.wait([asyncio.wrap_future(self._streamed)])
        if self._checksums is not None:
            await asyncio.wait([self._checksums])

    # -- records ---------------------------------------------------------------------------------
    def keys(self) -> list[str]:
        """The records this rank writes to each tier."""
        incarnation = self.commit.incarnation
        keys = [rank_meta_key(self.commit.job, self.step, self.plan.rank, incarnation)]
        if self.plan.rank == 0:
            keys.append(manifest_key(self.commit.job, self.step, incarnation))
        return keys

    async def blobs(self) -> list[tuple[str, bytes]]:
        """(key, bytes) of each record this rank writes to a tier; the first call stores them in the index."""
        out = [await self._once("_rank_meta", self._build_rank_meta)]
        if self.plan.rank == 0:
            out.append(await self._once("_manifest", self._build_manifest))
        return list(zip(self.keys(), out))

    async def _once(self, attr: str, build: Any) -> bytes:
        task = getattr(self, attr)
        if task is None:
            task = asyncio.ensure_future(build())
            setattr(self, attr, task)
        return await asyncio.shield(task)

    async def _build_manifest(self) -> bytes:
        plan = self.plan
        assert plan.tensors is not None and plan.rank_nbytes is not None  # rank 0's plan holds the world's chunks
        manifest = Manifest(
            job=self.commit.job, step=self.step, world_size=plan.world_size, part_size=plan.part_size,
            checksum=self.algorithm, tensors=plan.tensors,
            ranks=tuple(RankMeta(r, n) for r, n in enumerate(plan.rank_nbytes)),
            skeleton=b"",  # each rank's record carries its own skeleton
            created=time.time(), metadata=self.metadata, index=self.commit.index.identity,
            incarnation=self.commit.incarnation, chunk_size=self.chunk_size)
        with automatic_gc_paused():  # 100k tensors: ~0.3 s of Python, off the loop (gc_pause.py)
            data = await asyncio.to_thread(manifest.to_bytes)
        await self.commit.put_manifest(self.step, data)
        return data

    async def _build_rank_meta(self) -> bytes:
        sums, chunk_sums = await self.checksums(), await self.chunk_sums()
        def encode() -> bytes:  # one trip to a thread for both (each trip costs the loop, and the GIL, more)
            return RankMeta(self.plan.rank, self.plan.nbytes, tuple(sums), encode_skeleton(self.skeleton), chunk_sums,
                            machine_name()).to_bytes()

        with automatic_gc_paused():
            data = await asyncio.to_thread(encode)
        await self.commit.put_rank_meta(self.step, data)
        return data
