"""A small fault-injecting HTTP proxy for S3 tests: forwards to a real S3 server, except for the faults
queued on it (503 SlowDown, dropped connections, slow responses), each for the next N matching requests."""
from __future__ import annotations

import asyncio
import socket
from dataclasses import dataclass

import aiohttp
from aiohttp import web

SLOWDOWN = (b'<?xml version="1.0" encoding="UTF-8"?><Error><Code>SlowDown</Code>'
            b"<Message>Please reduce your request rate.</Message></Error>")
HOP = {"host", "content-length", "transfer-encoding", "connection", "content-encoding"}


@dataclass
class Fault:
    kind: str  # "slowdown" | "drop" | "slow"
    count: int  # how many matching requests it hits (-1: all)
    method: str | None = None  # only requests with this HTTP method
    delay: float = 0.0


class FaultProxy:
    def __init__(self, upstream: str):
        self.upstream = upstream.rstrip("/")
        self.faults: list[Fault] = []
        self.hits: dict[str, int] = {}
        self.requests = 0

    def inject(self, kind: str, count: int, *, method: str | None = None, delay: float = 0.0) -> None:
        self.faults.append(Fault(kind, count, method, delay))

    async def __aenter__(self) -> str:
        self._session = aiohttp.ClientSession(auto_decompress=False)
        app = web.Application(client_max_size=1 << 30)
        app.router.add_route("*", "/{tail:.*}", self._handle)
        self._runner = web.AppRunner(app)
        await self._runner.setup()
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        await web.TCPSite(self._runner, "127.0.0.1", port).start()
        return f"http://127.0.0.1:{port}"

    async def __aexit__(self, *exc: object) -> None:
        await self._runner.cleanup()
        await self._session.close()

    def _take(self, request: web.Request) -> Fault | None:
        for fault in self.faults:
            if fault.count != 0 and fault.method in (None, request.method):
                fault.count -= 1 if fault.count > 0 else 0
                self.hits[fault.kind] = self.hits.get(fault.kind, 0) + 1
                return fault
        return None

    async def _handle(self, request: web.Request) -> web.StreamResponse:
        self.requests += 1
        body = await request.read()
        fault = self._take(request)
        if fault is not None and fault.kind == "slowdown":
            return web.Response(status=503, body=SLOWDOWN, content_type="application/xml")
        if fault is not None and fault.kind == "drop":
            assert request.transport is not None
            request.transport.close()  # the client sees the connection reset
            return web.Response(status=500)
        if fault is not None and fault.kind == "slow":
            await asyncio.sleep(fault.delay)
        headers = {k: v for k, v in request.headers.items() if k.lower() not in HOP}
        async with self._session.request(request.method, self.upstream + request.path_qs, headers=headers,
                                         data=body) as resp:
            payload = await resp.read()
            out = {k: v for k, v in resp.headers.items() if k.lower() not in HOP}
            return web.Response(status=resp.status, body=payload, headers=out)
