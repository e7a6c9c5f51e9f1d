"""The Redis index: where checkpoints are and which are complete, shared by every node of a job.

Keys (prefix `tiered_ckpt:idx:<job>:`): `epoch` (the fencing epoch), `steps` (a sorted set of steps), and
one hash per step with fields `created`, `target:<tier>` (its position, fastest first), `manifest`, `rank:<r>` (checksums),
`durable:<tier>:<session>:<rank>`, `count:<tier>:<session>`, `complete:<tier>`, `failed:<tier>:<rank>:<session>`.

Every write is a Lua script that first checks the fencing epoch: `fence()` increments it when a job
(re)starts, so a zombie rank of an earlier incarnation can neither commit nor delete anything. The
commit is one script: add this rank's durable marker, bump the tier's count, and set `complete:<tier>`
when the count reaches the world size, all atomically, with no training-side collective.
"""
from __future__ import annotations

import time
from typing import Any, Sequence

import redis.asyncio as aioredis
from redis import exceptions as rexc

from ..errors import ConfigError, IncompleteCheckpoint, IndexUnavailable, TieredCkptError
from .base import CheckpointStatus, TierState

_CHECK = """
if tonumber(redis.call('GET', KEYS[1]) or '0') ~= tonumber(ARGV[1]) then
  return redis.error_reply('FENCED epoch ' .. ARGV[1] .. ' is stale (current ' .. (redis.call('GET', KEYS[1]) or '0') .. ')')
end
"""
# KEYS: epoch, step hash, steps zset. ARGV: epoch, step, field, value [, field, value ...]
_HSET = _CHECK + """
for i = 3, #ARGV, 2 do redis.call('HSET', KEYS[2], ARGV[i], ARGV[i + 1]) end
redis.call('ZADD', KEYS[3], ARGV[2], ARGV[2])
return 1
"""
# KEYS: epoch, step hash. ARGV: epoch, tier, session, rank, world
_COMMIT = _CHECK + """
local count_field = 'count:' .. ARGV[2] .. ':' .. ARGV[3]
local n
if redis.call('HSETNX', KEYS[2], 'durable:' .. ARGV[2] .. ':' .. ARGV[3] .. ':' .. ARGV[4], '1') == 1 then
  n = redis.call('HINCRBY', KEYS[2], count_field, 1)
else
  n = tonumber(redis.call('HGET', KEYS[2], count_field))
end
if n >= tonumber(ARGV[5]) then
  redis.call('HSET', KEYS[2], 'complete:' .. ARGV[2], '1')
  return 1
end
return 0
"""
# KEYS: epoch, step hash. ARGV: epoch, tier. Drops every record of one tier (before its data is deleted).
_UNMARK = _CHECK + """
for _, f in ipairs(redis.call('HKEYS', KEYS[2])) do
  local kind, rest = string.match(f, '^(%a+):(.*)$')
  if kind and kind ~= 'rank' and (rest == ARGV[2] or string.sub(rest, 1, #ARGV[2] + 1) == ARGV[2] .. ':') then
    redis.call('HDEL', KEYS[2], f)
  end
end
return 1
"""
# KEYS: epoch, step hash, steps zset. ARGV: epoch, step
_DELETE = _CHECK + """
redis.call('DEL', KEYS[2])
redis.call('ZREM', KEYS[3], ARGV[2])
return 1
"""


# KEYS: epoch, tombstones set. ARGV: epoch, step, 1 to add or 0 to remove
_BURY = _CHECK + """
if ARGV[3] == '1' then redis.call('SADD', KEYS[2], ARGV[2]) else redis.call('SREM', KEYS[2], ARGV[2]) end
return 1
"""


class RedisIndex:
    def __init__(self, url: str):
        self.url = url
        self.epoch = 0
        self.identity = _identity(url)  # written into each manifest
        self._client: aioredis.Redis | None = None
        self._scripts: dict[str, Any] = {}

    async def open(self) -> None:
        self._client = aioredis.Redis.from_url(self.url, socket_timeout=30, socket_connect_timeout=10)
        for name, source in (("hset", _HSET), ("commit", _COMMIT), ("unmark", _UNMARK), ("delete", _DELETE),
                             ("bury", _BURY)):
            self._scripts[name] = self._client.register_script(source)
        await self._refuse_an_evicting_server()

    async def _refuse_an_evicting_server(self) -> None:
        """The index's keys (epoch, steps, records) carry no TTL: a policy that may evict any key would drop
        them under memory pressure (the fencing epoch too, fencing the writer out). Refused at open."""
        assert self._client is not None
        try:
            info = await self._client.info("memory")
        except rexc.RedisError:
            return  # unreachable now: saves will say so; loads fall back to the tiers
        policy = str(info.get("maxmemory_policy", "noeviction"))
        if policy.startswith("allkeys-"):
            raise ConfigError(f"index {self.identity}: maxmemory-policy is {policy}, which may evict the index's "
                              f"records; use a Redis with noeviction (or a volatile-* policy) for the index, "
                              f"and a separate one for the peer-cache tier", key="engine.index")

    async def close(self) -> None:
        if self._client is not None:
            await self._client.aclose()

    def _k(self, job: str, *parts: Any) -> str:
        return ":".join(("tiered_ckpt:idx", job, *map(str, parts)))

    async def _call(self, what: str, coro: Any) -> Any:
        try:
            return await coro
        except (rexc.AuthenticationError, rexc.AuthorizationError) as e:  # not retryable: not "unreachable"
            raise TieredCkptError(f"index {self.identity}: {what}: the server refused the credentials "
                                  f"({type(e).__name__}: {e})") from None
        except rexc.ResponseError as e:
            if "FENCED" in str(e):
                raise TieredCkptError(f"index {self.identity}: {what} refused: this process belongs to an earlier "
                                      f"incarnation of the job ({e}); it must not commit or delete") from None
            raise TieredCkptError(f"index {self.identity}: {what}: {e}") from e
        except (rexc.ConnectionError, rexc.TimeoutError, OSError) as e:
            raise IndexUnavailable(f"index {self.identity} unreachable during {what}: {e}") from e
        except rexc.RedisError as e:  # e.g. a server that does not speak Redis at that address
            raise TieredCkptError(f"index {self.identity}: {what}: {type(e).__name__}: {e} (is this a Redis "
                                  f"server?)") from None

    async def fence(self, job: str) -> int:
        """Start a new incarnation of `job`: writers holding an older epoch are refused from now on."""
        assert self._client is not None
        self.epoch = int(await self._call("fence", self._client.incr(self._k(job, "epoch"))))
        return self.epoch

    async def _hset(self, job: str, step: int, *pairs: Any) -> None:
        await self._call(f"write of step {step}", self._scripts["hset"](
            keys=[self._k(job, "epoch"), self._k(job, "step", step), self._k(job, "steps")],
            args=[self.epoch, step, *pairs]))

    async def begin(self, job: str, step: int, tiers: Sequence[str]) -> None:
        pairs: list[Any] = ["created", repr(time.time())]
        for position, tier in enumerate(tiers):  # fastest first: keep the order, hash fields have none
            pairs += [f"target:{tier}", str(position)]
        await self._hset(job, step, *pairs)

    async def put_manifest(self, job: str, step: int, data: bytes) -> None:
        await self._hset(job, step, "manifest", data)

    async def put_rank_meta(self, job: str, step: int, rank: int, data: bytes) -> None:
        await self._hset(job, step, f"rank:{rank}", data)

    async def _get(self, job: str, step: int, field: str, what: str) -> bytes:
        assert self._client is not None
        value = await self._call(f"read of step {step}", self._client.hget(self._k(job, "step", step), field))
        if value is None:
            raise IncompleteCheckpoint(f"job {job!r} step {step}: no {what} in the index at {self.identity}")
        return value

    async def get_manifest(self, job: str, step: int) -> bytes:
        return await self._get(job, step, "manifest", "manifest")

    async def get_rank_meta(self, job: str, step: int, rank: int) -> bytes:
        return await self._get(job, step, f"rank:{rank}", f"checksums of rank {rank}")

    async def mark_durable(self, job: str, step: int, tier: str, rank: int, world_size: int, session: str) -> bool:
        done = await self._call(f"commit of step {step} on {tier}", self._scripts["commit"](
            keys=[self._k(job, "epoch"), self._k(job, "step", step)],
            args=[self.epoch, tier, session, rank, world_size]))
        return bool(done)

    async def mark_failed(self, job: str, step: int, tier: str, rank: int, session: str, reason: str) -> None:
        await self._hset(job, step, f"failed:{tier}:{rank}:{session}", reason)

    async def tier_state(self, job: str, step: int, tier: str, session: str) -> TierState:
        fields = await self._small_fields(job, [step])
        return _tier_state(fields[0], tier, session)

    async def _small_fields(self, job: str, steps: list[int]) -> list[dict[str, bytes]]:
        """The bookkeeping fields of each step's hash, without the manifest and checksum records: this
        is polled by every rank while it waits for a commit, and read on every save by retention."""
        assert self._client is not None
        keys = [self._k(job, "step", step) for step in steps]
        pipe = self._client.pipeline(transaction=False)
        for key in keys:
            pipe.hkeys(key)
        replies = await self._call("read of the index", pipe.execute())
        names = [[n.decode() for n in step_names] for step_names in replies]
        pipe = self._client.pipeline(transaction=False)
        wanted = [[n for n in step_names if n != "manifest" and not n.startswith("rank:")] for step_names in names]
        for key, fields in zip(keys, wanted):
            pipe.hmget(key, fields) if fields else pipe.ping()
        values = await self._call("read of the index", pipe.execute())
        return [dict(zip(fields, vals)) if fields else {} for fields, vals in zip(wanted, values)]

    async def unmark(self, job: str, step: int, tier: str) -> None:
        await self._call(f"retention of step {step} on {tier}", self._scripts["unmark"](
            keys=[self._k(job, "epoch"), self._k(job, "step", step)], args=[self.epoch, tier]))

    async def list(self, job: str) -> list[CheckpointStatus]:
        assert self._client is not None
        steps = [int(s) for s in await self._call("listing", self._client.zrange(self._k(job, "steps"), 0, -1))]
        out = []
        for step, fields in zip(steps, await self._small_fields(job, steps) if steps else []):
            targets = [(int(v), f.split(":", 1)[1]) for f, v in fields.items() if f.startswith("target:")]
            tiers = tuple(name for _, name in sorted(targets))
            complete = frozenset(f.split(":", 1)[1] for f in fields if f.startswith("complete:"))
            failed: dict[str, str] = {}
            for f, value in fields.items():
                if f.startswith("failed:"):
                    _, tier, rank, _ = f.rsplit(":", 3) if f.count(":") >= 3 else (f, "", "", "")
                    if tier not in complete:
                        failed.setdefault(tier, f"rank {rank}: {value.decode(errors='replace')}")
            if tiers or failed:
                created = float(fields.get("created", b"0").decode() or 0)
                out.append(CheckpointStatus(step, tiers or tuple(failed), complete, failed, created))
        return out

    async def bury(self, job: str, step: int) -> None:
        await self._call(f"tombstone of step {step}", self._scripts["bury"](
            keys=[self._k(job, "epoch"), self._k(job, "tombstones")], args=[self.epoch, step, 1]))

    async def buried(self, job: str) -> set[int]:
        assert self._client is not None
        return {int(s) for s in await self._call("reading tombstones", self._client.smembers(self._k(job, "tombstones")))}

    async def unbury(self, job: str, step: int) -> None:
        await self._call(f"tombstone of step {step}", self._scripts["bury"](
            keys=[self._k(job, "epoch"), self._k(job, "tombstones")], args=[self.epoch, step, 0]))

    async def delete(self, job: str, step: int) -> None:
        await self._call(f"deletion of step {step}", self._scripts["delete"](
            keys=[self._k(job, "epoch"), self._k(job, "step", step), self._k(job, "steps")], args=[self.epoch, step]))


def _tier_state(fields: dict[str, bytes], tier: str, session: str) -> TierState:
    done = frozenset(int(f.rsplit(":", 1)[1]) for f in fields if f.startswith(f"durable:{tier}:{session}:"))
    if f"complete:{tier}" in fields:
        return TierState("complete", "", done)
    for f, value in sorted(fields.items()):
        if f.startswith(f"failed:{tier}:") and f.endswith(f":{session}"):
            return TierState("failed", f"rank {f.split(':')[-2]}: {value.decode(errors='replace')}", done)
    return TierState("pending", "", done)


def _identity(url: str) -> str:
    """The URL without credentials or options: which server and database, never a secret."""
    from urllib.parse import urlsplit

    parts = urlsplit(url)
    if parts.scheme == "unix":
        return f"unix://{parts.path}"
    return f"{parts.scheme}://{parts.hostname}:{parts.port or 6379}{parts.path or '/0'}"
