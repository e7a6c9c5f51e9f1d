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
    # two tiers on one folder (a trailing slash is the same folder): each took the other's copies for leftovers
    (GOOD.replace('path = "./ckpt"', 'path = "/dev/shm/x/"'), "tiers.disk.path"),
    (GOOD + '[[tiers]]\nname = "s3a"\nkind = "s3"\nbucket = "b"\nprefix = "run/"\n'
            '[[tiers]]\nname = "s3b"\nkind = "s3"\nbucket = "b"\nprefix = "run"\n', "tiers.s3b.prefix"),
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


# -- every number in range (issue items 8 and 9) ------------------------------------------------------------
def every_kind(tmp_path) -> dict:
    """A config with one tier of each built-in kind (nothing is connected: only parsed)."""
    return {"engine": {"job": "j", "index": f"file://{tmp_path}/index"},
            "tiers": [{"name": "host", "kind": "memory", "path": str(tmp_path / "shm")},
                      {"name": "disk", "kind": "local", "path": str(tmp_path / "disk")},
                      {"name": "peer", "kind": "redis", "urls": ["redis://127.0.0.1:1/0"]},
                      {"name": "s3", "kind": "s3", "bucket": "b"},
                      {"name": "drill", "kind": "faulty", "path": str(tmp_path / "drill"),
                       "control": str(tmp_path / "faults.json")}]}


def test_every_kind_has_a_tier_of_each_built_in_kind(tmp_path):
    from tiered_ckpt.tier_kinds import BUILTIN

    assert sorted(t["kind"] for t in every_kind(tmp_path)["tiers"]) == sorted(BUILTIN)


def numeric_fields():
    """(section, tier name or None, field) of every int and float field of every config dataclass."""
    import dataclasses
    import typing

    from tiered_ckpt.config import EngineConfig, TierConfig
    from tiered_ckpt.tier_kinds import driver_class

    classes = [("engine", None, EngineConfig), ("tiers", "disk", TierConfig)]
    classes += [("tiers", name, driver_class(kind).Options)
                for name, kind in (("host", "memory"), ("disk", "local"), ("peer", "redis"), ("s3", "s3"),
                                           ("drill", "faulty"))]
    for section, tier, cls in classes:
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            kinds = set(typing.get_args(hints[f.name])) or {hints[f.name]}
            if kinds & {int, float} and bool not in kinds:
                yield section, tier, f


def out_of_range(f) -> list:
    """Values field `f` must refuse: nan and ±inf for a float, and the first value past each declared bound."""
    import typing

    floats = float in (set(typing.get_args(f.type)) | {f.type}) or "float" in str(f.type)
    bad = [float("nan"), float("inf"), -float("inf")] if floats else []
    if "min" in f.metadata:
        bad.append(f.metadata["min"] - (0.5 if floats else 1))
    if "above" in f.metadata:
        bad.append(f.metadata["above"])
    if "max" in f.metadata:
        bad.append(f.metadata["max"] + 1)
    return [v for v in bad if not (f.metadata.get("size") and isinstance(v, (int, float)) and v < 0)]


FIELDS = list(numeric_fields())


@pytest.mark.parametrize("section, tier, f", FIELDS, ids=[f"{t or s}.{f.name}" for s, t, f in FIELDS])
def test_every_number_declares_its_range(section, tier, f):
    assert {"min", "above"} & set(f.metadata), f"{f.name}: declare a lower bound in the field's metadata"


@pytest.mark.parametrize("section, tier, f", FIELDS, ids=[f"{t or s}.{f.name}" for s, t, f in FIELDS])
def test_every_number_out_of_range_names_its_key_from_toml_and_from_code(tmp_path, section, tier, f):
    import dataclasses

    from tiered_ckpt.config import parse_config

    good = parse_config(every_kind(tmp_path))
    for value in out_of_range(f):
        raw = every_kind(tmp_path)
        table = raw["engine"] if section == "engine" else next(t for t in raw["tiers"] if t["name"] == tier)
        table[f.name] = value
        key = f"engine.{f.name}" if section == "engine" else f"tiers.{tier}.{f.name}"
        with pytest.raises(tc.ConfigError) as err:
            parse_config(raw)
        assert err.value.key == key, (value, str(err.value))
        # the same number set in code: Engine(config) checks it too
        if section == "engine":
            bad = dataclasses.replace(good, engine=dataclasses.replace(good.engine, **{f.name: value}))
        else:
            tiers = [t if t.name != tier else (
                dataclasses.replace(t, **{f.name: value}) if f.name in {x.name for x in dataclasses.fields(t)}
                else dataclasses.replace(t, options=dataclasses.replace(t.options, **{f.name: value})))
                for t in good.tiers]
            bad = dataclasses.replace(good, tiers=tuple(tiers))
        with pytest.raises(tc.ConfigError) as err:
            tc.Engine(bad)
        assert err.value.key == key, (value, str(err.value))


@pytest.mark.parametrize("tier, key, value", [
    ("s3", "concurrency", 0),  # every multipart upload, listing and delete waited on a zero-sized semaphore
    ("peer", "chunk_size", 0),
    ("host", "capacity", 0), ("disk", "capacity", 0),
    ("host", "path", ""), ("disk", "path", ""), ("drill", "path", ""),  # the current folder
    ("drill", "control", ""),
])
def test_zero_sizes_and_empty_paths_are_refused_when_parsed(tmp_path, tier, key, value):
    from tiered_ckpt.config import parse_config

    raw = every_kind(tmp_path)
    next(t for t in raw["tiers"] if t["name"] == tier)[key] = value
    with pytest.raises(tc.ConfigError) as err:
        parse_config(raw)
    assert err.value.key == f"tiers.{tier}.{key}", str(err.value)


def test_a_bare_file_index_is_refused(tmp_path):
    from tiered_ckpt.config import parse_config

    raw = every_kind(tmp_path)
    raw["engine"]["index"] = "file://"
    with pytest.raises(tc.ConfigError, match="names no folder") as err:
        parse_config(raw)
    assert err.value.key == "engine.index"


@pytest.mark.parametrize("option", ["failover_timeout=nan", "failover_timeout=inf", "wait_timeout=nan",
                                    "failover_timeout=-1"])
def test_redis_url_options_must_be_finite(make_config, tmp_path, capsys, option):
    """failover_timeout=nan retried an unreachable index forever: Engine.open() never returned."""
    from tiered_ckpt import cli

    url = f"redis://:p@ss:w/rd@127.0.0.1:1/0?{option}"
    with pytest.raises(tc.ConfigError, match="finite number") as err:
        tc.Engine(make_config(index=url))
    assert err.value.key == "engine.index" and "ss:w" not in str(err.value)
    path = tmp_path / "c.toml"
    path.write_text(f'[engine]\nindex = "{url}"\n[[tiers]]\nname = "d"\nkind = "local"\npath = "{tmp_path}/d"\n')
    assert cli.main(["config", "check", str(path)]) == 2
    err_text = capsys.readouterr().err
    assert "engine.index" in err_text and "finite number" in err_text and "ss:w" not in err_text


# -- retention rules beside keep_last ------------------------------------------------------------------------------
@pytest.mark.parametrize("disk, key", [
    ({"keep_last": 2, "keep_best": 3}, "tiers.disk.best_metric"),  # keep_best needs a metric
    ({"keep_last": 2, "best_metric": "val_loss"}, "tiers.disk.best_metric"),  # and a metric needs keep_best
    ({"keep_last": 2, "keep_best": 3, "best_metric": ""}, "tiers.disk.best_metric"),
    ({"keep_last": 2, "keep_best": 3, "best_metric": "val_loss", "best_mode": "median"}, "tiers.disk.best_mode"),
    ({"keep_best": 3, "best_metric": "val_loss"}, "tiers.disk.keep_best"),  # without keep_last all is kept anyway
    ({"keep_every": 1000}, "tiers.disk.keep_every"),
    ({"keep_last": 2, "keep_best": 0, "best_metric": "val_loss"}, "tiers.disk.keep_best"),
    ({"keep_last": 2, "keep_every": 0}, "tiers.disk.keep_every"),
    ({"keep_last": 2, "keep_best": 1, "best_metric": "acc", "best_mode": "max"}, "tiers.disk.best_metric"),  # host's
])
def test_retention_rules_are_checked_naming_the_key_from_toml_and_from_code(tmp_path, disk, key):
    import dataclasses

    from tiered_ckpt.config import parse_config

    raw = every_kind(tmp_path)
    raw["tiers"][0].update({"keep_last": 1, "keep_best": 1, "best_metric": "val_loss"})  # host: the job's metric
    with pytest.raises(tc.ConfigError) as err:
        parse_config({**raw, "tiers": [raw["tiers"][0], {**raw["tiers"][1], **disk}]})
    assert err.value.key == key, str(err.value)
    good = parse_config({**raw, "tiers": raw["tiers"][:2]})
    bad = dataclasses.replace(good, tiers=(good.tiers[0], dataclasses.replace(good.tiers[1], **disk)))
    with pytest.raises(tc.ConfigError) as err:
        tc.Engine(bad)
    assert err.value.key == key, str(err.value)


def test_retention_rules_parse_and_config_check_prints_them(tmp_path, capsys):
    from tiered_ckpt.cli import main

    path = tmp_path / "t.toml"
    path.write_text(f"""
[engine]
index = "file://{tmp_path}/index"
[[tiers]]
name = "disk"
kind = "local"
path = "{tmp_path}/disk"
keep_last = 2
keep_best = 3
best_metric = "val_loss"
keep_every = 1000
""")
    [disk] = tc.load_config(path).tiers
    assert (disk.keep_last, disk.keep_best, disk.best_metric, disk.best_mode, disk.keep_every) == \
        (2, 3, "val_loss", "min", 1000)
    assert main(["config", "check", str(path)]) == 0
    keys = {k.strip(): v.strip() for k, v in (line.split("=", 1) for line in capsys.readouterr().out.splitlines()
                                              if "=" in line)}
    assert (keys["keep_best"], keys["best_metric"], keys["best_mode"], keys["keep_every"]) == ("3", "val_loss", "min",
                                                                                              "1000")


def test_a_tier_named_index_is_refused_naming_the_key():
    from tiered_ckpt.config import parse_config
    from tiered_ckpt.errors import ConfigError

    # a checkpoint's status lists an unreadable index record under "index" in `failed`: no tier may be called so
    with pytest.raises(ConfigError) as refused:
        parse_config({"engine": {}, "tiers": [{"name": "index", "kind": "local", "path": "/tmp/x"}]})
    assert "reserved" in str(refused.value) and "tiers.index.name" in str(refused.value)


def test_a_config_built_in_code_is_checked_for_shared_names_and_folders(tmp_path):
    import dataclasses

    from tiered_ckpt.config import check_config

    cfg = tc.load_config(write(tmp_path, GOOD))
    host, disk = cfg.tiers
    with pytest.raises(tc.ConfigError, match="used twice"):
        check_config(dataclasses.replace(cfg, tiers=(host, dataclasses.replace(disk, name="host"))))
    same = dataclasses.replace(disk, options=dataclasses.replace(disk.options, path="/dev/shm/x"))
    with pytest.raises(tc.ConfigError, match="same storage as tier 'host'"):
        check_config(dataclasses.replace(cfg, tiers=(host, same)))
