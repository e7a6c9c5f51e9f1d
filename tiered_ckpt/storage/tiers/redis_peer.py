"""Redis as a peer cache: the memory of another node.

Ranks are grouped into nodes; node n writes to the Redis of node n+1 (`urls`, one per node, in node
order), so a node that loses its memory and disk restores from its successor. Reads try the successor
first, then the other servers in ring order (after a reshard, a part may have been written by another
node).

A value is stored as chunks well below Redis's 512 MiB bulk limit (`chunk_size`, checked client-side,
so an oversized write is a clear error rather than a bare "Broken pipe"), written concurrently over a
connection pool, then a small header naming them is written last: replacing a value is atomic, and a
chunk evicted under maxmemory is detected on read (TierNotFound, so the engine falls back to the next
tier). Connection problems raise TierUnavailable (retried by the pipeline) naming the tier and server.

A url may also be a Redis Cluster (`redis+cluster://host:port[,host:port...]`: chunks spread over its
masters, key names unchanged) or the master a Sentinel names (`redis+sentinel://host:port/<master-name>/<db>`),
e.g. one cluster shared by every node (`urls = ["redis+cluster://..."]`, a ring of one). A down slot
(CLUSTERDOWN), a redirection the client could not follow (MOVED/ASK) or a failover under way are
TierUnavailable naming what happened.
"""
from __future__ import annotations

import asyncio
import uuid
from dataclasses import dataclass, field
from typing import Any, Sequence

import redis.asyncio as aioredis

from ...errors import ConfigError, TierError, TierFull, TierNotFound, TierUnavailable
from ..redis_connect import ERRORS, RedisDeployment, classify, parse_url, redact
from .base import Tier, scatter

MAX_BULK = 512 * 2**20
SEP = "#"  # never in engine keys ([A-Za-z0-9._/-]): marks chunk keys


@dataclass(frozen=True)
class RedisOptions:
    urls: tuple[str, ...]
    node: int | None = field(default=None, metadata={"min": 0})  # default: torchrun's GROUP_RANK, else by hostname
    prefix: str = "tiered_ckpt:"
    chunk_size: int = field(default=64 * 2**20, metadata={"size": True, "min": 1, "max": MAX_BULK - 2**20,
                                                          "why": "Redis caps a value at 512 MiB"})
    connections: int = field(default=8, metadata={"min": 1})
    socket_timeout: float = field(default=120.0, metadata={"above": 0})


class RedisPeerTier(Tier):
    Options = RedisOptions

    @classmethod
    def check_options(cls, name: str, options: RedisOptions) -> None:
        if not options.urls:
            raise ConfigError("needs at least one url", key=f"tiers.{name}.urls")
        if not 0 < options.chunk_size <= MAX_BULK - 2**20:
            raise ConfigError(f"must be between 1 byte and {MAX_BULK - 2**20} (Redis caps a value at 512 MiB)",
                              key=f"tiers.{name}.chunk_size")
        for url in options.urls:
            parse_url(url, key=f"tiers.{name}.urls")

    def __init__(self, name: str, options: RedisOptions):
        super().__init__(name, options)
        self.node = options.node if options.node is not None else 0
        self._clients: list[Any] = []
        # one server: its URL as redis-py takes it (a password holding '@', ':' or '/' percent-encoded)
        self._plain = {i: parse_url(url, key=f"tiers.{name}.urls").plain for i, url in enumerate(options.urls)}
        # redis+cluster:// and redis+sentinel:// urls (checked here, so a bad one fails at config time)
        self._deployments = {i: RedisDeployment(url, key=f"tiers.{name}.urls", socket_timeout=options.socket_timeout)
                             for i, url in enumerate(options.urls) if url.startswith(("redis+", "rediss+"))}

    def bind(self, *, node: int, **_: Any) -> None:
        if self.options.node is None:
            self.node = node

    async def open(self) -> None:
        # A blocking pool: past `connections`, a command waits for a free connection instead of failing.
        self._clients = [self._deployments[i].open() if i in self._deployments else
                         aioredis.Redis(connection_pool=aioredis.BlockingConnectionPool.from_url(
                             self._plain[i], max_connections=self.options.connections, timeout=None,
                             socket_timeout=self.options.socket_timeout, socket_connect_timeout=10))
                         for i, url in enumerate(self.options.urls)]
        for deployment in self._deployments.values():
            await deployment.connect()

    async def close(self) -> None:
        for i, client in enumerate(self._clients):
            if i in self._deployments:
                await self._deployments[i].close()
                continue
            await client.aclose()
            await client.connection_pool.disconnect()  # a pool passed in is not closed by aclose()

    def _kind(self, server: int) -> str:
        return self._deployments[server].kind if server in self._deployments else "single"

    async def _mget(self, server: int, names: list[str]) -> list[Any]:
        """MGET; on a cluster, one MGET per hash slot (the names spread over the masters)."""
        client = self._clients[server]
        return await (client.mget_nonatomic(names) if self._kind(server) == "cluster" else client.mget(names))

    def _ring(self) -> list[int]:
        n = len(self._clients)
        return [(self.node + 1 + i) % n for i in range(n)]

    def _fail(self, server: int, e: BaseException, what: str) -> TierError:
        url = redact(self.options.urls[server])
        problem = classify(e, self._kind(server))
        if problem.kind == "auth":  # a ConnectionError, but final
            return TierError(f"redis {url} refused the credentials {what}: {e}", tier=self.name)
        if problem.kind == "oom" or "OOM" in str(e):
            return TierFull(f"redis {url} is out of memory (maxmemory) {what}", tier=self.name)
        if problem.kind == "transient":  # unreachable, or a failover or resharding under way: retried
            return TierUnavailable(f"redis {url} unreachable {what}: {problem.text}", tier=self.name)
        return TierError(f"redis {url} {what}: {problem.text}", tier=self.name)

    async def write(self, key: str, data: memoryview) -> None:
        server = self._ring()[0]
        client, full = self._clients[server], self.options.prefix + key
        view = memoryview(data).cast("B")
        version = uuid.uuid4().hex[:8]
        size = self.options.chunk_size
        chunks = [view[i : i + size] for i in range(0, len(view), size)] or [view]
        try:
            old = await client.get(full)
            await asyncio.gather(*(client.set(f"{full}{SEP}{version}{SEP}{i}", c) for i, c in enumerate(chunks)))
            await client.set(full, f"{version}:{len(chunks)}:{len(view)}")
            if old:
                old_version, count, _ = old.decode().split(":")
                await client.unlink(*(f"{full}{SEP}{old_version}{SEP}{i}" for i in range(int(count))))
        except ERRORS as e:
            raise self._fail(server, e, f"writing {key}") from e

    async def _locate(self, key: str) -> tuple[int, str, int, int]:
        full = self.options.prefix + key
        for server in self._ring():
            try:
                header = await self._clients[server].get(full)
            except ERRORS as e:
                if classify(e, self._kind(server)).kind == "transient" and len(self._clients) > 1:
                    continue  # a node down: its successor may still hold the value
                raise self._fail(server, e, f"reading {key}") from e
            if header is not None:
                version, count, length = header.decode().split(":")
                return server, version, int(count), int(length)
        raise TierNotFound(f"{key} is on none of {[redact(u) for u in self.options.urls]}", tier=self.name)

    async def _chunks(self, key: str) -> tuple[int, list[bytes]]:
        server, version, count, length = await self._locate(key)
        full = self.options.prefix + key
        names = [f"{full}{SEP}{version}{SEP}{i}" for i in range(count)]
        try:
            client = self._clients[server]
            chunks = [await client.get(names[0])] if count == 1 else await self._mget(server, names)
        except ERRORS as e:
            raise self._fail(server, e, f"reading {key}") from e
        if any(c is None for c in chunks):
            raise TierNotFound(f"{key}: chunk missing on redis {redact(self.options.urls[server])} (evicted?)",
                               tier=self.name)
        return length, chunks

    async def read_into(self, key: str, out: Sequence[memoryview]) -> int:
        length, chunks = await self._chunks(key)
        if length == sum(len(b) for b in out):
            await self.run_blocking(scatter, chunks, out)
        return length

    async def read(self, key: str) -> bytes:
        return b"".join((await self._chunks(key))[1])

    async def missing(self, keys: Sequence[str]) -> list[str]:
        server = self._ring()[0]  # where this node wrote them
        client, prefix = self._clients[server], self.options.prefix
        try:
            headers = await self._mget(server, [prefix + k for k in keys]) if keys else []
            chunk_names, owners = [], []
            for key, header in zip(keys, headers, strict=True):
                if header is not None:
                    version, count, _ = header.decode().split(":")
                    for i in range(int(count)):
                        chunk_names.append(f"{prefix}{key}{SEP}{version}{SEP}{i}")
                        owners.append(key)
            pipe = client.pipeline(transaction=False)
            for name in chunk_names:
                pipe.exists(name)
            present = await pipe.execute() if chunk_names else []
        except ERRORS as e:
            raise self._fail(server, e, "checking parts before the commit") from e
        gone = {k for k, h in zip(keys, headers, strict=True) if h is None}
        gone |= {owner for owner, ok in zip(owners, present, strict=True) if not ok}
        return sorted(gone)

    async def delete(self, prefix: str) -> None:
        pattern = f"{self.options.prefix}{prefix}*"
        for server, client in enumerate(self._clients):
            try:
                batch = []
                async for k in client.scan_iter(match=pattern, count=1000):
                    batch.append(k)
                    if len(batch) >= 1000:
                        await client.unlink(*batch)
                        batch = []
                if batch:
                    await client.unlink(*batch)
            except ERRORS as e:
                raise self._fail(server, e, f"deleting {prefix}*") from e

    async def list(self, prefix: str) -> list[str]:
        keys: set[str] = set()
        for server, client in enumerate(self._clients):
            try:
                async for k in client.scan_iter(match=f"{self.options.prefix}{prefix}*", count=1000):
                    name = k.decode()[len(self.options.prefix):]
                    if SEP not in name:
                        keys.add(name)
            except ERRORS as e:
                raise self._fail(server, e, f"listing {prefix}*") from e
        return sorted(keys)
