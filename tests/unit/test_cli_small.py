"""The small operational fixes of issue #31: what `config check` names as known keys, `ls` of an index that
cannot exist, `config` without a subcommand, the bench's many-tensor section only when asked, `export`
refusing an existing file before any work. Real files and `cli.main` in process."""
import dataclasses
from pathlib import Path

from tiered_ckpt import cli
from tiered_ckpt.config import TierConfig
from tiered_ckpt.storage.tiers.registry import driver_class


def test_an_unknown_tier_key_lists_every_key_the_tier_accepts(tmp_path, capsys):
    """A misspelt keep_last in a [[tiers]] table: the error lists keep_last and every key a tier has (name,
    kind, every, retries, ...) beside the driver's own (path, fsync, ...), not the driver's alone."""
    path = tmp_path / "c.toml"
    path.write_text('[engine]\njob = "x"\n[[tiers]]\nname = "disk"\nkind = "local"\npath = "d"\nkeep_lastt = 2\n')
    assert cli.main(["config", "check", str(path)]) == 2
    err = capsys.readouterr().err
    assert "key 'tiers.disk.keep_lastt': unknown key (known: " in err, err
    known = err.split("(known: ")[1].rsplit(")", 1)[0].split(", ")
    expected = ({f.name for f in dataclasses.fields(TierConfig)} - {"options"}
                | {f.name for f in dataclasses.fields(driver_class("local").Options)})
    assert sorted(known) == known and set(known) == expected
    assert {"keep_last", "name", "kind", "every", "retries", "path"} <= set(known)
