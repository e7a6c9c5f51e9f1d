"""Bad input gets a clear error naming what is at fault, before anything is written."""
import dataclasses
import os
import warnings

import pytest
import torch

import tiered_ckpt as tc
from tiered_ckpt.storage.redis_connect import redact
from tiered_ckpt.testing.configs import stack_dict, write_toml


@pytest.mark.parametrize("job", ["../../x", "ok\n", "a/b", ""])
def test_a_job_name_set_in_code_is_checked_too(make_config, job):
    config = make_config()
    bad = dataclasses.replace(config, engine=dataclasses.replace(config.engine, job=job))
    with pytest.raises(tc.ConfigError, match="engine.job"):
        tc.Engine(bad)


@pytest.mark.parametrize("tier, key", [({"timeout": 0}, "timeout"), ({"timeout": -1.5}, "timeout"),
                                       ({"inflight": 0}, "inflight"), ({"retries": -1}, "retries")])
def test_tier_numbers_out_of_range_name_the_key(make_config, tier, key):
    with pytest.raises(tc.ConfigError, match=rf"tiers\.host\.{key}"):
        make_config(tiers=[tier])


async def test_a_step_beyond_what_the_index_can_order_is_refused(engine):
    with pytest.raises(ValueError, match="2\\*\\*53"):
        await engine.save(2**63, {"w": torch.ones(2)})


@pytest.mark.parametrize("make, what", [(lambda: torch.ones(3).to_sparse(), "layout"),
                                        (lambda: torch.empty(3, device="meta"), "meta device"),
                                        (lambda: torch.nested.nested_tensor([torch.ones(2), torch.ones(3)]), "nested")])
async def test_tensors_that_cannot_be_stored_name_their_key(engine, make, what):
    with pytest.raises(tc.StateError, match=rf"'model/w'.*{what}"):
        await engine.save(1, {"model": {"w": make()}})
    assert [c async for c in engine.list()] == []
    await engine.close()  # nothing in flight: closing raises nothing


@pytest.mark.parametrize("extra, what", [
    ({"name": "caf\udce9"}, r"string at 'extra/name' holds '\\udce9' at position 3, a lone surrogate"),
    ({"caf\udce9": 1}, r"key 'caf\\udce9' under 'extra' holds '\\udce9' at position 3, a lone surrogate"),
    ({2**64: 1}, r"key 18446744073709551616 under 'extra' does not fit in 64 bits"),
    ({-(2**63) - 1: 1}, r"key -9223372036854775809 under 'extra' does not fit in 64 bits"),
])
async def test_values_msgpack_cannot_store_are_refused_at_save_naming_the_key(engine, extra, what):
    """Accepted before, they failed in the background with a raw UnicodeEncodeError or TypeError naming no key."""
    with pytest.raises(tc.StateError, match=what):
        await engine.save(1, {"w": torch.ones(2), "extra": extra})
    assert [c async for c in engine.list()] == []


async def test_a_state_that_contains_itself_is_refused_at_save_naming_the_key(engine):
    looped: dict = {"lr": 0.1}
    looped["again"] = looped
    listed: list = [1]
    listed.append({"inner": listed})
    shared = {"x": 1}  # the same dict in two places is no cycle: saved twice
    await (await engine.save(1, {"w": torch.ones(2), "a": shared, "b": shared})).wait()
    with pytest.raises(tc.StateError, match=r"'extra/again' is 'extra' again: the state contains itself"):
        await engine.save(2, {"w": torch.ones(2), "extra": looped})
    with pytest.raises(tc.StateError, match=r"'hist/1/inner' is 'hist' again"):
        await engine.save(2, {"w": torch.ones(2), "hist": listed})
    deep: dict = {}
    node = deep
    for _ in range(400):  # no cycle, but deeper than msgpack (and the stack) go
        node["d"] = {}
        node = node["d"]
    with pytest.raises(tc.StateError, match=r"'deep/d/d/.*' is nested 256 containers deep"):
        await engine.save(2, {"w": torch.ones(2), "deep": deep})
    assert [c.step async for c in engine.list()] == [1]


def test_a_closed_checkpointer_says_so(make_config):
    ckpt = tc.Checkpointer(make_config())
    ckpt.close()
    with pytest.raises(RuntimeError, match="Checkpointer is closed"):
        ckpt.list()


def test_passwords_are_redacted_from_urls():
    assert redact("redis://user:s3cret@host:6379/0") == "redis://user:***@host:6379/0"
    assert redact("rediss://:s3cret@host:6380") == "rediss://:***@host:6380"
    assert redact("redis://host:6379/0") == "redis://host:6379/0"


@pytest.mark.parametrize("scheme, tail", [("redis", "h:6379/3"), ("rediss+cluster", "h1:7000,h2:7001"),
                                          ("redis+sentinel", "h1:26379,h2:26379/mymaster/2"), ("unix", "/tmp/r.sock")])
def test_a_password_with_at_colon_and_slash_is_parsed_whole_and_redacted_whole(scheme, tail):
    """The userinfo runs to the last '@' before the host: the server gets the whole password, messages none of it."""
    from redis.connection import parse_url as redis_py_parse

    from tiered_ckpt.storage.redis_connect import parse_url

    url = f"{scheme}://al:p@ss:w/rd@{tail}"
    assert redact(url) == f"{scheme}://al:***@{tail}"
    parsed = parse_url(url, key="engine.index")
    if parsed.kind == "single":
        got = redis_py_parse(parsed.plain)
        assert (got["username"], got["password"]) == ("al", "p@ss:w/rd")
        assert got.get("path", got.get("host")) in ("h", "/tmp/r.sock") and got.get("db", 0) in (0, 3)
    else:
        assert (parsed.username, parsed.password) == ("al", "p@ss:w/rd")
        assert parsed.hosts == (("h1", 7000), ("h2", 7001)) or parsed.service == "mymaster"
    assert "p@ss" not in parsed.identity and "w/rd" not in parsed.identity
    assert "p@ss" not in repr(parsed) and "p%40ss" not in repr(parsed)  # a repr in a log or a traceback: no secret


@pytest.mark.parametrize("index", ["redis://127.0.0.1:6399/abc", "redis://127.0.0.1:6399/0/1"])
def test_a_redis_url_whose_database_is_not_a_number_is_refused(tmp_path, index):
    """redis-py drops a database it cannot read and uses 0: perhaps another job's index."""
    path = tmp_path / "t.toml"
    path.write_text(f'[engine]\njob = "j"\nindex = "{index}"\n[[tiers]]\nname = "d"\nkind = "local"\npath = "x"\n')
    with pytest.raises(tc.ConfigError, match="the path names the database, a number") as err:
        tc.load_config(path)
    assert err.value.key == "engine.index"


def test_an_engine_dropped_with_saves_in_flight_warns(make_config, caplog):
    import asyncio

    async def forget_to_close():
        engine = await tc.Engine(make_config()).open()
        await engine.save(1, {"w": torch.ones(10_000)}, lazy=True)
        return engine

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        engine = asyncio.run(forget_to_close())
        del engine
        import gc

        gc.collect()
    assert any(issubclass(w.category, ResourceWarning) and "step 1" in str(w.message)
               and "engine.close()" in str(w.message) for w in caught)
    assert "save of step 1" in caplog.text and "cancelled" in caplog.text  # and in the log, where it is seen


async def test_an_unwritable_index_names_its_directory(make_config, tmp_path):
    if os.geteuid() == 0:
        index = tmp_path / "index-file"
        index.write_text("not a directory")  # root ignores permissions: a file where the folder should be
    else:
        index = tmp_path / "ro"
        index.mkdir(mode=0o500)
    with pytest.raises(tc.TieredCkptError, match=f"index {index}/sub: NotADirectoryError|PermissionError"):
        async with tc.Engine(make_config(index=f"file://{index}/sub")):
            pass


async def test_a_second_writer_on_the_file_index_is_refused_naming_the_holder(make_config):
    async with tc.Engine(make_config()) as first:
        await (await first.save(1, {"w": torch.ones(4)})).wait()
        async with tc.Engine(make_config()) as second:
            out = {"w": torch.zeros(4)}
            assert (await second.load(out)).step == 1  # a reader: fine beside the writer
            with pytest.raises(tc.TieredCkptError, match=rf"already has a writer.*pid {os.getpid()}"):
                await second.save(2, {"w": torch.ones(4)})
        await (await first.save(2, {"w": torch.ones(4)})).wait()  # the writer goes on
    async with tc.Engine(make_config()) as third:  # the lease ended with the first engine
        await (await third.save(3, {"w": torch.ones(4)})).wait()


def test_the_cli_takes_config_and_job_before_or_after_the_subcommand(tmp_path, shm_dir, capsys):
    import asyncio

    from tiered_ckpt import cli

    config = write_toml(tmp_path / "c.toml", stack_dict(tmp_path, "memory", shm=shm_dir, job="a", part_size=None))

    async def save():
        async with tc.Engine.from_toml(config, job="b") as engine:
            await (await engine.save(4, {"w": torch.ones(3)})).wait()

    asyncio.run(save())
    for argv in (["-c", str(config), "--job", "b", "ls"], ["ls", "-c", str(config), "--job", "b"],
                 ["-c", "/nonexistent.toml", "--job", "a", "ls", "-c", str(config), "--job", "b"]):
        assert cli.main(argv) == 0
        out = capsys.readouterr().out
        assert [line.split()[0] for line in out.splitlines() if line.split() and line.split()[0].isdigit()] == ["4"]
