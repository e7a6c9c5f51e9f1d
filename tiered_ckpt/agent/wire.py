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
        """One frame; `size`: about how large it is (over IN_THREAD, it is packed in a thread)."""
        body = await _in_thread_if_large(lambda: msgpack.packb(message, use_bin_type=True), size)
        view = memoryview(_HEADER.pack(len(body)) + body)
        ancillary = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))] if fds else []
        loop = asyncio.get_running_loop()
        async with self._sending:
            while view:
                try:
                    sent = self.sock.sendmsg([view], ancillary)
                except BlockingIOError:
                    await _ready(loop, self.sock, write=True)
                    continue
                except (BrokenPipeError, ConnectionResetError) as e:
                    raise ChannelClosed(str(e)) from None
                ancillary = []
                view = view[sent:]

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


async def _in_thread_if_large(fn: Any, size: int) -> Any:
    return await asyncio.to_thread(fn) if size > IN_THREAD else fn()
