"""The node agent's parts without a trainer: frames and descriptors over the socket, the folder's and the
socket's modes, `status`, the idle exit, and the config key. The agent runs in this process (no spawn)."""
import asyncio
import os
import socket
import stat

import pytest

from tiered_ckpt.agent.client import agent_status, connect
from tiered_ckpt.agent.folder import make_folder, socket_path
from tiered_ckpt.agent.server import AgentServer
from tiered_ckpt.agent.wire import Channel, ChannelClosed
from tiered_ckpt.config import parse_config
from tiered_ckpt.errors import AgentUnavailable, ConfigError
from tiered_ckpt.save.drain import DrainOrder, TierOutcome


async def test_frames_and_descriptors_cross_the_socket():
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    left, right = Channel(a), Channel(b)
    r, w = os.pipe()
    try:
        big = os.urandom(3 << 20)  # packed in a thread, sent in many pieces
        sending = asyncio.create_task(left.send({"op": "drain", "blob": big}, [w], size=len(big)))
        message, fds = await right.recv()
        await sending
        assert message == {"op": "drain", "blob": big} and len(fds) == 1
        os.write(fds[0], b"x")  # the same pipe, through the passed descriptor
        assert os.read(r, 1) == b"x"
        os.close(fds[0])
        await left.send({"op": "status"})
        assert (await right.recv()) == ({"op": "status"}, [])
        left.close()
        with pytest.raises(ChannelClosed):
            await right.recv()
    finally:
        right.close()
        os.close(r)
        os.close(w)


def test_an_order_and_an_outcome_survive_the_wire_format():
    order = DrainOrder("job", 7, 1, 2, "s1", "ix-abc/s1", 3, ("disk", "s3"), "host", ("k0", "k1"), (10, 4),
                       ((1, b"\x01" * 8), (2, b"")), "xxh3", 4096, (("rec", b"r"),), {"index": "file:///x"})
    import msgpack
    back = DrainOrder.from_wire(msgpack.unpackb(msgpack.packb(order.to_wire(), use_bin_type=True), raw=False))
    assert back == order
    outcome = TierOutcome("disk", "skipped", newer=9)
    assert TierOutcome.from_wire(outcome.to_wire()) == outcome


def test_the_folder_is_private_and_refused_when_others_may_enter(tmp_path):
    folder = make_folder(tmp_path / "agent")
    assert stat.S_IMODE(folder.stat().st_mode) == 0o700
    open_folder = tmp_path / "open"
    open_folder.mkdir(mode=0o755)
    os.chmod(open_folder, 0o755)
    with pytest.raises(ConfigError, match="others may enter"):
        make_folder(open_folder)
    (tmp_path / "file").write_text("")
    with pytest.raises(ConfigError, match="File exists|not a directory"):
        make_folder(tmp_path / "file")


async def test_the_agent_serves_status_on_a_0600_socket_and_exits_when_idle(tmp_path):
    folder = tmp_path / "agent"
    server = AgentServer(folder, idle=0.4)
    assert server.claim()
    assert not AgentServer(folder).claim()  # one agent per folder
    serving = asyncio.create_task(server.serve())
    channel = await connect(folder, start=False, timeout=5)
    assert stat.S_IMODE(os.stat(socket_path(folder)).st_mode) == 0o600
    status = await agent_status(folder)
    assert status is not None and status["pid"] == os.getpid() and status["drains"] == []
    assert status["clients"] == 2  # this channel, and the status call's own
    await asyncio.sleep(0.8)
    assert not serving.done()  # a trainer is attached: the agent stays
    channel.close()
    await asyncio.wait_for(serving, 5)  # then nothing to drain and nobody attached: it exits
    assert not socket_path(folder).exists()
    with pytest.raises(AgentUnavailable, match="no agent runs"):
        await connect(folder, start=False, timeout=1)
    assert await agent_status(folder) is None


async def test_a_bad_order_is_refused_and_the_agent_stays(tmp_path):
    folder = tmp_path / "agent"
    server = AgentServer(folder, idle=30)
    assert server.claim()
    serving = asyncio.create_task(server.serve())
    try:
        channel = await connect(folder, start=False, timeout=5)
        await channel.send({"op": "drain", "id": 1, "order": {"job": "j"}})
        reply, _ = await channel.recv()
        assert reply["op"] == "refused" and reply["id"] == 1 and "KeyError" in reply["error"]
        channel.close()
        assert (await agent_status(folder)) is not None
    finally:
        server._stop.set()
        await asyncio.wait_for(serving, 5)


def test_the_agent_key_is_checked(tmp_path):
    with pytest.raises(ConfigError, match="agent must be one of off, on") as e:
        parse_config({"engine": {"agent": "yes"}, "tiers": [{"name": "disk", "kind": "local",
                                                              "path": str(tmp_path)}]}, source="c.toml")
    assert e.value.key == "engine.agent" and e.value.file == "c.toml"
    assert parse_config({"tiers": [{"name": "disk", "kind": "local", "path": str(tmp_path)}]}).engine.agent == "off"


async def test_a_handoff_cancelled_by_its_time_limit_closes_its_connection(tmp_path):
    """A hung agent (its socket accepts, nothing answers): the handoff's own time limit cancels `connect` while it
    waits for hello. The socket must close then, or the agent, once it runs again, counts a client that never goes
    and never exits idle (seen under load: an agent resumed after SIGSTOP lived on past its idle time)."""
    folder = make_folder(tmp_path / "agent")
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(str(socket_path(folder)))
    listener.listen(4)
    try:
        # the error is kept, as a log record that names it keeps it (its traceback holds connect's frame)
        with pytest.raises(asyncio.TimeoutError) as caught:
            await asyncio.wait_for(connect(folder, start=False, timeout=30), 0.3)
        conn, _ = listener.accept()  # what a resumed agent accepts from its backlog
        with conn:
            conn.settimeout(5)
            data = b""
            while chunk := conn.recv(4096):  # the hello, then end of file: the trainer's side is closed
                data += chunk
            assert data  # the hello was sent before the time limit hit
        assert caught.value is not None
    finally:
        listener.close()
