"""Frames between the trainer and the agent: a 4-byte big-endian length, then one msgpack map. File descriptors
(the file index's writer lease) travel beside a frame's bytes (SCM_RIGHTS) and are handed out with that frame.
Large frames (a manifest rides along) are packed and unpacked in a thread, off the event loop."""
from __future__ import annotations

import array
import asyncio
import socket
import struct
from typing import Any

import msgpack

MAX_FRAME = 1 << 30
MAX_FDS = 16
IN_THREAD = 1 << 20  # frames larger than this are (un)packed in a thread
IOV_MAX = 1024  # buffers one sendmsg takes (Linux)
_HEADER = struct.Struct(">I")

# The protocol's version, said by both sides in `hello`. It gates the handoff only: a trainer hands saves to an agent
# of its own version alone (the terms of a drain change between versions), while `status` and `settle`, whose
# messages every version reads alike, work across versions. A connection whose hello names another version (or
# none) neither holds the agent nor restarts its idle clock (server.py), so a trainer of another release cannot
# keep it from its idle exit. 2: orders come before the memory tier's commit (save/drain.py, wait_for_source);
# 3: the agent records in the index that a save it gives up will not commit there (Index.abandon), and the
# trainer's marker honours that record
VERSION = 3


class ChannelClosed(ConnectionError):
    """The other side closed the connection (or died)."""


class Channel:
    """One connection, both ways, on the running loop (the socket is made non-blocking)."""

    def __init__(self, sock: socket.socket):
        sock.setblocking(False)
        self.sock = sock
        self.hello: dict[str, Any] = {}  # the other side's answer to hello (client.connect): its pid and version
        self._buffer = bytearray()
        self._fds: list[int] = []
        self._closed = False
        self._sending = asyncio.Lock()  # one frame at a time: a large one that fills the socket's buffer waits
        # for room mid-frame, and another task's frame written then would land inside it

    async def send(self, message: dict[str, Any], fds: tuple[int, ...] | list[int] = (), *, size: int = 0) -> None:
        """One frame; `size`: about how large it is (over IN_THREAD, it is packed in a thread, and its long byte
        strings, a save's records at a million tensors, are sent from where they are: no copy of them is made in
        one C call that holds the GIL, ~0.2 s a save at 1M tensors on a machine where fresh memory is costly)."""
        if size > IN_THREAD:
            from ..manifest.pieces import packed_parts  # (numpy, loaded by a trainer already: not for small frames)

            buffers = await asyncio.to_thread(lambda: _coalesced(packed_parts(message)))
        else:
            buffers = [memoryview(msgpack.packb(message, use_bin_type=True))]
        length = sum(b.nbytes for b in buffers)
        buffers.insert(0, memoryview(_HEADER.pack(length)))
        ancillary = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))] if fds else []
        loop = asyncio.get_running_loop()
        at = 0  # the first buffer not wholly sent
        async with self._sending:
            while at < len(buffers):
                try:
                    sent = self.sock.sendmsg(buffers[at:at + IOV_MAX], ancillary)
                except BlockingIOError:
                    await _ready(loop, self.sock, write=True)
                    continue
                except (BrokenPipeError, ConnectionResetError) as e:
                    raise ChannelClosed(str(e)) from None
                ancillary = []
                while sent:
                    if sent >= buffers[at].nbytes:
                        sent -= buffers[at].nbytes
                        at += 1
                    else:
                        buffers[at], sent = buffers[at][sent:], 0
                while at < len(buffers) and not buffers[at].nbytes:
                    at += 1

    async def recv(self) -> tuple[dict[str, Any], list[int]]:
        """The next frame and the descriptors that came with it; ChannelClosed at the end."""
        while True:
            if len(self._buffer) >= _HEADER.size:
                (length,) = _HEADER.unpack_from(self._buffer)
                if length > MAX_FRAME:
                    raise ChannelClosed(f"a frame of {length} bytes is more than the {MAX_FRAME} allowed")
                if len(self._buffer) >= _HEADER.size + length:
                    body = bytes(self._buffer[_HEADER.size:_HEADER.size + length])
                    del self._buffer[:_HEADER.size + length]
                    fds, self._fds = self._fds, []
                    message = await _in_thread_if_large(lambda: msgpack.unpackb(body, raw=False), len(body))
                    if not isinstance(message, dict):
                        raise ChannelClosed(f"a frame holds a {type(message).__name__}, not a map")
                    return message, fds
            await self._fill()

    async def _fill(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            try:
                data, ancdata, _, _ = self.sock.recvmsg(1 << 16, socket.CMSG_SPACE(MAX_FDS * 4))
            except BlockingIOError:
                await _ready(loop, self.sock, write=False)
                continue
            except ConnectionResetError as e:
                raise ChannelClosed(str(e)) from None
            for level, kind, raw in ancdata:
                if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                    fds = array.array("i")
                    fds.frombytes(raw[: len(raw) - len(raw) % fds.itemsize])
                    self._fds.extend(fds)
            if not data:
                raise ChannelClosed("the other side closed the connection")
            self._buffer += data
            return

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self.sock.close()


async def _ready(loop: asyncio.AbstractEventLoop, sock: socket.socket, *, write: bool) -> None:
    """Wait until `sock` can be written (or read) without blocking."""
    done = loop.create_future()
    fd = sock.fileno()
    if fd < 0:
        raise ChannelClosed("the connection is closed")
    add, remove = (loop.add_writer, loop.remove_writer) if write else (loop.add_reader, loop.remove_reader)
    add(fd, lambda: done.done() or done.set_result(None))
    try:
        await done
    finally:
        remove(fd)


def _coalesced(parts: list[bytes | memoryview]) -> list[memoryview]:
    """The pieces of a packed frame with each run of short ones joined (sendmsg takes at most IOV_MAX buffers a
    call, and a frame of many map entries is many pieces); the long ones as views of themselves."""
    out: list[memoryview] = []
    short: list[bytes | memoryview] = []
    for part in parts:
        view = memoryview(part).cast("B")
        if view.nbytes < IN_THREAD:
            short.append(view)
            continue
        if short:
            out.append(memoryview(b"".join(short)))
            short = []
        out.append(view)
    if short:
        out.append(memoryview(b"".join(short)))
    return out


async def _in_thread_if_large(fn: Any, size: int) -> Any:
    return await asyncio.to_thread(fn) if size > IN_THREAD else fn()
