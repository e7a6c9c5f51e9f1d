"""How the Redis index (and the Redis peer tier) reach a Redis deployment: one server, a Redis Cluster, or a
master found through Sentinel, and what each failure of such a deployment is called.

URLs (credentials are never shown: messages use `identity`, which has neither credentials nor options, or
`redact(url)`). The userinfo runs from `://` to the last `@` before the host, so a password may hold `@`, `:`
and `/` as they are; `?`, `#` and `%` must be percent-encoded (`%3F`, `%23`, `%25`).

    redis://[user:pass@]host:port[/db]           one server (rediss:// with TLS; unix:///path.sock?db=N)
    redis+cluster://[user:pass@]host:port[,host:port...][/0]
                                                 a Redis Cluster: the startup nodes (rediss+cluster:// with TLS)
    redis+sentinel://[user:pass@]host:port[,host:port...]/<master-name>[/db]
                                                 the master Sentinel names (rediss+sentinel:// with TLS to the
                                                 master); the credentials are the master's

Options, in the query string (taken out before the URL reaches redis-py, which would refuse them):

    wait=N              replicas that must acknowledge every write (Redis `WAIT N`) before it counts as done;
                        default 1 with Sentinel (an acknowledged commit survives a failover), 0 otherwise
    wait_timeout=S      seconds one WAIT may take (default 2.0)
    failover_timeout=S  how long one operation is retried while the deployment fails over (connection refused
                        or reset, no master, CLUSTERDOWN, TRYAGAIN, MASTERDOWN, LOADING, READONLY, too few
                        replicas acknowledging); default 30 with Sentinel or a cluster, 0 with one server
    max_connections=N   operations of the index in flight at once through this client, each on its own
                        connection (default 64; more wait for a free one)
    sentinel_username=U, sentinel_password=P
                        the sentinels' own credentials, if they have some (the URL's are the master's)
"""
from __future__ import annotations

import asyncio
import math
import random
import time
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any, Awaitable, Callable, Sequence, TypeVar
from urllib.parse import parse_qsl, quote, unquote, urlencode, urlsplit, urlunsplit

import redis.asyncio as aioredis
from redis import exceptions as rexc
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff

from ..config import REDIS_SCHEMES
from ..errors import ConfigError, redact

T = TypeVar("T")
_jitter = random.Random()  # its own: a retry never draws from the training process's global RNG
OPTIONS = ("wait", "wait_timeout", "failover_timeout", "max_connections", "sentinel_username", "sentinel_password")


@dataclass(frozen=True)
class RedisURL:
    """A parsed Redis URL. `plain` is what redis-py gets for one server (the URL without our options)."""

    kind: str  # "single", "cluster" or "sentinel"
    identity: str
    plain: str = field(repr=False)  # (it holds the password: never in a repr, a log or a traceback's locals)
    hosts: tuple[tuple[str, int], ...] = ()
    service: str | None = None
    db: int = 0
    username: str | None = None
    password: str | None = field(default=None, repr=False)
    ssl: bool = False
    wait: int = 0
    wait_timeout: float = 2.0
    failover_timeout: float = 0.0
    max_connections: int = 64
    sentinel_username: str | None = None
    sentinel_password: str | None = field(default=None, repr=False)


def parse_url(url: str, *, key: str) -> RedisURL:
    """Parse a Redis URL of any of the three forms; a ConfigError naming `key` (never the password) if bad."""
    scheme, sep, _ = url.partition("://")
    if not sep or f"{scheme}://" not in REDIS_SCHEMES:
        raise ConfigError(f"{redact(url)}: expected one of {', '.join(s + '…' for s in REDIS_SCHEMES)}", key=key)
    try:
        return _parse(url, scheme, key)
    except ValueError as e:  # urllib's (a port that is not a number, a bad IPv6 address): it may quote the URL
        if isinstance(e, ConfigError):
            raise
        raise ConfigError(f"{redact(url)}: not a valid URL (a port that is not a number? a password holding '?', "
                          f"'#' or '%' must be percent-encoded)", key=key) from None


def quoted_userinfo(url: str) -> str:
    """`url` with its userinfo (from `://` to the last `@` before the host, the query left aside) percent-encoded,
    so a password holding `@`, `:` or `/` reaches the URL parser (urllib, redis-py) whole. `?`, `#` and `%` in
    a password must be percent-encoded already (they end the host part, or are decoded)."""
    scheme, _, rest = url.partition("://")
    body, q, query = rest.partition("?")
    userinfo, at, hostpath = body.rpartition("@")
    if not at:
        return url
    user, colon, password = userinfo.partition(":")
    safe = quote(unquote(user), safe="") + (":" + quote(unquote(password), safe="") if colon else "")
    return f"{scheme}://{safe}@{hostpath}{q}{query}"


def _parse(url: str, scheme: str, key: str) -> RedisURL:
    parts = urlsplit(quoted_userinfo(url))
    query = parse_qsl(parts.query, keep_blank_values=True)
    ours = {k: v for k, v in query if k in OPTIONS}
    rest = [(k, v) for k, v in query if k not in OPTIONS]
    kind = "cluster" if scheme.endswith("+cluster") else "sentinel" if scheme.endswith("+sentinel") else "single"

    def number(name: str, cast: Callable[[str], Any], default: Any, low: float) -> Any:
        if name not in ours:
            return default
        try:
            value = cast(ours[name])
        except ValueError:
            value = None
        if value is None or not math.isfinite(value) or not value >= low:  # nan and inf too: never meant
            raise ConfigError(f"{redact(url)}: option {name}={ours[name]!r} must be a finite number >= {low}",
                              key=key)
        return value

    options = dict(
        wait=number("wait", int, 1 if kind == "sentinel" else 0, 0),
        wait_timeout=number("wait_timeout", float, 2.0, 0.001),
        failover_timeout=number("failover_timeout", float, 0.0 if kind == "single" else 30.0, 0),
        max_connections=number("max_connections", int, 64, 1),
        sentinel_username=ours.get("sentinel_username"), sentinel_password=ours.get("sentinel_password"))
    if kind == "single":
        db_part = parts.path.strip("/") if scheme != "unix" else ""
        if db_part and not db_part.isdigit():  # redis-py would drop it silently: database 0, maybe another's
            raise ConfigError(f"{redact(url)}: the path names the database, a number (/0, /1, ...), not "
                              f"{parts.path!r}", key=key)
        plain = urlunsplit((parts.scheme, parts.netloc, parts.path, urlencode(rest), parts.fragment))
        return RedisURL("single", _single_identity(parts), plain, **options)
    if rest:
        raise ConfigError(f"{redact(url)}: unknown option(s) {sorted(k for k, _ in rest)} (known: "
                          f"{', '.join(OPTIONS)})", key=key)
    userinfo, _, hostlist = parts.netloc.rpartition("@")  # (quoted: the last '@' is the host's)
    username, _, password = userinfo.partition(":")
    hosts = []
    for item in hostlist.split(","):
        host, _, port = item.strip().rpartition(":")
        if not host or not port.isdigit():
            raise ConfigError(f"{redact(url)}: {item!r} is not host:port", key=key)
        hosts.append((host.strip("[]"), int(port)))
    path = [p for p in parts.path.split("/") if p]
    service, db = None, 0
    if kind == "cluster":
        if len(path) > 1 or (path and path[0] != "0"):
            raise ConfigError(f"{redact(url)}: a Redis Cluster has only database 0 (got /{'/'.join(path)})", key=key)
        identity = f"{scheme}://{_hostlist(hosts)}"
    else:
        if not path or len(path) > 2 or (len(path) == 2 and not path[1].isdigit()):
            raise ConfigError(f"{redact(url)}: expected {scheme}://host:port[,host:port...]/<master-name>[/db]",
                              key=key)
        service, db = path[0], int(path[1]) if len(path) == 2 else 0
        identity = f"{scheme}://{_hostlist(hosts)}/{service}/{db}"
    return RedisURL(kind, identity, url, tuple(hosts), service, db, unquote(username) or None,
                    unquote(password) or None, scheme.startswith("rediss"), **options)


def _hostlist(hosts: Sequence[tuple[str, int]]) -> str:
    return ",".join(sorted(f"{h}:{p}" for h, p in hosts))  # any order names the same deployment


def _single_identity(parts: Any) -> str:
    """The URL without credentials or options: which server and database, never a secret. (Unchanged from
    earlier releases: it is recorded in every manifest.)"""
    if parts.scheme == "unix":
        return f"unix://{parts.path}"
    return f"{parts.scheme}://{parts.hostname}:{parts.port or 6379}{parts.path or '/0'}"


class NotReplicated(Exception):
    """A write reached the master, but fewer replicas than wanted acknowledged it within the WAIT timeout."""

    def __init__(self, acked: int, wanted: int, timeout: float):
        super().__init__(f"written on the master but acknowledged by {acked} of the {wanted} replica(s) wanted "
                         f"within {timeout:g}s (WAIT); a failover now could lose it")
        self.acked, self.wanted = acked, wanted


class ProblemKind(StrEnum):
    """What kind of thing went wrong with Redis: it decides what the index and the peer tier do about it."""

    AUTH = "auth"  # credentials refused: final
    FENCED = "fenced"  # a newer writer fenced this one out
    CONFIG = "config"  # the deployment is not what the url says (a cluster node behind a plain url, say)
    OOM = "oom"  # the server is out of memory (maxmemory)
    TRANSIENT = "transient"  # a failover or an outage: retried within failover_timeout
    ERROR = "error"  # a refused command
    PROTOCOL = "protocol"  # the answer is not Redis's


@dataclass(frozen=True)
class Problem:
    """What went wrong: its kind, and in words."""

    kind: ProblemKind
    text: str

    def __post_init__(self) -> None:
        object.__setattr__(self, "kind", ProblemKind(self.kind))  # classify() names kinds by their words


CHAINED = (ProblemKind.ERROR, ProblemKind.TRANSIENT)  # raised with redis-py's error as the cause


# redis-py error classes that name one problem whatever the deployment: (classes, kind, text), the text
# formatted with the error as {e} and "<class>: <error>" as {text} (in the style of redis-py's EXCEPTION_CLASSES
# table). classify() tries them after the special cases, in this order, the first match winning: a subclass
# comes before its base (MasterDownError is a ClusterDownError, which is a ClusterError). None of them is an
# AskError or a ReadOnlyError; those that are ResponseErrors or ConnectionErrors come before the catch-alls.
_BY_CLASS: tuple[tuple[type | tuple[type, ...], str, str], ...] = (
    (rexc.MasterDownError, "transient", "a replica lost its master (MASTERDOWN: {e})"),
    (rexc.ClusterDownError, "transient", "the cluster is down (CLUSTERDOWN: {e}): some hash slot has no reachable "
                                         "master"),
    (rexc.TryAgainError, "transient", "a hash slot is being migrated (TRYAGAIN: {e})"),
    (rexc.ClusterCrossSlotError, "error", "keys of one operation in different hash slots (CROSSSLOT: {e})"),
    (rexc.SlotNotCoveredError, "transient", "no master serves a hash slot ({e})"),
    ((rexc.ClusterError, rexc.RedisClusterException), "transient", "the cluster cannot serve the request "
                                                                   "({text})"),
    (rexc.BusyLoadingError, "transient", "the server is loading its data set (LOADING: {e})"),
    (rexc.MaxConnectionsError, "error", "every connection of the client's pool is in use ({e}): lower the "
                                        "concurrency, or raise max_connections"),
)


def classify(e: BaseException, deployment: str) -> Problem:
    """Name a redis-py error. `deployment` is "single", "cluster" or "sentinel"."""
    text = f"{type(e).__name__}: {e}"
    if isinstance(e, NotReplicated):
        return Problem("transient", str(e))
    refused, seen = e, 0
    while refused is not None and seen < 8:  # a cluster client wraps it: "Redis Cluster cannot be connected"
        if isinstance(refused, (rexc.AuthenticationError, rexc.AuthorizationError)):
            return Problem("auth", f"the server refused the credentials ({type(refused).__name__}: {refused})")
        refused, seen = refused.__cause__ or refused.__context__, seen + 1
    if isinstance(e, rexc.ResponseError) and "FENCED" in str(e):
        return Problem("fenced", str(e))
    if isinstance(e, rexc.AskError):  # MOVED and ASK: "<slot> <host>:<port>"
        what = "MOVED" if isinstance(e, rexc.MovedError) else "ASK"
        if deployment != "cluster":
            return Problem("config", f"the server is a node of a Redis Cluster: it redirected slot {e.slot_id} to "
                                     f"{e.host}:{e.port} ({what}); use redis+cluster://host:port[,host:port...]")
        return Problem("transient", f"the cluster redirected slot {e.slot_id} to {e.host}:{e.port} ({what}) and the "
                                    f"client could not follow: the cluster is resharding or failing over")
    if isinstance(e, rexc.ReadOnlyError):
        if deployment == "single":  # a managed service's endpoint moving to the new primary, or a wrong URL
            return Problem("transient", f"the server is a read-only replica (READONLY: {e}): a failover under way "
                                        f"(failover_timeout retries through it), or the URL names a replica (use the "
                                        f"primary's, or redis+sentinel://)")
        return Problem("transient", f"the server is a replica now (READONLY: {e}): a failover is under way")
    for classes, kind, template in _BY_CLASS:
        if isinstance(e, classes):
            return Problem(kind, template.format(e=e, text=text))
    # the rest in this order: an OOM reply is a ResponseError; MasterNotFoundError is a ConnectionError
    if isinstance(e, rexc.OutOfMemoryError) or (isinstance(e, rexc.ResponseError) and str(e).startswith("OOM")):
        return Problem("oom", f"the server is out of memory (maxmemory): {e}")
    if isinstance(e, rexc.ResponseError):
        return Problem("error", str(e))
    if type(e).__name__ in ("MasterNotFoundError", "SlaveNotFoundError"):
        return Problem("transient", f"no sentinel names a reachable master ({_without_repr(str(e))})")
    if isinstance(e, (rexc.ConnectionError, rexc.TimeoutError, OSError, asyncio.TimeoutError)):
        return Problem("transient", text)
    return Problem("protocol", f"{text} (is this a Redis server?)")


def _without_repr(text: str) -> str:
    """redis-py's "No master found for 'x' : <a 1,300-character repr of the client> - network:ConnectionError",
    less the repr (it names no server the URL does not, and buries the reason)."""
    head, sep, tail = text.partition(" : <")
    if not sep:
        return text
    reason = tail.rpartition(">")[2].strip(" -")
    return f"{head}: {reason}" if reason else head


ERRORS = (rexc.RedisError, rexc.RedisClusterException, NotReplicated, OSError, asyncio.TimeoutError)


class RedisDeployment:
    """A client of one deployment, with the one thing every write of the index needs: run it, then (with
    `wait`) WAIT on the same connection until enough replicas acknowledged it."""

    def __init__(self, url: str, *, key: str, socket_timeout: float = 30.0, connect_timeout: float = 10.0):
        self.url = parse_url(url, key=key)
        self.key = key
        self.identity = self.url.identity
        self.socket_timeout, self.connect_timeout = socket_timeout, connect_timeout
        self.client: Any = None
        self._sentinel: Any = None
        # call() bounds the operations in flight (and so the connections in use): redis-py's pools refuse more
        # than their size (MaxConnectionsError) instead of waiting
        self._slots = asyncio.Semaphore(self.url.max_connections)
        self._shas: dict[str, str] = {}

    @property
    def kind(self) -> str:
        return self.url.kind

    def open(self) -> Any:
        """Create the client (connections are made on first use); returns it."""
        u, common = self.url, dict(socket_timeout=self.socket_timeout, socket_connect_timeout=self.connect_timeout)
        pool = max(u.max_connections + 8, 100)  # room for call()'s operations and anything else run beside them
        if u.kind == "single":
            self.client = aioredis.Redis.from_url(u.plain, max_connections=pool, **common)
        elif u.kind == "cluster":
            from redis.asyncio.cluster import ClusterNode, RedisCluster

            self.client = RedisCluster(startup_nodes=[ClusterNode(h, p) for h, p in u.hosts], username=u.username,
                                       password=u.password, ssl=u.ssl, max_connections=2**16, **common)
        else:
            from redis.asyncio.sentinel import Sentinel

            # no retries inside redis-py (its default backs off for seconds per sentinel and per master lookup,
            # 12 s for one `ls` with failover_timeout = 1): call() retries, within failover_timeout
            once = dict(retry=Retry(NoBackoff(), 0))
            sentinel_kwargs = dict(socket_timeout=min(self.socket_timeout, 5.0), socket_connect_timeout=min(
                self.connect_timeout, 5.0), username=u.sentinel_username, password=u.sentinel_password, **once)
            self._sentinel = Sentinel(list(u.hosts), sentinel_kwargs=sentinel_kwargs)
            self.client = self._sentinel.master_for(u.service, db=u.db, username=u.username, password=u.password,
                                                    ssl=u.ssl, max_connections=2**16, **once, **common)
        return self.client

    async def connect(self) -> None:
        """A cluster client learns the slot map now, before concurrent first use: redis-py's lazy initialization
        under many concurrent commands may replace node objects whose connections are in use. Unreachable now:
        left to the first command (which says so)."""
        if self.url.kind == "cluster":
            try:
                await self.client.initialize()
            except ERRORS:
                pass

    async def close(self) -> None:
        if self.client is not None:
            await self.client.aclose()
            if self.url.kind == "sentinel":
                await self.client.connection_pool.disconnect()
        if self._sentinel is not None:
            for s in self._sentinel.sentinels:
                await s.aclose()

    # -- running operations ----------------------------------------------------------------------------------
    async def call(self, fn: Callable[[], Awaitable[T]], on_error: Callable[[BaseException, Problem], BaseException]) -> T:
        """Run fn(); through a failover (a transient problem) run it again, with backoff, for up to
        failover_timeout seconds; then raise on_error(error, problem). Every operation passed here must be
        idempotent (the index's are: markers are set once, epochs only grow)."""
        deadline = time.monotonic() + self.url.failover_timeout
        delay = 0.05
        reconnected = False
        while True:
            try:
                async with self._slots:
                    return await fn()
            except ERRORS as e:
                problem = classify(e, self.url.kind)
                if problem.kind is ProblemKind.TRANSIENT and isinstance(e, rexc.ConnectionError) and not reconnected \
                        and self.url.kind == "single":
                    # a server that restarted closed every pooled connection: once, at once, on new ones
                    reconnected = True
                    await self.client.connection_pool.disconnect(inuse_connections=False)
                    continue
                if problem.kind is not ProblemKind.TRANSIENT or time.monotonic() + delay > deadline:
                    raise on_error(e, problem) from (e if problem.kind in CHAINED else None)
                if isinstance(e, rexc.ReadOnlyError) and self.url.kind == "single":
                    # the old primary, demoted: new connections resolve the endpoint again (a managed service
                    # points its name at the new primary)
                    await self.client.connection_pool.disconnect()
            await asyncio.sleep(delay * (0.5 + _jitter.random()))
            delay = min(delay * 2, 1.0)

    async def write(self, args: Sequence[Any], *, key: str, script: str | None = None) -> Any:
        """One write command (or, with `script`, EVALSHA of it: args are then keys-count, keys, args), then,
        with `wait`, WAIT on the same connection: NotReplicated if too few replicas acknowledged."""
        if script is not None:
            sha = self._shas.get(script)
            if sha is None:
                import hashlib

                sha = self._shas[script] = hashlib.sha1(script.encode()).hexdigest()
            command: tuple[Any, ...] = ("EVALSHA", sha, *args)
        else:
            command = tuple(args)
        try:
            return await self._write_once(command, key)
        except rexc.NoScriptError:
            assert script is not None  # a new master (failover) or a restarted server: EVAL caches it again
            return await self._write_once(("EVAL", script, *args), key)

    async def _write_once(self, command: tuple[Any, ...], key: str) -> Any:
        u = self.url
        if not u.wait:
            return await self.client.execute_command(*command)
        if u.kind == "cluster":
            node = self.client.get_node_from_key(key)
            pipe = self.client.pipeline()
            pipe.execute_command(*command)
            pipe.execute_command("WAIT", u.wait, int(u.wait_timeout * 1000), target_nodes=node)
        else:
            pipe = self.client.pipeline(transaction=False)  # one connection: WAIT counts this write
            pipe.execute_command(*command)
            pipe.execute_command("WAIT", u.wait, int(u.wait_timeout * 1000))
        result, acked = await pipe.execute(raise_on_error=False)
        if isinstance(result, BaseException):
            raise result
        if isinstance(acked, BaseException):
            raise acked
        if u.kind == "cluster" and self.client.get_node_from_key(key) is not node:
            raise rexc.TryAgainError("the slot moved during the write; its WAIT went to the old master")
        if int(acked) < u.wait:
            raise NotReplicated(int(acked), u.wait, u.wait_timeout)
        return result

    async def masters_info(self) -> list[tuple[str, dict[str, Any]]]:
        """INFO of every master: (address, info). One server, the Sentinel's master, or each cluster primary."""
        if self.url.kind == "cluster":
            from redis.asyncio.cluster import RedisCluster

            replies = await self.client.info(target_nodes=RedisCluster.PRIMARIES)
            if isinstance(replies, dict) and replies and all(isinstance(v, dict) for v in replies.values()) \
                    and "redis_version" not in replies:
                return sorted(replies.items())
            return [(self.identity, replies)]
        return [(self.identity, await self.client.info())]

    def check_mode(self, address: str, info: dict[str, Any]) -> None:
        """The URL's form matches the server: a cluster node behind redis://, a sentinel behind redis:// are
        ConfigErrors naming the right form."""
        mode = str(info.get("redis_mode", "standalone"))
        cluster = str(info.get("cluster_enabled", "0")) == "1" or mode == "cluster"
        where = f"{redact(self.identity)} ({address})" if address != self.identity else redact(self.identity)
        if mode == "sentinel":
            raise ConfigError(f"{where} is a Redis Sentinel, not a data server: use redis+sentinel://"
                              f"host:port[,host:port...]/<master-name>/<db>", key=self.key)
        if cluster and self.url.kind != "cluster":
            raise ConfigError(f"{where} is a node of a Redis Cluster: use redis+cluster://host:port[,host:port...]",
                              key=self.key)
        if not cluster and self.url.kind == "cluster":
            raise ConfigError(f"{where} is not a Redis Cluster node (cluster_enabled:0): use redis://host:port/db",
                              key=self.key)
