"""A Redis password never shows, whatever it holds: `@`, `:` and `/` included (the URL's userinfo runs to the
last `@` before the host). Every output path is read: exceptions, log records, `LoadInfo.fallbacks`, and the
CLI's stdout and stderr of ls, verify, gc and config check. Real redis-server processes, real files."""
import asyncio
import logging
from pathlib import Path

import pytest
import redis
import torch

import tiered_ckpt as tc
from tiered_ckpt import cli
from tiered_ckpt.testing.configs import stack_dict, write_toml

PASSWORD = "p@ss:w/rd"
WRONG = "wr@ng:pa/ss"


def shown(text: str, password: str = PASSWORD) -> list[str]:
    """The pieces of `password` (any 4 characters in a row) that `text` shows."""
    return [password[i : i + 4] for i in range(len(password) - 3) if password[i : i + 4] in text]


def url(server, db: int, password: str = PASSWORD) -> str:
    return f"redis://:{password}@127.0.0.1:{server.port}/{db}"


def write_config(tmp_path: Path, shm_dir: Path, server, password: str = PASSWORD, peer=None) -> Path:
    """The index on `server` (db 0), the peer tier on `peer` (default: the same server, db 1)."""
    ring = {"kind": "redis", "urls": [url(peer or server, 1, password)], "retries": 0}
    return write_toml(tmp_path / "c.toml", stack_dict(tmp_path, "memory", ring, "local", shm=shm_dir, job="sec",
                                                      index=url(server, 0, password)))


def state(value: float) -> dict:
    return {"w": torch.full((50_000,), value)}


def run_cli(capsys, *argv: str) -> tuple[int, str]:
    status = cli.main(list(argv))
    out, err = capsys.readouterr()
    return status, out + err


@pytest.fixture
def server(redis_server):
    return redis_server("--requirepass", PASSWORD)


def test_a_password_with_at_colon_and_slash_connects_and_never_shows(tmp_path, shm_dir, server, capsys, caplog):
    config = write_config(tmp_path, shm_dir, server)

    async def save_then_lose_a_chunk_then_load():
        async with tc.Engine.from_toml(config) as engine:
            for step in (1, 2):
                await (await engine.save(step, state(float(step)))).wait()
            peer = redis.Redis(host="127.0.0.1", port=server.port, db=1, password=PASSWORD)
            chunk = sorted(k for k in peer.keys("*step-000000000002*part-000000#*"))[0]
            peer.delete(chunk)  # evicted, say: the load falls back to the next tier
            out = state(0.0)
            with caplog.at_level(logging.WARNING):
                info = await engine.load(out, tiers=["peer", "disk"])
            assert torch.all(out["w"] == 2.0) and info.fallbacks
            return [f.reason for f in info.fallbacks]

    reasons = asyncio.run(save_then_lose_a_chunk_then_load())
    assert all("chunk missing on redis redis://:***@127.0.0.1" in r and not shown(r) for r in reasons), reasons
    assert "fell back" in caplog.text and not shown(caplog.text), caplog.text
    for argv, expected in ((["ls"], 0), (["verify"], 1), (["gc", "--dry-run"], 0)):
        status, text = run_cli(capsys, "-c", str(config), *argv)
        assert status == expected and not shown(text), (argv, text)
    status, text = run_cli(capsys, "-c", str(config), "verify", "2")
    assert status == 1 and "chunk missing on redis redis://:***@127.0.0.1" in text and not shown(text), text
    status, text = run_cli(capsys, "config", "check", str(config))
    assert status == 0 and f"redis://:***@127.0.0.1:{server.port}/0" in text and not shown(text), text
    assert not shown(caplog.text), caplog.text


def test_a_wrong_password_with_at_colon_and_slash_never_shows(tmp_path, shm_dir, server, capsys, caplog):
    config = write_config(tmp_path, shm_dir, server, password=WRONG)

    async def open_it():
        async with tc.Engine.from_toml(config):
            pass

    with pytest.raises(tc.TieredCkptError) as err:
        asyncio.run(open_it())
    assert "refused the credentials" in str(err.value) and not shown(str(err.value), WRONG), str(err.value)
    for argv in (["ls"], ["verify"], ["gc", "--dry-run"]):
        status, text = run_cli(capsys, "-c", str(config), *argv)
        assert status == 2 and "refused the credentials" in text and not shown(text, WRONG), (argv, text)
    assert not shown(caplog.text, WRONG), caplog.text


def test_a_peer_or_index_that_is_down_is_named_without_the_password(tmp_path, shm_dir, server, redis_server,
                                                                    capsys, caplog):
    peer = redis_server("--requirepass", PASSWORD)
    config = write_config(tmp_path, shm_dir, server, peer=peer)

    async def save_while_the_servers_are_down():
        async with tc.Engine.from_toml(config) as engine:
            await (await engine.save(1, state(1.0))).wait()
            peer.stop()
            with caplog.at_level(logging.WARNING):
                handle = await engine.save(2, state(2.0))
                await handle.wait()  # complete on another tier: the peer's failure is in the handle's errors
                server.stop()
                statuses = await engine.statuses()  # from the tiers' manifests, with a warning
            return "; ".join(f"{t}: {e}" for t, e in handle.errors.items()) + repr(handle.errors), statuses

    text, statuses = asyncio.run(save_while_the_servers_are_down())
    assert "peer" in text and "redis://:***@127.0.0.1" in text and not shown(text), text
    assert statuses and "unreachable" in caplog.text and not shown(caplog.text), caplog.text
    for argv in (["ls"], ["verify", "1"], ["gc", "--dry-run"]):
        _, text = run_cli(capsys, "-c", str(config), *argv)
        assert not shown(text), (argv, text)


@pytest.mark.parametrize("bad", ["?failover_timeout=soon", "?wait=-1", ":notaport"])
def test_a_bad_redis_url_is_named_without_the_password(tmp_path, shm_dir, capsys, bad):
    """Errors of the URL itself (a bad option, a port that is not a number) name it with the password hidden."""
    index = f"redis://:{PASSWORD}@127.0.0.1{bad if bad.startswith(':') else ':6379/0' + bad}"
    path = tmp_path / "c.toml"
    path.write_text(f'[engine]\nindex = "{index}"\n[[tiers]]\nname = "peer"\nkind = "redis"\nurls = ["{index}"]\n')
    with pytest.raises(tc.ConfigError) as err:
        tc.Engine(tc.load_config(path))
    assert "redis://:***@127.0.0.1" in str(err.value) and not shown(str(err.value)), str(err.value)
    status, text = run_cli(capsys, "config", "check", str(path))
    assert status == 2 and "redis://:***@127.0.0.1" in text and not shown(text), text
    path.write_text(f'[engine]\nindex = "file://{tmp_path}/ix"\n[[tiers]]\nname = "peer"\nkind = "redis"\n'
                    f'urls = "{index}"\n')
    status, text = run_cli(capsys, "config", "check", str(path))  # a string where a list belongs
    assert status == 2 and "tiers.peer.urls" in text and not shown(text), text
