from pathlib import Path

import pytest

import tiered_ckpt as tc
from tiered_ckpt.sizes import parse_size

REPO = Path(__file__).resolve().parents[2]


def write(tmp_path: Path, text: str) -> Path:
    p = tmp_path / "tiers.toml"
    p.write_text(text)
    return p


GOOD = """
[engine]
job = "gpt"
part_size = "1MiB"

[[tiers]]
name = "host"
kind = "memory"
path = "/dev/shm/x"
capacity = "2GiB"
keep_last = 2

[[tiers]]
name = "disk"
kind = "local"
path = "./ckpt"
every = 2
"""


def test_good_config_parses_sizes_and_tiers(tmp_path):
    cfg = tc.load_config(write(tmp_path, GOOD))
    assert cfg.engine.job == "gpt" and cfg.engine.part_size == 2**20
    assert [t.name for t in cfg.tiers] == ["host", "disk"]
    assert cfg.tiers[0].options.capacity == 2 * 2**30 and cfg.tiers[0].keep_last == 2
    assert cfg.tiers[1].every == 2 and cfg.tiers[1].options.fsync is True


def test_overrides_replace_engine_keys(tmp_path):
    assert tc.load_config(write(tmp_path, GOOD), job="other").engine.job == "other"
    with pytest.raises(tc.ConfigError, match="engine"):
        tc.load_config(write(tmp_path, GOOD), nonsense=1)


@pytest.mark.parametrize("text, key", [
    ("[engine\njob = 1", None),  # syntax
    (GOOD.replace('job = "gpt"', 'job = "gpt"\nturbo = true'), "engine.turbo"),
    (GOOD.replace('capacity = "2GiB"', "capacity = true"), "tiers.host.capacity"),
    (GOOD.replace('capacity = "2GiB"', 'capacity = "lots"'), "tiers.host.capacity"),
    (GOOD.replace("every = 2", 'every = "2"'), "tiers.disk.every"),
    (GOOD.replace('kind = "local"', 'kind = "floppy"'), "tiers.disk.kind"),
    (GOOD.replace('path = "./ckpt"\n', ""), "tiers.disk.path"),
    (GOOD.replace('job = "gpt"', 'job = "../etc"'), "engine.job"),
    (GOOD.replace("keep_last = 2", "keep_last = 0"), "tiers.host.keep_last"),
    (GOOD.replace('name = "disk"', 'name = "host"'), "tiers.name"),
    (GOOD.replace('part_size = "1MiB"', 'part_size = "1KiB"'), "engine.part_size"),
    ("[engine]\njob = 'x'\n", "tiers"),
    (GOOD.replace('path = "./ckpt"', 'path = "${TIERED_CKPT_UNSET_VAR}"'), "tiers[1].path"),
])
def test_bad_config_names_the_key(tmp_path, text, key):
    path = write(tmp_path, text)
    with pytest.raises(tc.ConfigError) as err:
        tc.load_config(path)
    assert str(path) in str(err.value)
    if key:
        assert err.value.key == key, str(err.value)
    assert isinstance(err.value, ValueError)


def test_missing_file_is_a_config_error(tmp_path):
    with pytest.raises(tc.ConfigError, match="not found"):
        tc.load_config(tmp_path / "nope.toml")


def test_env_vars_expand(tmp_path, monkeypatch):
    monkeypatch.setenv("CKPT_DIR", str(tmp_path / "d"))
    cfg = tc.load_config(write(tmp_path, GOOD.replace('path = "./ckpt"', 'path = "${CKPT_DIR}/disk"')))
    assert cfg.tiers[1].options.path == f"{tmp_path}/d/disk"


@pytest.mark.parametrize("preset", sorted(p.name for p in (REPO / "tiers").glob("*.toml")))
def test_shipped_presets_parse(preset, monkeypatch):
    monkeypatch.setenv("TIERED_CKPT_JOB", "gpt")
    monkeypatch.setenv("TIERED_CKPT_SHARED", "/shared")
    cfg = tc.load_config(REPO / "tiers" / preset)
    assert cfg.tiers


@pytest.mark.parametrize("text, value", [("64MiB", 64 * 2**20), ("1GB", 10**9), ("1.5KiB", 1536), (7, 7)])
def test_parse_size(text, value):
    assert parse_size(text) == value


@pytest.mark.parametrize("bad", ["-1", "12 parsecs", "", True, 1.5, -3])
def test_parse_size_rejects(bad):
    with pytest.raises(ValueError):
        parse_size(bad)
