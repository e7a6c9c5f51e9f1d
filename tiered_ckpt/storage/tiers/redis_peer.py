"""Redis as a peer cache: the memory of another node.

`urls` names one server per node, in ring order. A node writes to the next server in the ring after its own,
never to its own machine's, so a node that loses its memory and disk restores from its successor. A node is a
machine: its own server is the url whose host is this machine's name (`machine_name`: the host name, or
TIERED_CKPT_HOST), else the url whose address is one of this machine's (not loopback); when neither is found
(a service name, loopback addresses), the node's position among the job's machines in name order stands for
it, with a warning (`node` overrides all). A server that cannot be reached is
passed over for `down_seconds` (said once per server): the copy goes to the next server in the ring and
training goes on; only when every other server fails does a write fail. Reads look the value up on every
live server at once (after a node loss or a reshard, the copy sits wherever its writer's ring put it).

A server that hangs (its port open, no answer: a stopped process, a machine swapping) would cost every command
sent to it `socket_timeout`. So a server not heard from for IDLE_SECONDS (its first use, a pause between saves,
an outage that is over) is first sent a PING on a connection of its own, which must answer within
`probe_timeout`; one that does not is passed over as above, at the cost of that probe, once per `down_seconds`.
Every process probes for itself: a server that answers no one is skipped by every rank, to the same next
server (the ring is a node's); where verdicts differ (a server that answers some), a node's copies sit on two
servers, which reads, `missing` and healing find, since they look on every live server.

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
import ipaddress
import logging
import math
import re
import socket
import time
import uuid
from urllib.parse import urlsplit
from dataclasses import dataclass, field
from typing import Any, Sequence

import redis.asyncio as aioredis
from redis import exceptions as rexc
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff

from ...errors import ConfigError, TierError, TierFull, TierNotFound, TierUnavailable
from ..redis_connect import ERRORS, ProblemKind, RedisDeployment, classify, parse_url, redact
from .base import Tier, machine_name, scatter

log = logging.getLogger(__name__)
MAX_BULK = 512 * 2**20
# an answer vouches for a server this long: a burst of operations (a save's parts, a load's reads) probes it once
# at most, and its first use after a pause (between saves) probes it again
IDLE_SECONDS = 5.0
SEP = "#"  # never in engine keys ([A-Za-z0-9._/-]): marks chunk keys


@dataclass(frozen=True)
class RedisOptions:
    urls: tuple[str, ...]
    node: int | None = field(default=None, metadata={"min": 0})  # default: the url naming this machine, else by name
    prefix: str = "tiered_ckpt:"
    chunk_size: int = field(default=64 * 2**20, metadata={"size": True, "min": 1, "max": MAX_BULK - 2**20,
                                                          "why": "Redis caps a value at 512 MiB"})
    connections: int = field(default=8, metadata={"min": 1})
    # what one command may take: it sends at most one chunk and a reply brings at most one part (64 MiB each by
    # default), but a node's ranks share the link to one server, each with its tier's `inflight` (256 MiB)
    # under way, so a chunk may wait on the node's whole 2 GiB (8 ranks): 30 s moves that at ~70 MB/s, less
    # than a 1 Gbit/s link gives. A server that hangs in the middle of commands costs this once (they wait
    # together), then is passed over
    socket_timeout: float = field(default=30.0, metadata={"above": 0})
    # a PING's answer, before a server is used after IDLE_SECONDS without one: a LAN round trip is well under a
    # millisecond and Redis answers between the pieces of a large command; a server slower than this is passed
    # over for down_seconds (its copies go to the next one)
    probe_timeout: float = field(default=1.0, metadata={"above": 0})
    down_seconds: float = field(default=30.0, metadata={"min": 0})  # an unreachable server is passed over this long


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
        self.own: int | None = options.node  # the server on this machine (None: none of the urls)
        self._down: dict[int, float] = {}  # server -> until when it is passed over
        self._heard: dict[int, float] = {}  # server -> when it last answered
        self._probes: dict[int, asyncio.Future[None]] = {}  # server -> its PING in flight, shared by every caller
        self._clients: list[Any] = []
        self._pingers: dict[int, Any] = {}  # one server -> a client of its own for the PING (not the pool's)
        # one server: its URL as redis-py takes it (a password holding '@', ':' or '/' percent-encoded)
        self._plain = {i: parse_url(url, key=f"tiers.{name}.urls").plain for i, url in enumerate(options.urls)}
        # redis+cluster:// and redis+sentinel:// urls (checked here, so a bad one fails at config time)
        self._deployments = {i: RedisDeployment(url, key=f"tiers.{name}.urls", socket_timeout=options.socket_timeout)
                             for i, url in enumerate(options.urls) if url.startswith(("redis+", "rediss+"))}

    def bind(self, *, node: int, **_: Any) -> None:
        if self.options.node is not None:
            return
        self.node = node
        mine = _first_label(machine_name())
        hosts = {i: urlsplit(self._plain[i]).hostname or "" for i in self._plain}
        named = [i for i, h in hosts.items() if _first_label(h) == mine]
        if not named and len(self.options.urls) > 1:  # urls by address: the one that is an address of this machine
            named = [i for i, h in hosts.items() if _is_this_machine(h)]
        self.own = named[0] if named else None
        if self.own is None and len(self.options.urls) > 1:
            log.warning("tier %s: no url names this machine (%s), so its ring position is its node number %d among "
                        "the job's machines in name order, which a replaced machine with another name shifts; name "
                        "each url by its machine's host name", self.name, machine_name(), node)

    async def open(self) -> None:
        # A blocking pool: past `connections`, a command waits for a free connection instead of failing. A
        # command that meets a closed connection (the server restarted since it was pooled) is sent once more at
        # once, on a new one, before the pipeline counts a failed try (every command here is idempotent); a
        # timeout is not retried here (a server that does not answer is passed over): redis-py's Retry retries
        # timeouts too unless told which errors it may retry, and a hung server then cost two socket_timeouts.
        self._clients = [self._deployments[i].open() if i in self._deployments else
                         aioredis.Redis(connection_pool=aioredis.BlockingConnectionPool.from_url(
                             self._plain[i], max_connections=self.options.connections, timeout=None,
                             socket_timeout=self.options.socket_timeout, socket_connect_timeout=10,
                             retry=Retry(NoBackoff(), 1, supported_errors=(rexc.ConnectionError,)),
                             retry_on_error=[rexc.ConnectionError]))
                         for i, url in enumerate(self.options.urls)]
        # the PING's own connection: a pool busy with a save's chunks would make it wait for a free one (the
        # PING's deadline is _ping's; the socket's timeouts are a backstop)
        backstop = 2 * self.options.probe_timeout
        self._pingers = {i: aioredis.Redis.from_url(self._plain[i], socket_timeout=backstop,
                                                    socket_connect_timeout=backstop, retry=Retry(NoBackoff(), 0))
                         for i in range(len(self.options.urls)) if i not in self._deployments}
        for deployment in self._deployments.values():
            await deployment.connect()

    async def close(self) -> None:
        for task in list(self._probes.values()):
            task.cancel()
        for pinger in self._pingers.values():
            await pinger.aclose()
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
        await self._probe(server)
        client = self._clients[server]
        return await (client.mget_nonatomic(names) if self._kind(server) == "cluster" else client.mget(names))

    def ring(self) -> list[int]:
        """The servers this node writes to, in order of preference: the ring from its own server's successor on,
        its own server left out (a copy on the writer's machine dies with it), unless there is only one."""
        n = len(self.options.urls)
        if n == 1:
            return [0]
        start = self.own if self.own is not None else self.node % n
        return [(start + 1 + i) % n for i in range(n - 1)]

    async def _probe(self, server: int) -> None:
        """Before `server` is used when it has not answered for IDLE_SECONDS: a PING, which must answer within
        `probe_timeout` (one at a time, shared by every caller); what it met is raised as a command's error would
        be, only sooner. A Cluster or Sentinel url is not probed (its client finds its nodes itself)."""
        if server in self._deployments or time.monotonic() - self._heard.get(server, -math.inf) < IDLE_SECONDS:
            return
        probe = self._probes.get(server)
        if probe is None:
            probe = self._probes[server] = asyncio.ensure_future(self._ping(server))
            probe.add_done_callback(lambda p: p.cancelled() or p.exception())  # (read, if every caller left)
        await asyncio.shield(probe)

    async def _ping(self, server: int) -> None:
        try:
            await asyncio.wait_for(self._pingers[server].ping(), self.options.probe_timeout)
        except asyncio.TimeoutError:
            raise rexc.TimeoutError(f"no answer to a PING within {self.options.probe_timeout:g} s") from None
        finally:
            self._probes.pop(server, None)
        self._answered(server)

    def _answered(self, server: int) -> None:
        """`server` answered: an outage it was in is over (said once)."""
        self._heard[server] = time.monotonic()
        if self._down.pop(server, None) is not None:
            log.warning("tier %s: redis %s answers again", self.name, redact(self.options.urls[server]))

    def _live(self, servers: Sequence[int]) -> list[int]:
        """`servers` less those passed over just now (all of them when none is left: one may be back)."""
        now = time.monotonic()
        live = [s for s in servers if self._down.get(s, 0.0) <= now]
        return live or list(servers)

    def _passed_over(self, server: int, e: BaseException) -> bool:
        """Whether `e` makes `server` one to pass over (unreachable); if so, say so once per outage."""
        if classify(e, self._kind(server)).kind != "transient":
            return False
        self._heard.pop(server, None)  # it is probed before it is used again
        if len(self._clients) == 1:
            return False
        if server not in self._down:  # once per outage: until the server answers again
            log.warning("tier %s: redis %s is unreachable (%s); passing it over for %.0f s, its copies go to the "
                        "next server in the ring", self.name, redact(self.options.urls[server]),
                        classify(e, self._kind(server)).text, self.options.down_seconds)
        self._down[server] = time.monotonic() + self.options.down_seconds
        return True

    def _fail(self, server: int, e: BaseException, what: str) -> TierError:
        url = redact(self.options.urls[server])
        problem = classify(e, self._kind(server))
        if problem.kind is ProblemKind.AUTH:  # a ConnectionError, but final
            return TierError(f"redis {url} refused the credentials {what}: {e}", tier=self.name)
        if problem.kind is ProblemKind.OOM or "OOM" in str(e):
            return TierFull(f"redis {url} is out of memory (maxmemory) {what}", tier=self.name)
        if problem.kind is ProblemKind.TRANSIENT:  # unreachable, or a failover or resharding under way: retried
            return TierUnavailable(f"redis {url} unreachable {what}: {problem.text}", tier=self.name)
        return TierError(f"redis {url} {what}: {problem.text}", tier=self.name)

    async def write(self, key: str, data: memoryview) -> None:
        view = memoryview(data).cast("B")
        servers = self._live(self.ring())
        for i, server in enumerate(servers):
            try:
                await self._probe(server)
                await self._write_to(server, key, view)
                self._answered(server)
                return
            except ERRORS as e:
                if i + 1 < len(servers) and self._passed_over(server, e):
                    continue
                raise self._fail(server, e, f"writing {key}") from e

    async def _write_to(self, server: int, key: str, view: memoryview) -> None:
        client, full = self._clients[server], self.options.prefix + key
        version = uuid.uuid4().hex[:8]
        size = self.options.chunk_size
        chunks = [view[i : i + size] for i in range(0, len(view), size)] or [view]
        old = await client.get(full)
        await asyncio.gather(*(client.set(f"{full}{SEP}{version}{SEP}{i}", c) for i, c in enumerate(chunks)))
        await client.set(full, f"{version}:{len(chunks)}:{len(view)}")
        if old:
            old_version, count, _ = old.decode().split(":")
            await client.unlink(*(f"{full}{SEP}{old_version}{SEP}{i}" for i in range(int(count))))

    def _read_order(self) -> list[int]:
        """Every server, this node's write targets first (where its own copies are), its own server last."""
        ring = self.ring()
        return ring + [s for s in range(len(self.options.urls)) if s not in ring]

    async def _headers(self, names: list[str]) -> dict[int, list[Any]]:
        """Each live server's headers of `names` (one MGET each, all at once); unreachable servers are left out
        (passed over), other errors raised."""
        servers = self._live(self._read_order())
        found = await asyncio.gather(*(self._mget(s, names) for s in servers), return_exceptions=True)
        out: dict[int, list[Any]] = {}
        for server, result in zip(servers, found):
            if isinstance(result, BaseException):
                if isinstance(result, ERRORS) and self._passed_over(server, result):
                    continue
                if isinstance(result, ERRORS):
                    raise self._fail(server, result, f"reading {names[0] if len(names) == 1 else 'headers'}") \
                        from result
                raise result
            self._answered(server)
            out[server] = result
        if not out and servers:
            raise TierUnavailable(f"no server of {[redact(u) for u in self.options.urls]} can be reached",
                                  tier=self.name)
        return out

    async def _locate(self, key: str) -> tuple[int, str, int, int]:
        """The server holding `key` (looked up on every live server at once) and its header."""
        for server, (header,) in (await self._headers([self.options.prefix + key])).items():
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
        self._answered(server)
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
        """Keys whose value is whole on no live server (the ring may have placed a copy on any of them)."""
        prefix, gone = self.options.prefix, list(keys)
        if not keys:
            return []
        for server, found in (await self._headers([prefix + k for k in keys])).items():
            if not gone:
                break
            chunk_names, owners = [], []
            for key, header in zip(keys, found, strict=True):
                if header is not None and key in gone:
                    version, count, _ = header.decode().split(":")
                    for i in range(int(count)):
                        chunk_names.append(f"{prefix}{key}{SEP}{version}{SEP}{i}")
                        owners.append(key)
            try:
                pipe = self._clients[server].pipeline(transaction=False)
                for name in chunk_names:
                    pipe.exists(name)
                present = await pipe.execute() if chunk_names else []
                self._answered(server)
            except ERRORS as e:
                if self._passed_over(server, e):
                    continue  # gone meanwhile: what it holds counts as missing
                raise self._fail(server, e, "checking parts") from e
            whole = {k for k, header in zip(keys, found, strict=True) if header is not None}
            whole -= {owner for owner, ok in zip(owners, present, strict=True) if not ok}
            gone = [k for k in gone if k not in whole]
        return sorted(gone)

    async def delete(self, prefix: str) -> None:
        pattern = f"{glob_escaped(self.options.prefix + prefix)}*"
        for server in self._live(range(len(self._clients))):
            client = self._clients[server]
            try:
                await self._probe(server)
                batch = []
                async for k in client.scan_iter(match=pattern, count=1000):
                    batch.append(k)
                    if len(batch) >= 1000:
                        await client.unlink(*batch)
                        batch = []
                if batch:
                    await client.unlink(*batch)
                self._answered(server)
            except ERRORS as e:
                if self._passed_over(server, e):
                    continue  # a server that is gone took its keys with it
                raise self._fail(server, e, f"deleting {prefix}*") from e

    async def list(self, prefix: str) -> list[str]:
        """Every server's keys under `prefix`; a server passed over (unreachable now) is left out, and
        `listed_partly` says so until the next listing: what it holds is unknown, not gone."""
        keys: set[str] = set()
        live = self._live(range(len(self._clients)))
        self.listed_partly = len(live) < len(self._clients)
        for server in live:
            client = self._clients[server]
            try:
                await self._probe(server)
                async for k in client.scan_iter(match=f"{glob_escaped(self.options.prefix + prefix)}*", count=1000):
                    name = k.decode()[len(self.options.prefix):]
                    if SEP not in name:
                        keys.add(name)
                self._answered(server)
            except ERRORS as e:
                if self._passed_over(server, e):
                    self.listed_partly = True
                    continue  # what it held cannot be read now
                raise self._fail(server, e, f"listing {prefix}*") from e
        return sorted(keys)


def _is_this_machine(host: str) -> bool:
    """Whether `host` is an address of this machine: one a socket can bind to. Loopback addresses are left out
    (every node has them; emulated nodes on one host share them)."""
    try:
        infos = socket.getaddrinfo(host, None, type=socket.SOCK_DGRAM)
    except OSError:
        return False
    for family, _, _, _, address in infos:
        if ipaddress.ip_address(address[0].split("%")[0]).is_loopback:
            continue
        with socket.socket(family, socket.SOCK_DGRAM) as probe:
            try:
                probe.bind((address[0], 0))
                return True
            except OSError:
                continue
    return False


def _first_label(host: str) -> str:
    """A host name as a machine is compared by: its first label, any case (`gpu1` and `gpu1.example.com` are one
    machine; an IP address is compared whole)."""
    host = host.lower()
    return host if host.replace(".", "").isdigit() or ":" in host else host.split(".")[0]


def glob_escaped(text: str) -> str:
    """`text` matched literally by a SCAN MATCH pattern: a prefix "ck[1]:" would otherwise match "ck1:"."""
    return re.sub(r"([*?\[\]\\])", r"\\\1", text)
