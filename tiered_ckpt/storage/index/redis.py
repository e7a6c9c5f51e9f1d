"""The Redis index: where checkpoints are and which are complete, shared by every node of a job.

Keys (prefix `tiered_ckpt:idx:<job>:`; on a Redis Cluster `tiered_ckpt:idx:{<job>}:`, so that every key of a
job is in one hash slot): `epoch` (the fencing epoch), `steps` (a sorted set of steps), `tombstones`, one hash
per step with fields `created`, `target:<tier>` (its position, fastest first), `info` (msgpack {nbytes,
metadata}, rank 0), `manifest`, `rank:<r>` (checksums), `done:<tier>:<session>` (a bitmap of the ranks that
marked the tier, bit r of byte r // 8, most significant first), `count:<tier>:<session>`, `complete:<tier>`,
`failed:<tier>:<rank>:<session>` and `fail:<tier>:<session>` (the first failure), `abandoned:<tier>:<session>`
(the node agent ended that session's commit of the tier: no later marker counts, abandon.lua),
`skipped:<tier>:<rank>:<session>` and `skip:<tier>:<session>` (a newer save superseded this one there: the newer
step), `writer` (the writer lease of
a `role = "writer"` engine: a hash of token, holder and renewals, with a TTL its holder renews), and `list`: one hash for
the job mapping each step to a summary of what `list()` reports (msgpack {c: created, t: {tier: position},
i: info, k: {tier: 1} complete, f: {tier: "rank r: reason"}, s: {tier: newer step}}, sealed with its SHA-1), kept by the same scripts, so listing reads two
keys whatever the number of checkpoints and ranks. `notes`: a hash of a writer's notes (`put_note`: retention's
place per tier), written by a fenced script like every record. Releases before 0.2 wrote one `durable:<tier>:<session>:
<rank>` field per rank and no summary: their steps are still listed, from the step hash.

Every write is a Lua script that first checks the fencing epoch: `fence()` increments it when a job
(re)starts, so a zombie rank of an earlier incarnation can neither commit nor delete anything. An epoch the
index lost (older than the writer's, or gone) is set back to the writer's: a Redis restarted empty or
restored from an older snapshot never wedges the live trainer. The
commit is one script: add this rank's durable marker, bump the tier's count, and set `complete:<tier>`
when the count reaches the world size, all atomically, with no training-side collective. A cleaner (`gc`,
`delete` from the CLI) `attach`es instead of fencing: it writes with the current epoch, so a running
trainer is not fenced out, and a trainer that starts meanwhile fences the cleaner.

Fencing lets any new incarnation take over, which is how a restarted job shuts out a zombie. A trainer that
opens with `role = "writer"` wants more: to be refused beside a live writer, as the file index's lock refuses
it. So it also takes the job's writer lease, in the same script as its fence, and renews it every third of its
TTL until close() releases it: a second `role = "writer"` open fails while the holder renews, and a holder
killed with -9 stops renewing, so its restart waits at most the TTL. An `"auto"` engine neither takes nor
checks the lease: its first save fences as before (the way to take over from a writer that must go), and the
fenced holder's next renewal gives the lease up.
"""
from __future__ import annotations

import asyncio
import hashlib
import logging
import os
import socket
import time
import uuid
from importlib import resources
from typing import Any, Mapping, Sequence

import msgpack
from redis import exceptions as rexc

from ...errors import (AuthenticationError, ConfigError, Fenced, IncompleteCheckpoint, IndexUnavailable,
                       RankFailed, TieredCkptError, WriterConflict)
from ...gc_pause import automatic_gc_paused
from .base import CheckpointStatus, CommitState, TierState

log = logging.getLogger(__name__)
from ..redis_connect import CHAINED, ERRORS, Problem, ProblemKind, RedisDeployment
from ..redis_connect import classify as _problem


def _lua(name: str) -> str:
    return (resources.files(__package__) / "lua" / f"{name}.lua").read_text(encoding="utf-8")


# The Lua scripts (lua/*.lua, shipped as package data), read once at import: every write script begins with
# check.lua (the fencing epoch), those that change a step's summary with summary.lua too.
_CHECK, _SUMMARY = _lua("check"), _lua("summary")
_SCRIPTS = {"hset": _CHECK + _SUMMARY + _lua("hset"), "commit": _CHECK + _SUMMARY + _lua("commit"),
            "unmark": _CHECK + _SUMMARY + _lua("unmark"), "abandon": _CHECK + _SUMMARY + _lua("abandon"),
            "delete": _CHECK + _lua("delete"),
            "bury": _CHECK + _lua("bury"), "note": _CHECK + _lua("note"), "fence": _lua("fence"),
            "lease": _lua("lease") + _lua("fence"),
            "renew": _lua("renew"), "release": _lua("release")}
RECORDS_PER_HMGET = 1024  # checksum records per HMGET when a load reads every rank's (get_rank_metas)
IN_THREAD = 64  # a listing decodes more summaries than this in a thread (off the event loop)
LEASE_SECONDS = 10.0  # a `role = "writer"` engine's lease lives this long unless renewed (every third of it)


class RedisIndex:
    """The index on one Redis server (redis://), a Redis Cluster (redis+cluster://: a job's keys share one hash
    slot, `{job}`, so each commit stays one atomic script) or the master a Sentinel names (redis+sentinel://).
    Writes are followed by WAIT when the URL asks for replicas (`wait`, default 1 with Sentinel), and every
    operation is retried through a failover for up to `failover_timeout` (redis_connect.py has the URL forms)."""

    def __init__(self, url: str, *, timeout: float = 10.0, lease_seconds: float = LEASE_SECONDS):
        self.url = url
        self.epoch = 0
        self.timeout = timeout  # [engine] index_timeout: one call unanswered this long fails, naming the index
        self.lease_seconds = lease_seconds  # the writer lease's TTL (fence(lease=True)); renewed every third
        self._token = uuid.uuid4().hex  # this index's writer-lease token
        self._holder = ""  # who holds the lease, as a second writer is told (pid, host, since when)
        self._leases: dict[str, asyncio.Task[None]] = {}  # job → the task renewing its writer lease
        self._redis = RedisDeployment(url, key="engine.index", socket_timeout=timeout,
                                      connect_timeout=min(timeout, 10.0))
        self.identity = self._redis.identity  # written into each manifest (unchanged for redis:// URLs)
        self._tag = self._redis.kind == "cluster"  # cluster: every key of a job in one hash slot
        self._client: Any = None

    async def open(self) -> None:
        self._client = self._redis.open()
        await self._redis.connect()
        await self._check_server()

    async def _check_server(self) -> None:
        """At open: the URL's form matches the server (a cluster node behind redis:// is named as such), and no
        master may evict the index. The index's keys (epoch, steps, records) carry no TTL: a policy that may
        evict any key would drop them under memory pressure (the fencing epoch too, fencing the writer out)."""
        try:
            masters = await self._redis.call(self._redis.masters_info, lambda e, p: e)
        except Exception as e:
            problem = _problem(e, self._redis.kind)
            if problem.kind is ProblemKind.TRANSIENT:
                return  # unreachable now: saves will say so; loads fall back to the tiers
            raise self._error("opening the index", e, problem) from None
        for address, info in masters:
            self._redis.check_mode(address, info)
            policy = str(info.get("maxmemory_policy", "noeviction"))
            if policy.startswith("allkeys-"):
                where = "" if address == self.identity else f" (master {address})"
                raise ConfigError(f"index {self.identity}{where}: maxmemory-policy is {policy}, which may evict the "
                                  f"index's records; use a Redis with noeviction (or a volatile-* policy) for the "
                                  f"index, and a separate one for the peer-cache tier", key="engine.index")

    async def close(self) -> None:
        """Release the writer leases this index holds (best effort: an unreachable server lets them expire),
        then the connections."""
        for job, renewing in list(self._leases.items()):
            renewing.cancel()
            await asyncio.gather(renewing, return_exceptions=True)
            try:  # once, not through a failover: closing must not wait for one
                await self._call("releasing the writer lease", self._redis.write(
                    [1, self._k(job, "writer"), self._token], key=self._k(job, "writer"), script=_SCRIPTS["release"]))
            except TieredCkptError as e:
                log.warning("%s; the writer lease of job %r expires within %gs", e, job, self.lease_seconds)
        self._leases.clear()
        if self._client is not None:
            await self._redis.close()

    def _k(self, job: str, *parts: Any) -> str:
        """Key names: `tiered_ckpt:idx:<job>:...` on one server (as in earlier releases); `tiered_ckpt:idx:{<job>}:...`
        on a cluster, where the hash tag keeps every key of a job in one slot (so one script sees them all)."""
        return ":".join(("tiered_ckpt:idx", "{" + job + "}" if self._tag else job, *map(str, parts)))

    def _error(self, what: str, e: BaseException, problem: Problem) -> BaseException:
        where = f"index {self.identity}"
        if problem.kind is ProblemKind.AUTH:  # not retryable: not "unreachable"
            return AuthenticationError(f"{where}: {what}: {problem.text}")
        if problem.kind is ProblemKind.FENCED:
            return Fenced(f"{where}: {what} refused: this process belongs to an earlier incarnation of the "
                                   f"job ({problem.text}); it must not commit or delete")
        if problem.kind is ProblemKind.CONFIG:
            return ConfigError(f"{where}: {what}: {problem.text}", key="engine.index")
        if problem.kind is ProblemKind.TRANSIENT:
            after = (f" (retried for {self._redis.url.failover_timeout:g}s)" if self._redis.url.failover_timeout
                     else "")
            if isinstance(e, (TimeoutError, rexc.TimeoutError)):
                after += f" (no answer within [engine] index_timeout = {self.timeout:g}s)"
            return IndexUnavailable(f"{where} unreachable during {what}{after}: {problem.text}")
        return TieredCkptError(f"{where}: {what}: {problem.text}")

    async def _call(self, what: str, op: Any) -> Any:
        """Run one operation: `op` is a function returning an awaitable (retried through a failover, so it must
        be idempotent) or an awaitable (run once)."""
        on_error = lambda e, problem: self._error(what, e, problem)  # noqa: E731
        if callable(op):
            return await self._redis.call(op, on_error)
        try:
            return await op
        except ERRORS as e:
            problem = _problem(e, self._redis.kind)
            raise on_error(e, problem) from (e if problem.kind in CHAINED else None)

    async def _script(self, what: str, name: str, keys: list[str], args: list[Any]) -> Any:
        return await self._call(what, lambda: self._redis.write([len(keys), *keys, *args], key=keys[0],
                                                                script=_SCRIPTS[name]))

    async def fence(self, job: str, *, lease: bool = False) -> int:
        """Start a new incarnation of `job`: writers holding an older epoch are refused from now on. With `lease`
        (`role = "writer"`), first take the job's writer lease, in the same atomic step: a lease another live
        writer holds is a WriterConflict naming it (_take_lease); the lease is renewed until close()."""
        if not lease or job in self._leases:
            self.epoch = int(await self._script("fence", "fence", [self._k(job, "epoch")], []))
            return self.epoch
        self.epoch = await self._take_lease(job)
        self._leases[job] = asyncio.create_task(self._renew(job), name=f"tiered_ckpt-lease-{job}")
        return self.epoch

    async def _take_lease(self, job: str) -> int:
        """The new epoch, with the writer lease taken. A lease held by another writer is waited for while it may
        be a dead one's: until it expires (a process killed with -9 renews it no more, so a restart waits at most
        its TTL), unless its holder renews it meanwhile, which only a live writer does: WriterConflict then."""
        keys = [self._k(job, "epoch"), self._k(job, "writer")]
        self._holder = _holder()
        args = [self._token, self._holder, int(self.lease_seconds * 1000)]
        seen: bytes | None = None
        deadline = 0.0
        while True:
            reply = await self._script("taking the writer lease", "lease", keys, args)
            if not isinstance(reply, list):
                return int(reply)
            holder, renewals, ttl_ms = reply[0], reply[1], int(reply[2])
            if seen is None:
                seen = renewals
                deadline = time.monotonic() + (ttl_ms if ttl_ms > 0 else self.lease_seconds * 1000) / 1000 + 0.5
            elif renewals != seen or time.monotonic() > deadline:
                who = holder.decode(errors="replace") if isinstance(holder, bytes) else str(holder)
                raise WriterConflict(f"job {job!r} already has a writer on index {self.identity}: {who} (its lease "
                                     f"is renewed: it is alive); run one writer per job (readers may list and load "
                                     f"at any time; an engine with role \"auto\" takes over at its first save, "
                                     f"fencing it)")
            await asyncio.sleep(min(0.2, self.lease_seconds / 10))

    async def _renew(self, job: str) -> None:
        """Renew the writer lease every third of its TTL, until close(); stop when a newer incarnation fenced
        this writer (the script releases the lease then). A failed renewal is logged and tried again."""
        keys = [self._k(job, "epoch"), self._k(job, "writer")]
        warned = False
        while True:
            await asyncio.sleep(self.lease_seconds / 3)
            args = [self._token, int(self.lease_seconds * 1000), self.epoch, self._holder]
            try:
                reply = await self._script("renewing the writer lease", "renew", keys, args)
            except TieredCkptError as e:
                if not warned:
                    log.warning("%s; tried again in %gs (the lease lapses after %gs without one)", e,
                                self.lease_seconds / 3, self.lease_seconds)
                warned = True
                continue
            warned = False
            status = reply[0].decode() if isinstance(reply[0], bytes) else str(reply[0])
            if status == "fenced":
                log.info("job %r: a newer incarnation fenced this writer; its writer lease is released", job)
                return
            if status == "lost":
                who = reply[1].decode(errors="replace") if isinstance(reply[1], bytes) else str(reply[1])
                log.warning("job %r: the writer lease lapsed and %s took it; this process will be fenced", job, who)
                return
            if status == "retaken":
                log.warning("job %r: the writer lease had lapsed (a renewal late by more than %gs, or the index "
                            "lost it); this writer holds it again", job, self.lease_seconds)

    async def attach(self, job: str, *, hold: bool = True) -> bool:
        """Join the job's current incarnation without fencing it. Redis cannot tell whether a writer is
        running, so this returns False: the caller must assume one is."""
        assert self._client is not None
        self.epoch = int(await self._call("reading the epoch", lambda: self._client.get(self._k(job, "epoch"))) or 0)
        return False

    async def detach(self, job: str) -> None:
        """Nothing to release: attach() holds nothing."""

    async def _hset(self, job: str, step: int, *pairs: Any) -> None:
        await self._script(f"write of step {step}", "hset", [self._k(job, "epoch"), self._k(job, "step", step),
                                                             self._k(job, "steps"), self._k(job, "list")],
                           [self.epoch, step, *pairs])

    async def begin(self, job: str, step: int, tiers: Sequence[str], info: Mapping[str, Any] | None = None) -> None:
        pairs: list[Any] = ["created", ""]  # stamped with the server's clock by the script
        for position, tier in enumerate(tiers):  # fastest first: keep the order, hash fields have none
            pairs += [f"target:{tier}", str(position)]
        if info is not None:
            pairs += ["info", msgpack.packb(dict(info))]
        await self._hset(job, step, *pairs)

    async def put_manifest(self, job: str, step: int, data: bytes) -> None:
        await self._hset(job, step, "manifest", data)

    async def put_rank_meta(self, job: str, step: int, rank: int, data: bytes) -> None:
        await self._hset(job, step, f"rank:{rank}", data)

    async def _get(self, job: str, step: int, field: str, what: str) -> bytes:
        assert self._client is not None
        value = await self._call(f"read of step {step}", lambda: self._client.hget(self._k(job, "step", step), field))
        if value is None:
            raise IncompleteCheckpoint(f"job {job!r} step {step}: no {what} in the index at {self.identity}")
        return value

    async def get_manifest(self, job: str, step: int) -> bytes:
        return await self._get(job, step, "manifest", "manifest")

    async def get_rank_meta(self, job: str, step: int, rank: int) -> bytes:
        return await self._get(job, step, f"rank:{rank}", f"checksums of rank {rank}")

    async def get_rank_metas(self, job: str, step: int, ranks: Sequence[int]) -> dict[int, bytes]:
        """One round trip whatever the number of ranks: one pipeline of HMGETs of the step's hash, each of at
        most RECORDS_PER_HMGET fields (the server serves other clients between them)."""
        assert self._client is not None
        key, wanted = self._k(job, "step", step), list(ranks)
        batches = [wanted[i:i + RECORDS_PER_HMGET] for i in range(0, len(wanted), RECORDS_PER_HMGET)]

        async def read() -> Any:
            pipe = self._client.pipeline(transaction=False)
            for batch in batches:
                pipe.hmget(key, [f"rank:{r}" for r in batch])
            return await pipe.execute()

        replies = await self._call(f"read of step {step}", read) if batches else []
        values = [v for reply in replies for v in reply]
        return {r: v for r, v in zip(wanted, values, strict=True) if v is not None}

    async def mark_durable(self, job: str, step: int, tier: str, rank: int, world_size: int, session: str) -> bool:
        done = await self._script(f"commit of step {step} on {tier}", "commit",
                                  [self._k(job, "epoch"), self._k(job, "step", step), self._k(job, "list")],
                                  [self.epoch, tier, session, rank, world_size, step])
        if isinstance(done, (bytes, str)):  # the session's commit of the tier was abandoned (abandon.lua)
            raise RankFailed(f"step {step}: this session's commit was abandoned before rank {rank}'s marker "
                             f"landed: {done.decode(errors='replace') if isinstance(done, bytes) else done}", tier=tier)
        return bool(done)

    async def abandon(self, job: str, step: int, tier: str, session: str, rank: int, reason: str) -> bool:
        """Base.Index.abandon: one script, atomic with every rank's marker (commit.lua)."""
        done = await self._script(f"abandonment of step {step} on {tier}", "abandon",
                                  [self._k(job, "epoch"), self._k(job, "step", step), self._k(job, "list")],
                                  [self.epoch, tier, session, rank, step, reason])
        return bool(done)

    async def mark_failed(self, job: str, step: int, tier: str, rank: int, session: str, reason: str) -> None:
        await self._hset(job, step, f"failed:{tier}:{rank}:{session}", reason)

    async def mark_skipped(self, job: str, step: int, tier: str, rank: int, session: str, newer: int) -> None:
        await self._hset(job, step, f"skipped:{tier}:{rank}:{session}", str(newer))

    async def tier_state(self, job: str, step: int, tier: str, session: str, *, rank: int | None = None) -> TierState:
        """Five fields, whatever the number of ranks: every rank polls this while it waits for a commit. The
        ranks done come as one bitmap (R/8 bytes), so `rank` changes nothing here."""
        assert self._client is not None
        key = self._k(job, "step", step)
        complete, bits, failure, skip, created = await self._call("read of the index", lambda: self._client.hmget(
            key, [f"complete:{tier}", f"done:{tier}:{session}", f"fail:{tier}:{session}", f"skip:{tier}:{session}",
                  "created"]))
        done = _ranks(bits or b"")
        if created is None and complete is None:  # begin's record is gone: the server restarted empty (or FLUSHDB)
            return TierState(CommitState.PENDING, "", done, forgotten=True)
        if complete is not None:
            return TierState(CommitState.COMPLETE, "", done)
        if skip is not None and skip.isdigit():
            return TierState(CommitState.SKIPPED, "", done, int(skip))
        if failure is not None:
            return TierState(CommitState.FAILED, failure.decode(errors="replace"), done)
        return TierState(CommitState.PENDING, "", done)

    async def _small_fields(self, job: str, steps: list[int], *, info: bool = True) -> list[dict[str, bytes]]:
        """The bookkeeping fields of each step's hash, without the manifest and checksum records: this
        is polled by every rank while it waits for a commit (without `info`, whose metadata may be larger),
        and read on every save by retention."""
        assert self._client is not None
        keys = [self._k(job, "step", step) for step in steps]

        async def names() -> Any:
            pipe = self._client.pipeline(transaction=False)
            for key in keys:
                pipe.hkeys(key)
            return await pipe.execute()

        replies = await self._call("read of the index", names)
        skip = {"manifest"} if info else {"manifest", "info"}
        wanted = [[n for n in (m.decode() for m in step_names) if n not in skip and not n.startswith("rank:")]
                  for step_names in replies]

        async def values() -> Any:
            pipe = self._client.pipeline(transaction=False)
            for key, fields in zip(keys, wanted, strict=True):
                pipe.hmget(key, fields) if fields else pipe.ping()
            return await pipe.execute()

        got = await self._call("read of the index", values)
        return [dict(zip(fields, vals, strict=True)) if fields else {} for fields, vals in zip(wanted, got, strict=True)]

    async def unmark(self, job: str, step: int, tier: str) -> None:
        await self._script(f"retention of step {step} on {tier}", "unmark",
                           [self._k(job, "epoch"), self._k(job, "step", step), self._k(job, "list")],
                           [self.epoch, tier, step])

    async def list(self, job: str) -> list[CheckpointStatus]:
        """Two keys in one round trip: the steps and the job's summaries (steps an earlier release wrote, which
        have none, from their hashes)."""
        assert self._client is not None
        steps_key, list_key = self._k(job, "steps"), self._k(job, "list")

        async def read() -> Any:
            pipe = self._client.pipeline(transaction=False)
            pipe.zrange(steps_key, 0, -1)
            pipe.hgetall(list_key)
            return await pipe.execute()

        names, summaries = await self._call("listing", read)
        return await self._statuses_of(job, names, summaries)

    async def steps(self, job: str) -> list[int]:
        """The job's sorted set of steps, one round trip; no summary is read (many are parsed in a thread)."""
        assert self._client is not None
        steps_key = self._k(job, "steps")
        names = await self._call("listing", lambda: self._client.zrange(steps_key, 0, -1))
        if len(names) > IN_THREAD:
            return await asyncio.to_thread(lambda: [int(n) for n in names])
        return [int(n) for n in names]

    async def list_range(self, job: str, first: int = 0, *, newest: int | None = None, oldest: int | None = None,
                         also: Sequence[int] = ()) -> list[CheckpointStatus]:
        """The checkpoints of step >= `first` (with `newest`, only that many of the newest of them; with `oldest`,
        that many of the oldest), and those of `also` that exist, oldest first: two round trips (the steps from the sorted set by score, then their
        summaries), whatever the number of checkpoints the job keeps."""
        assert self._client is not None
        steps_key, list_key = self._k(job, "steps"), self._k(job, "list")

        wanted = sorted({int(s) for s in also})

        async def steps() -> Any:
            pipe = self._client.pipeline(transaction=False)
            if newest is None and oldest is None:
                pipe.zrangebyscore(steps_key, first, "+inf")
            elif newest is None:
                pipe.zrangebyscore(steps_key, first, "+inf", start=0, num=max(oldest or 0, 0))
            else:
                pipe.zrevrangebyscore(steps_key, "+inf", first, start=0, num=max(newest, 0))
            for step in wanted:
                pipe.zscore(steps_key, step)
            return await pipe.execute()

        found, *scores = await self._call("listing", steps)
        if newest is not None and oldest is not None:  # both: the oldest of the newest
            found = sorted(found, key=int)[:max(oldest, 0)]
        names = sorted({*(found if (newest is None or newest > 0) and (oldest is None or oldest > 0) else []),
                        *(str(st).encode() for st, score in zip(wanted, scores, strict=True) if score is not None)},
                       key=int)
        if not names:
            return []
        values = await self._call("listing", lambda: self._client.hmget(list_key, names))
        summaries = {n: v for n, v in zip(names, values, strict=True) if v is not None}
        return await self._statuses_of(job, names, summaries)

    async def _statuses_of(self, job: str, names: Sequence[bytes], summaries: Mapping[bytes, bytes],
                           ) -> list[CheckpointStatus]:
        """Statuses of the steps `names`, in their order, from their summaries (from the step hashes where a
        summary is missing, an earlier release's, or damaged). Many are decoded in a thread: ten thousand take a
        tenth of a second, too long for the event loop."""
        if len(names) > IN_THREAD:
            decoded = await asyncio.to_thread(_from_summaries, summaries)
        else:
            decoded = _from_summaries(summaries)
        damaged = [st for st, status in decoded.items() if status is _DAMAGED]
        if damaged:
            log.warning("index %s: the list summary of step(s) %s of job %r is damaged; listed from their records",
                        self.identity, damaged[:10], job)
        older = [int(n) for n in names if n not in summaries or decoded[int(n)] is _DAMAGED]
        statuses = dict(zip(older, self._statuses(older, await self._small_fields(job, older)), strict=True)) \
            if older else {}

        def assemble() -> list[CheckpointStatus]:
            out = []
            with automatic_gc_paused():  # ten thousand statuses allocate enough to set off full collections (2-3x)
                for name in names:
                    status = decoded.get(int(name))
                    if status is None or status is _DAMAGED:
                        status = statuses.get(int(name))
                    if status is not None:
                        out.append(status)
            return out
        return await asyncio.to_thread(assemble) if len(names) > IN_THREAD else assemble()

    @staticmethod
    def _statuses(steps: list[int], step_fields: list[dict[str, bytes]]) -> list[CheckpointStatus | None]:
        """Statuses from steps' hashes (steps without a summary: written by an earlier release)."""
        out: list[CheckpointStatus | None] = []
        for step, fields in zip(steps, step_fields, strict=True):
            try:
                out.append(RedisIndex._status_from_fields(step, fields))
            except (ValueError, TypeError, IndexError, UnicodeDecodeError) as e:
                log.warning("index: the record of step %d cannot be read (%s); listed as incomplete", step, e)
                out.append(CheckpointStatus(step, (), failed={"index": f"the index record cannot be read: {e}"}))
        return out

    @staticmethod
    def _status_from_fields(step: int, fields: dict[str, bytes]) -> CheckpointStatus | None:
        """A step's status from its hash's fields (a step with no summary, or a damaged one)."""
        targets = [(int(v), f.split(":", 1)[1]) for f, v in fields.items() if f.startswith("target:")]
        tiers = tuple(name for _, name in sorted(targets))
        complete = frozenset(f.split(":", 1)[1] for f in fields if f.startswith("complete:"))
        failed: dict[str, str] = {}
        skipped: dict[str, int] = {}
        for f, value in fields.items():
            if f.count(":") >= 3 and f.startswith(("failed:", "skipped:")):
                kind, tier, rank, _ = f.split(":", 3)
                if tier in complete:
                    continue
                if kind == "failed":
                    failed.setdefault(tier, f"rank {rank}: {value.decode(errors='replace')}")
                elif value.isdigit():
                    skipped.setdefault(tier, int(value))
        if not tiers and not failed:
            return None
        created = float(fields.get("created", b"0").decode() or 0)
        info = _info(fields.get("info"))
        return CheckpointStatus(step, tiers or tuple(failed), complete, failed, created, nbytes=info.get("nbytes"),
                                metadata=info.get("metadata") or {}, skipped=skipped, folder=_folder(info))

    async def jobs(self) -> list[str]:
        """The jobs with a checkpoint here (a job's sorted set of steps exists while it has one), sorted."""
        assert self._client is not None
        prefix, suffix = "tiered_ckpt:idx:", ":steps"

        async def scan() -> list[str]:
            return [k.decode() if isinstance(k, bytes) else k
                    async for k in self._client.scan_iter(match=f"{prefix}*{suffix}", count=1000)]

        keys = await self._call("listing jobs", scan)
        return sorted({k[len(prefix):-len(suffix)].strip("{}") for k in keys})

    async def bury(self, job: str, step: int) -> None:
        await self._script(f"tombstone of step {step}", "bury", [self._k(job, "epoch"), self._k(job, "tombstones")],
                           [self.epoch, step, 1])

    async def now(self) -> float:
        """The Redis server's clock: trainers and cleaners on machines whose clocks disagree still agree on it."""
        assert self._client is not None
        seconds, micros = await self._call("reading the server's time", lambda: self._client.time())
        return seconds + micros / 1e6

    async def began_under_writer(self, job: str, steps: Sequence[int]) -> set[int]:
        """None to tell apart: the server's TIME stamps each save's start and is the clock gc reads (now()), so
        the grace judges a save's age whatever the machines' clocks."""
        return set()

    async def buried(self, job: str) -> set[int]:
        assert self._client is not None
        return {int(s) for s in await self._call("reading tombstones",
                                                 lambda: self._client.smembers(self._k(job, "tombstones")))}

    async def unbury(self, job: str, step: int) -> None:
        await self._script(f"tombstone of step {step}", "bury", [self._k(job, "epoch"), self._k(job, "tombstones")],
                           [self.epoch, step, 0])

    async def get_note(self, job: str, name: str) -> bytes | None:
        assert self._client is not None
        return await self._call(f"reading note {name}", lambda: self._client.hget(self._k(job, "notes"), name))

    async def put_note(self, job: str, name: str, data: bytes) -> None:
        await self._script(f"note {name}", "note", [self._k(job, "epoch"), self._k(job, "notes")],
                           [self.epoch, name, data])

    async def delete(self, job: str, step: int) -> None:
        await self._script(f"deletion of step {step}", "delete", [self._k(job, "epoch"), self._k(job, "step", step),
                                                                  self._k(job, "steps"), self._k(job, "list")],
                           [self.epoch, step])


def _holder() -> str:
    """Who holds a writer lease, for the error a second writer gets (as the file index's lease says it)."""
    return f"pid {os.getpid()} on {socket.gethostname()} since {time.strftime('%Y-%m-%d %H:%M:%S %z')}"


def _info(data: bytes | None) -> dict[str, Any]:
    """Rank 0's {nbytes, metadata} of a step; {} when absent (an older release) or unreadable."""
    if data is None:
        return {}
    try:
        info = msgpack.unpackb(data, strict_map_key=False)
    except (ValueError, TypeError, msgpack.UnpackException):
        return {}
    return info if isinstance(info, dict) else {}


def _folder(info: dict[str, Any]) -> str | None:
    """The folder rank 0's begin recorded (saves of earlier releases recorded none)."""
    folder = info.get("folder")
    return folder if isinstance(folder, str) and folder else None


_DAMAGED: Any = CheckpointStatus(-1, ())  # a summary whose seal or content is wrong: list the step from its hash


def _from_summaries(summaries: Mapping[bytes, bytes]) -> dict[int, CheckpointStatus | None]:
    """Decoded with automatic collection off: ten thousand statuses set off collections in the decoding thread,
    full ones now and then, and every thread waits on those (an in-process gc at 10,000 on Redis stalled the
    event loop 2 s that way)."""
    with automatic_gc_paused():
        return {int(n): _from_summary(int(n), raw) for n, raw in summaries.items()}


def _from_summary(step: int, raw: bytes) -> CheckpointStatus | None:
    """A step's status from its (sealed) summary in the job's `list` hash (see the module's docstring); None
    when nothing is recorded yet, _DAMAGED when the summary cannot be trusted."""
    if raw.startswith(b"TCS1"):
        body = raw[44:]
        if hashlib.sha1(body).hexdigest().encode() != raw[4:44]:
            return _DAMAGED
        raw = body
    try:
        return _decode_summary(step, msgpack.unpackb(raw, raw=True))
    except (ValueError, TypeError, AttributeError, KeyError, msgpack.UnpackException):
        return _DAMAGED


def _decode_summary(step: int, summary: dict[bytes, Any]) -> CheckpointStatus | None:
    targets, complete, failures = summary.get(b"t") or {}, summary.get(b"k") or {}, summary.get(b"f") or {}
    skips = summary.get(b"s") or {}
    tiers = tuple(t.decode() for t, _ in sorted(targets.items(), key=lambda item: item[1])) if targets else ()
    done = frozenset(t.decode() for t in complete) if complete else frozenset()
    failed = {t.decode(): r.decode(errors="replace") for t, r in failures.items() if t.decode() not in done} \
        if failures else {}
    if not tiers and not failed:
        return None
    info = _info(summary.get(b"i"))
    skipped = {t.decode(): int(n) for t, n in skips.items() if t.decode() not in done} if skips else {}
    return CheckpointStatus(step, tiers or tuple(failed), done, failed, float(summary.get(b"c") or 0),
                            nbytes=info.get("nbytes"), metadata=info.get("metadata") or {}, skipped=skipped,
                            folder=_folder(info))


_BITS = [tuple(j for j in range(8) if byte & (0x80 >> j)) for byte in range(256)]


def _ranks(bits: bytes) -> frozenset[int]:
    """The ranks a `done:` bitmap holds."""
    return frozenset(8 * i + j for i, byte in enumerate(bits) if byte for j in _BITS[byte])
