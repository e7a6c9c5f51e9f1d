"""The node agent's parts without a trainer: frames and descriptors over the socket, the folder's and the
socket's modes, `status`, the idle exit, and the config key. The agent runs in this process (no spawn)."""
import asyncio
import contextlib
import os
import socket
import stat

import pytest

from tiered_ckpt.agent.client import agent_status, connect
from tiered_ckpt.agent.folder import agent_folder, make_folder, socket_path
from tiered_ckpt.agent.server import AgentServer
from tiered_ckpt.agent.wire import VERSION, Channel, ChannelClosed
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


async def test_a_large_frame_of_many_pieces_crosses_whole(monkeypatch):
    """A large frame is sent from its pieces where they lie (sendmsg of many buffers, at most IOV_MAX a call, the
    socket's room running out mid-buffer): long byte strings at any depth, a list longer than a packing piece, and
    more pieces than one sendmsg takes all arrive as sent, with the descriptors."""
    from tiered_ckpt.agent import wire

    monkeypatch.setattr(wire, "IN_THREAD", 1024)  # (so that 3,000 entries of 2 KiB are 3,000 buffers)
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    left, right = Channel(a), Channel(b)
    r, w = os.pipe()
    try:
        message = {"op": "drain", "order": {"records": [["manifest", os.urandom(3 << 20)], ["rank", b"r" * 70_000]],
                                            "keys": [f"k{i}" for i in range(40_000)], "empty": b""},
                   "many": {f"e{i}": os.urandom(2048) for i in range(3000)}, "tail": 7}
        sending = asyncio.create_task(left.send(message, [w], size=16 << 20))
        got, fds = await asyncio.wait_for(right.recv(), 30)
        await sending
        assert got == message and len(fds) == 1
        os.close(fds[0])
    finally:
        left.close()
        right.close()
        os.close(r)
        os.close(w)


async def test_frames_sent_at_once_never_interleave():
    """A large frame waits for room mid-frame (nobody reads yet) while another task sends a small one: each arrives
    whole (the agent sends outcomes and questions from several tasks on one connection)."""
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    left, right = Channel(a), Channel(b)
    try:
        big = os.urandom(4 << 20)
        first = asyncio.create_task(left.send({"op": "drain", "blob": big}, size=len(big)))
        await asyncio.sleep(0.3)  # packed, part written, waiting for the reader
        second = asyncio.create_task(left.send({"op": "status"}))
        await asyncio.sleep(0.05)
        got = [await asyncio.wait_for(right.recv(), 10), await asyncio.wait_for(right.recv(), 10)]  # (before: a
        # frame inside the other, the stream's next length read from its middle: no frame ever came)
        await asyncio.gather(first, second)
        assert sorted(m["op"] for m, _ in got) == ["drain", "status"]
        assert next(m for m, _ in got if m["op"] == "drain")["blob"] == big
    finally:
        left.close()
        right.close()


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


@contextlib.asynccontextmanager
async def agent_in_process(folder):
    """An agent serving `folder` in this process (idle exit far off), stopped at the end."""
    server = AgentServer(folder, idle=30)
    assert server.claim()
    serving = asyncio.create_task(server.serve())
    try:
        yield server
    finally:
        server._stop.set()
        await asyncio.wait_for(serving, 5)


class _JobOnFileIndex:
    """A job "j" on a fenced file index (a memory tier and a disk), a Committer of its session "s1", and the orders a
    trainer of that session hands its agent (the link table as a trainer sends it)."""

    def __init__(self, tmp_path, shm_dir, world_size):
        from tiered_ckpt.agent.links import tier_tables
        from tiered_ckpt.storage.index.file import FileIndex
        from tiered_ckpt.testing.configs import stack

        config = stack(tmp_path, {"kind": "memory", "capacity": "64MiB", "keep_last": 2}, "local", shm=shm_dir,
                       job="j")
        self.index, self.world_size = FileIndex(tmp_path / "index"), world_size
        self.link = {"index": f"file://{tmp_path}/index", "index_timeout": 0.5, "commit_timeout": 300,
                     "tiers": tier_tables(list(config.tiers), str(tmp_path)), "node": 0, "num_nodes": 1}

    async def open(self) -> None:
        from tiered_ckpt.save.commit import Committer

        await self.index.open()
        self.index.epoch = await self.index.fence("j")
        self.commit = Committer(self.index, "j", rank=0, world_size=self.world_size, session="s1", timeout=30)

    def order(self, step: int) -> DrainOrder:
        return DrainOrder("j", step, 0, self.world_size, "s1", self.commit.incarnation, self.index.epoch, ("disk",),
                          "host", ("k",), (1,), ((0, b""),), "crc32c", 0, (), self.link)


@contextlib.asynccontextmanager
async def job_and_agent(tmp_path, shm_dir, world_size=1):
    """_JobOnFileIndex, opened, and an agent serving tmp_path/agent in this process: (job, folder, server)."""
    job, folder = _JobOnFileIndex(tmp_path, shm_dir, world_size), tmp_path / "agent"
    try:
        await job.open()
        async with agent_in_process(folder) as server:
            yield job, folder, server
    finally:
        await job.index.close()


async def test_a_bad_order_is_refused_and_the_agent_stays(tmp_path):
    folder = tmp_path / "agent"
    async with agent_in_process(folder):
        channel = await connect(folder, start=False, timeout=5)
        await channel.send({"op": "drain", "id": 1, "order": {"job": "j"}})
        reply, _ = await channel.recv()
        assert reply["op"] == "refused" and reply["id"] == 1 and "KeyError" in reply["error"]
        channel.close()
        assert (await agent_status(folder)) is not None


def test_the_agent_key_is_checked(tmp_path):
    with pytest.raises(ConfigError, match="agent must be one of auto, on, off") as e:
        parse_config({"engine": {"agent": "yes"}, "tiers": [{"name": "disk", "kind": "local",
                                                              "path": str(tmp_path)}]}, source="c.toml")
    assert e.value.key == "engine.agent" and e.value.file == "c.toml"
    assert parse_config({"tiers": [{"name": "disk", "kind": "local", "path": str(tmp_path)}]}).engine.agent == "auto"


async def test_a_trainer_of_another_mount_namespace_is_refused(tmp_path):
    """Its memory tier's files may not be those the agent sees (a folder named by $TIERED_CKPT_AGENT_DIR that
    containers share): refused, so its trainer writes the tiers itself."""
    folder = tmp_path / "agent"
    async with agent_in_process(folder) as server:
        channel = await connect(folder, start=False, timeout=5)
        await channel.send({"op": "drain", "id": 1, "order": {"job": "j"}, "mounts": server.mounts + "-other"})
        reply, _ = await channel.recv()
        assert reply["op"] == "refused" and "another mount namespace" in reply["error"], reply
        channel.close()


def test_the_default_folder_is_one_per_user_and_mount_namespace(monkeypatch):
    monkeypatch.delenv("TIERED_CKPT_AGENT_DIR", raising=False)
    monkeypatch.delenv("XDG_RUNTIME_DIR", raising=False)
    ns = os.stat("/proc/self/ns/mnt").st_ino
    assert agent_folder().name == f"tiered_ckpt-agent-{os.getuid()}-{ns}"


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


async def test_an_agent_of_another_protocol_version_takes_no_save_but_answers_status_and_settle(tmp_path):
    """An agent of an earlier release (it drained on other terms) answers hello with its version: the trainer hands
    it nothing (AgentUnavailable: it writes the tiers itself) and does not connect to it again while its socket is
    the same (each connection restarted that agent's idle clock: a trainer saving every few seconds kept it alive
    for good); `agent status` and an engine's `settle` still talk to it. Before: both failed at hello, and every
    handoff connected anew."""
    from tiered_ckpt.agent.client import AgentClient, settle

    folder = make_folder(tmp_path / "agent")
    connections = []

    async def old_agent(channel: Channel) -> None:
        connections.append(channel)
        try:
            while True:
                message, _ = await channel.recv()
                if message["op"] == "hello":
                    await channel.send({"op": "hello", "pid": 4242, "version": VERSION - 1})
                elif message["op"] == "status":
                    await channel.send({"op": "status", "pid": 4242, "clients": 0, "drains": []})
                elif message["op"] == "settle":
                    await channel.send({"op": "settled", "job": message["job"], "drains": 1})
        except ChannelClosed:
            pass
        finally:
            channel.close()

    async def serve_old_agent() -> asyncio.Task:
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        listener.bind(str(socket_path(folder)))
        listener.listen(8)
        listener.setblocking(False)

        async def accept() -> None:
            with listener:
                while True:
                    conn, _ = await asyncio.get_running_loop().sock_accept(listener)
                    asyncio.create_task(old_agent(Channel(conn)))
        return asyncio.create_task(accept())

    order = DrainOrder("j", 1, 0, 1, "s1", "ix/s1", 0, ("disk",), "host", ("k",), (1,), ((0, b""),), "crc32c", 0, ())
    server = await serve_old_agent()
    client = AgentClient(folder, {"index": "file:///x"}, lambda: [], handoff_timeout=5)
    try:
        status = await agent_status(folder)
        assert status is not None and status["pid"] == 4242 and status["version"] == VERSION - 1
        assert await settle(folder, "j", "file:///x", timeout=5) == 1
        before = len(connections)
        for _ in range(3):
            with pytest.raises(AgentUnavailable, match=f"pid 4242.*protocol version {VERSION - 1}, this engine "
                                                       f"{VERSION}"):
                await client.hand_off(order)
        assert len(connections) == before + 1  # one look at it, then left alone until its socket goes
        server.cancel()
        await asyncio.gather(server, return_exceptions=True)
        socket_path(folder).unlink(missing_ok=True)
        server = await serve_old_agent()  # another agent
        with pytest.raises(AgentUnavailable, match="protocol version"):
            await client.hand_off(order)
        assert len(connections) == before + 2
    finally:
        await client.close()
        server.cancel()
        await asyncio.gather(server, return_exceptions=True)


async def test_connections_of_another_protocol_version_do_not_keep_the_agent_from_its_idle_exit(tmp_path):
    """A trainer of another release connects at each save, says hello with its version and goes: the agent answers,
    refuses its handoffs, and exits once idle all the same. Before: every such connection restarted its idle
    clock, so it never exited while that trainer ran."""
    folder = tmp_path / "agent"
    server = AgentServer(folder, idle=0.5)
    assert server.claim()
    serving = asyncio.create_task(server.serve())
    other = {"op": "hello", "pid": os.getpid(), "version": VERSION + 1}
    started = asyncio.get_running_loop().time()
    while not socket_path(folder).exists():  # listening
        await asyncio.sleep(0.01)
    rounds = 0
    try:
        while not serving.done():
            assert asyncio.get_running_loop().time() - started < 10, "the agent stayed, held by another version"
            try:
                sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                await asyncio.get_running_loop().sock_connect(sock, str(socket_path(folder)))
            except (FileNotFoundError, ConnectionRefusedError):
                sock.close()
                break  # the agent went
            channel = Channel(sock)
            try:
                await channel.send(other)  # (an answer never comes from an agent that exits meanwhile)
                reply, _ = await asyncio.wait_for(channel.recv(), 5)
                assert reply["version"] == VERSION
                await channel.send({"op": "drain", "id": 1, "order": {"job": "j"}})
                reply, _ = await asyncio.wait_for(channel.recv(), 5)
                assert reply["op"] == "refused"
                refusal = reply["error"]
            except (ChannelClosed, OSError, asyncio.TimeoutError):  # the agent went mid-conversation
                break
            finally:
                channel.close()
            rounds += 1
            await asyncio.sleep(0.1)
        await asyncio.wait_for(serving, 10)
        assert rounds >= 3  # it exited while that trainer kept connecting
        assert "protocol version" in refusal
    finally:
        server._stop.set()
        await asyncio.wait_for(serving, 10)


class _RecordingDrainer:
    """A Drainer that notes, at each handoff, the tiers the index lists the step complete on, then refuses (the
    trainer writes the slower tiers itself)."""

    def __init__(self) -> None:
        self.index = None
        self.complete_at_handoff: list[set[str]] = []

    async def hand_off(self, order):
        from tiered_ckpt.storage.index import status_of

        status = await status_of(self.index, order.job, order.step)
        self.complete_at_handoff.append(set(status.complete) if status is not None else set())
        raise AgentUnavailable("refused by the test")

    async def settle(self, job: str) -> int:
        return 0

    def warm(self) -> None:
        pass

    async def close(self) -> None:
        pass


async def test_a_save_is_handed_to_the_agent_before_the_memory_tier_commits(make_config, monkeypatch):
    """The handoff comes before the memory tier's commit: else a trainer killed between that commit and the handoff
    left the step on the memory tier alone, in nobody's hands (a reboot then lost it). Before: the handoff saw
    the step complete on host."""
    import torch

    import tiered_ckpt as tc
    from tiered_ckpt.engine import Engine

    drainer = _RecordingDrainer()

    async def agent_client(self):
        drainer.index = self.store.index
        return drainer

    monkeypatch.setattr(Engine, "_agent_client", agent_client)
    async with tc.Engine(make_config(agent="on")) as engine:
        handle = await engine.save(1, {"w": torch.arange(1000, dtype=torch.float32)})
        await handle.wait()  # the refused handoff: the trainer wrote the disk itself
        assert set(handle.committed_on) == {"host", "disk"}
    assert drainer.complete_at_handoff == [set()]


async def test_the_agent_drains_only_what_the_memory_tier_committed(tmp_path):
    """wait_for_source: an order handed over before the memory tier's commit is drained once the index says that
    tier committed, and abandoned when its trainer went without marking its copy there, or the tier failed. An
    abandonment is on record first: a marker that lands after it commits nothing."""
    from tiered_ckpt.errors import RankFailed
    from tiered_ckpt.save.commit import Committer
    from tiered_ckpt.save.drain import wait_for_source
    from tiered_ckpt.storage.index import status_of
    from tiered_ckpt.storage.index.file import FileIndex

    index = FileIndex(tmp_path / "index")
    await index.open()
    try:
        index.epoch = await index.fence("j")
        commit = Committer(index, "j", rank=0, world_size=2, session="s1", timeout=5)
        other = Committer(index, "j", rank=1, world_size=2, session="s1", timeout=5)
        order = DrainOrder("j", 3, 0, 2, "s1", commit.incarnation, index.epoch, ("disk",), "host", ("k",), (1,),
                           ((0, b""),), "crc32c", 0, ())
        await commit.begin(3, ["host", "disk"])
        gone = await wait_for_source(commit, order, lambda: True, timeout=5)
        assert gone is not None and "went before it marked step 3 durable on tier host" in gone
        await commit.mark_durable(3, "host")  # markers that land late: the session's commit is over
        with pytest.raises(RankFailed, match="abandoned by the node agent: the trainer went before"):
            await other.mark_durable(3, "host")
        status = await status_of(index, "j", 3)
        assert status is not None and status.complete == frozenset() and "abandoned" in status.failed["host"]
        await commit.begin(4, ["host", "disk"])
        await commit.mark_durable(4, "host")  # this rank marked; the tier waits for rank 1
        step4 = DrainOrder(**{**vars(order), "step": 4})
        assert "did not commit step 4 within" in await wait_for_source(commit, step4, lambda: True, timeout=0.2)
        with pytest.raises(RankFailed, match="abandoned"):
            await other.mark_durable(4, "host")
        await commit.begin(5, ["host", "disk"])
        await commit.mark_durable(5, "host")
        step5 = DrainOrder(**{**vars(order), "step": 5})
        waiting = asyncio.create_task(wait_for_source(commit, step5, lambda: True, timeout=5))
        await asyncio.sleep(0.05)
        assert not waiting.done()
        await other.mark_durable(5, "host")  # the last marker commits the tier
        assert await asyncio.wait_for(waiting, 5) is None
        await commit.begin(6, ["host", "disk"])
        await other.fail_tier(6, "host", OSError("disk gone"))
        failed = await wait_for_source(commit, DrainOrder(**{**vars(order), "step": 6}), lambda: False, timeout=5)
        assert failed is not None and "tier host failed step 6" in failed and "disk gone" in failed
        # a trainer killed while its marker was on the way: the marker lands within the grace, the drain goes on
        await commit.begin(7, ["host", "disk"])
        late = asyncio.create_task(wait_for_source(commit, DrainOrder(**{**vars(order), "step": 7}), lambda: True,
                                                   timeout=5))
        await asyncio.sleep(0.2)
        await commit.mark_durable(7, "host")
        await other.mark_durable(7, "host")
        assert await asyncio.wait_for(late, 5) is None
    finally:
        await index.close()


async def test_a_new_engine_does_not_wait_for_a_drain_whose_memory_tier_can_no_longer_commit(tmp_path, shm_dir):
    """A world of 2: rank 0 marked its memory copy of step 3 and handed the save over, then the job died before rank 1
    marked its own. The agent holds the order, waiting for a commit only that dead session could make: a new engine's
    `settle` does not wait for it (it would hold the open up to commit_timeout: 600 s by default), and the drain then
    abandons the order, writing nothing."""
    from tiered_ckpt.agent.client import settle
    from tiered_ckpt.storage.index import status_of

    async with job_and_agent(tmp_path, shm_dir, world_size=2) as (job, folder, _):
        commit, link, index = job.commit, job.link, job.index
        await commit.begin(3, ["host", "disk"])
        await commit.mark_durable(3, "host")
        order = job.order(3)
        channel = await connect(folder, start=False, timeout=5)
        await channel.send({"op": "drain", "id": 1, "order": order.to_wire(), "trainer": ""})
        reply, _ = await channel.recv()
        assert reply == {"op": "accepted", "id": 1}
        channel.close()  # the trainer is gone
        assert await settle(folder, "j", link["index"], timeout=30) == 0  # before: 1, after the drain's full wait
        # the commit never comes: the drain abandons the order now, not after its 300 s wait (its link, and with it
        # the file index's lease, would hold the new writer's first save that long)
        deadline = asyncio.get_running_loop().time() + 30
        while (await agent_status(folder))["drains"]:
            assert asyncio.get_running_loop().time() < deadline, "the drain still waits for the dead session's commit"
            await asyncio.sleep(0.1)
        assert not list((folder / "journal").glob("*.order"))
        status = await status_of(index, "j", 3)
        assert status is not None and status.complete == frozenset() and "disk" not in status.settled


async def test_the_first_handoff_waits_for_the_agent_the_open_started(tmp_path, monkeypatch):
    """The agent an engine's open starts may take longer to come up than a handoff's time limit (11 s seen on 2
    cores at load 12; the limit is 10 s): the first save's handoff waits for it (START_TIMEOUT). Before, it timed
    out, the trainer wrote that save itself, and the agent, which nobody had connected to, exited idle: the next
    save started another (a CI run's kill-in-each-phase case found no agent holding the step)."""
    from tiered_ckpt.agent import client as agent_client

    folder = tmp_path / "agent"
    loop = asyncio.get_running_loop()
    starts: list[float] = []
    serving: list[asyncio.Task] = []
    server = AgentServer(folder, idle=30)

    def come_up() -> None:
        assert server.claim()
        serving.append(asyncio.create_task(server.serve()))

    def slow_start(folder_, idle=None) -> None:  # the agent process, 0.5 s to come up (the thread start_agent runs in)
        starts.append(loop.time())
        loop.call_soon_threadsafe(loop.call_later, 0.5, come_up)

    monkeypatch.setattr(agent_client, "start_agent", slow_start)
    client = agent_client.AgentClient(folder, {"index": "file:///x"}, lambda: [], handoff_timeout=0.1)
    client.warm()  # the engine's open
    order = DrainOrder("j", 1, 0, 1, "s1", "ix/s1", 0, ("disk",), "host", ("k",), (1,), ((0, b""),), "crc32c", 0, ())
    try:
        # answered by the agent (it refuses this order: no such index) instead of "did not accept within 0.1s"
        with pytest.raises(AgentUnavailable, match="refused step 1"):
            await client.hand_off(order)
        assert len(starts) == 1
    finally:
        await client.close()
        server._stop.set()
        await asyncio.wait_for(serving[0], 5)


async def test_a_trainer_with_other_aws_settings_writes_its_s3_tier_itself(tmp_path, monkeypatch):
    """The agent writes with the environment it was started with (the AWS chain reads credentials, profile, region
    and proxies from it): a trainer whose settings differ does not hand it a save with an S3 tier (it would be written
    with another job's credentials, or fail for lack of any: seen when one agent served a test and the next);
    one without an S3 tier, or with the same settings, does. Compared as a digest: no secret crosses the socket."""
    from tiered_ckpt.agent.client import AgentClient

    folder = tmp_path / "agent"
    disk = {"name": "disk", "kind": "local", "path": str(tmp_path)}
    s3 = {"name": "s3", "kind": "s3", "bucket": "b"}
    order = DrainOrder("j", 1, 0, 1, "s1", "ix/s1", 0, ("disk",), "host", ("k",), (1,), ((0, b""),), "crc32c", 0, ())
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "job-a")
    async with agent_in_process(folder):
        monkeypatch.setenv("AWS_ACCESS_KEY_ID", "job-b")  # another job's trainer
        clients = [AgentClient(folder, {"index": "file:///x", "tiers": tiers}, lambda: [], handoff_timeout=5)
                   for tiers in ([disk, s3], [disk], [disk, s3])]
        try:
            for _ in range(2):
                with pytest.raises(AgentUnavailable, match=r"other AWS settings .* tier\(s\) s3 .*TIERED_CKPT_AGENT_DIR"):
                    await clients[0].hand_off(order)
            with pytest.raises(AgentUnavailable, match="refused step 1"):  # no S3 tier: handed (refused as bogus)
                await clients[1].hand_off(order)
            monkeypatch.setenv("AWS_ACCESS_KEY_ID", "job-a")
            with pytest.raises(AgentUnavailable, match="refused step 1"):  # the agent's own settings: handed
                await clients[2].hand_off(order)
        finally:
            for client in clients:
                await client.close()


async def test_a_connection_that_has_not_said_hello_yet_holds_the_agent(tmp_path):
    """A trainer that connects as the idle time runs out (its engine's open slow on a loaded machine) found the agent
    exiting mid-handshake, and its first save waited out the handoff limit. Until its first message a connection
    holds the agent; once it closes, the agent exits when idle."""
    folder = tmp_path / "agent"
    server = AgentServer(folder, idle=0.5)
    assert server.claim()
    serving = asyncio.create_task(server.serve())
    try:
        while not socket_path(folder).exists():
            await asyncio.sleep(0.01)
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.connect(str(socket_path(folder)))
        await asyncio.sleep(1.5)  # three idle times, no hello yet
        assert not serving.done() and server.greeting == 1
        sock.close()
        await asyncio.wait_for(serving, 5)  # then idle: it goes
    finally:
        server._stop.set()
        await asyncio.wait_for(serving, 5)


async def test_a_trainer_that_reconnected_stays_attached_when_its_old_connection_closes(tmp_path, shm_dir):
    """A handoff that timed out drops its connection and the next save makes another, to the same agent and link;
    the agent can see the old connection close after the new one handed a save over. That close must not count as
    the trainer gone (the agent would then run the retention of a live trainer's tiers and take its file index's
    lease record as its own): the trainer is gone once its last connection closed."""
    from tiered_ckpt.agent.links import CLEANER

    lease = tmp_path / "lease"
    lease.write_text("the trainer's record")
    channels = []
    async with job_and_agent(tmp_path, shm_dir) as (job, folder, server):
        try:
            for step in (3, 4):  # step 3 on the first connection, step 4 on the reconnected one: one link
                await job.commit.begin(step, ["host", "disk"])
                order = job.order(step)
                channel = await connect(folder, start=False, timeout=5)
                fd = os.open(lease, os.O_RDWR)
                await channel.send({"op": "drain", "id": step, "order": order.to_wire(), "trainer": ""}, [fd])
                os.close(fd)
                reply, _ = await channel.recv()
                assert reply == {"op": "accepted", "id": step}
                channels.append(channel)
            assert len(server.links) == 1

            async def clients(n: int) -> None:  # (the status call's own connection is one more)
                while (await agent_status(folder))["clients"] != n + 1:
                    await asyncio.sleep(0.02)

            channels[0].close()  # the old connection's close, seen after the new one's handoff
            await asyncio.wait_for(clients(1), 5)
            assert [link.attached for link in server.links.values()] == [True]
            assert lease.read_text() == "the trainer's record"
            channels[1].close()  # the trainer's last connection: now it is gone
            await asyncio.wait_for(clients(0), 5)
            assert lease.read_text().startswith(CLEANER)
        finally:  # (also when an assertion fails: the agent then stops with no client left)
            for channel in channels:
                channel.close()


async def test_a_trainer_that_comes_back_after_all_its_connections_closed_gets_its_lease_record_back(tmp_path,
                                                                                                      shm_dir):
    """The agent writes its own record over the file index's lease once the trainer's last connection closed (a
    writer that starts then waits for it instead of being refused). A trainer that was only between connections
    (a handoff timed out; it reconnects for its next save) still holds the lease: its record must say so again when
    it comes back to the link, or when the agent closes the link while the trainer still runs; not once the
    trainer is dead (the lease then goes with the agent's descriptors)."""
    import fcntl

    from tiered_ckpt.agent.links import CLEANER, Link

    lease = tmp_path / "lease"
    lease.write_text("the trainer's record")
    alive = tmp_path / "trainer.lock"  # what the trainer's client holds while its engine is open
    held = os.open(alive, os.O_RDWR | os.O_CREAT, 0o600)
    fcntl.flock(held, fcntl.LOCK_EX)

    async def until(condition, what: str) -> None:
        deadline = asyncio.get_running_loop().time() + 20
        while not condition():
            assert asyncio.get_running_loop().time() < deadline, what
            await asyncio.sleep(0.02)

    try:
        async with job_and_agent(tmp_path, shm_dir) as (job, folder, server):
            for step in (3, 4, 5):
                await job.commit.begin(step, ["host", "disk"])
                channel = await connect(folder, start=False, timeout=5)
                try:
                    fd = os.open(lease, os.O_RDWR)
                    await channel.send({"op": "drain", "id": step, "order": job.order(step).to_wire(),
                                        "trainer": str(alive)}, [fd])
                    os.close(fd)
                    reply, _ = await channel.recv()
                    assert reply == {"op": "accepted", "id": step}
                    assert lease.read_text() == "the trainer's record", step
                    await job.commit.mark_durable(step, "host")  # (its drain runs: the link closes once detached)
                    if step == 5:  # the trainer dies (its lock goes), then its connection closes
                        os.close(held)
                        held = -1
                finally:
                    channel.close()
                if step == 3:  # its last connection closed: the agent's record; step 4 comes back to the link
                    await until(lambda: lease.read_text().startswith(CLEANER) or not server.links, "no record")
                else:  # the link closes once drained and detached
                    await until(lambda: not server.links, "the link stays")
            # step 4's link closed while the trainer ran: its record was put back (step 5 then found it); step 5's
            # closed once the trainer was dead: the agent's record stays (the lease went with the agent's descriptors)
            assert lease.read_text().startswith(CLEANER)
    finally:
        if held >= 0:
            os.close(held)
    # the link itself, back while it is still open (its drains running)
    record = tmp_path / "lease2"
    record.write_text("the trainer's record")
    fd = os.open(record, os.O_RDWR)
    try:
        link = Link(order=job.order(3), io=None, index=None, commit=None, retention=None, lease_fds=[fd])
        link.attach("first connection")
        link.detach("first connection")
        assert record.read_text().startswith(CLEANER) and link.trainer_record == b"the trainer's record"
        link.trainer_gone()  # (said twice: the trainer's record is still the one kept)
        link.attach("reconnected")
        assert record.read_text() == "the trainer's record" and link.attached
    finally:
        os.close(fd)


async def test_a_trainer_that_closes_its_connection_mid_handoff_is_detached(tmp_path, shm_dir):
    """The trainer's handoff timed out and it closed the connection while the agent was still taking the save (the
    agent's "accepted" then fails to send). The link must not stay attached to that dead connection: the drain goes
    on as journaled, the agent sees the trainer gone (here: abandons the order, whose memory tier never commits,
    instead of waiting out commit_timeout), and the link closes."""
    async with job_and_agent(tmp_path, shm_dir) as (job, folder, server):
        await job.commit.begin(3, ["host", "disk"])
        order = job.order(3)
        channel = await connect(folder, start=False, timeout=5)
        await channel.send({"op": "drain", "id": 3, "order": order.to_wire(), "trainer": ""})
        channel.close()  # gone before the answer
        deadline = asyncio.get_running_loop().time() + 10
        while not server.links:  # the agent takes the handoff (the "accepted" it sends then finds no one)
            assert asyncio.get_running_loop().time() < deadline, "the agent never took the handoff"
            await asyncio.sleep(0.005)
        deadline = asyncio.get_running_loop().time() + 20
        while server.links or (await agent_status(folder))["drains"]:
            assert asyncio.get_running_loop().time() < deadline, (
                f"links {[(k[1], link.attached, link.pending) for k, link in server.links.items()]}")
            await asyncio.sleep(0.05)
