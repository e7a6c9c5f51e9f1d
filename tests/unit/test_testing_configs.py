"""The tests' one config builder (tiered_ckpt/testing/configs.py): what a short spec fills in, and the same
stack as a Config, as a mapping and as a TOML file."""
import pytest

import tiered_ckpt as tc
from tiered_ckpt.config import load_config
from tiered_ckpt.testing.configs import faults, stack, stack_dict, toml_text, write_toml


def test_a_bare_stack_is_memory_and_local_under_the_folder(tmp_path, shm_dir):
    config = stack(tmp_path, shm=shm_dir)
    assert (config.engine.job, config.engine.index, config.engine.part_size) == ("test", f"file://{tmp_path}/index",
                                                                                 64 << 10)
    assert [(t.name, t.kind, t.options.path) for t in config.tiers] == [
        ("host", "memory", str(shm_dir / "host")), ("disk", "local", str(tmp_path / "disk"))]


def test_specs_name_kinds_and_keys_and_engine_keys_are_keywords(tmp_path):
    raw = stack_dict(tmp_path, "cold:local", {"kind": "memory", "keep_last": 2, "capacity": "1GiB"}, "faulty",
                     job="gpt", max_inflight=2, part_size=None)
    assert raw["engine"] == {"job": "gpt", "index": f"file://{tmp_path}/index", "max_inflight": 2}
    assert raw["tiers"] == [
        {"name": "cold", "kind": "local", "path": str(tmp_path / "cold")},
        {"name": "host", "kind": "memory", "path": str(tmp_path / "host"), "keep_last": 2, "capacity": "1GiB"},
        {"name": "disk", "kind": "faulty", "path": str(tmp_path / "disk"),
         "control": str(tmp_path / "disk.faults.json")}]
    assert faults(raw).path == tmp_path / "disk.faults.json" == faults(stack(tmp_path, "faulty")).path
    with pytest.raises(ValueError, match="no faulty tier named 'cold'"):
        faults(raw, "cold")


def test_the_toml_file_parses_to_the_same_config(tmp_path, shm_dir):
    raw = stack_dict(tmp_path, {"kind": "memory", "keep_last": 2, "fsync": False},
                     {"kind": "redis", "urls": ["redis://127.0.0.1:1/0"], "backoff": 0.5}, "faulty", shm=shm_dir,
                     job="gpt", events_log=str(tmp_path / 'quo"te.jsonl'), save_on_sigterm=True)
    path = write_toml(tmp_path / "sub" / "c.toml", raw)
    assert path.read_text() == toml_text(raw) and '.jsonl"\nsave_on_sigterm = true\n' in toml_text(raw)
    parsed, built = load_config(path), stack(tmp_path, *raw["tiers"], **raw["engine"])
    assert parsed.tiers == built.tiers and parsed.engine == built.engine
    assert parsed.engine.events_log.endswith('quo"te.jsonl')
    assert parsed.tiers[1].options.urls == ("redis://127.0.0.1:1/0",)


@pytest.mark.parametrize("spec", [{"name": "x"}, 3, ""])
def test_a_spec_without_a_kind_is_refused(tmp_path, spec):
    with pytest.raises((ValueError, tc.ConfigError)):
        stack(tmp_path, spec)


def test_a_value_toml_cannot_hold_is_refused(tmp_path):
    with pytest.raises(TypeError, match="no TOML value"):
        toml_text(stack_dict(tmp_path, events_log={"a": 1}))
