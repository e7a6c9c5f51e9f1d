"""Storage keys are built and parsed in one module; what it builds, it parses back."""
import time

from tiered_ckpt.layout import (
    ParsedKey,
    PartKey,
    incarnation_dir,
    index_dir,
    manifest_key,
    new_session,
    parse_key,
    parse_step_dir,
    part_range,
    rank_meta_key,
    step_dir,
)


def test_keys_parse_back_to_what_built_them():
    assert parse_key(PartKey("gpt", 120, 3, 17).path) == ParsedKey("gpt", 120, "part", 3, 17)
    assert parse_key(manifest_key("gpt", 5)) == ParsedKey("gpt", 5, "manifest")
    assert parse_key(rank_meta_key("gpt", 5, 12)) == ParsedKey("gpt", 5, "checksums", 12)
    assert parse_step_dir(step_dir(2**40)) == 2**40
    folder = incarnation_dir("file:///runs/a/index", new_session())
    assert parse_key(PartKey("gpt", 7, 1, 2, folder).path) == ParsedKey("gpt", 7, "part", 1, 2, folder)
    assert parse_key(manifest_key("gpt", 7, folder)) == ParsedKey("gpt", 7, "manifest", incarnation=folder)
    assert parse_key(rank_meta_key("gpt", 7, 1, folder)) == ParsedKey("gpt", 7, "checksums", 1, incarnation=folder)


def test_incarnations_never_share_a_key_and_sessions_sort_by_time():
    """A zombie of an earlier opening writes under its own folder, never over a newer one's keys; the
    tiers' listing takes the newest session of a step, so session ids must sort by creation time."""
    first = new_session()
    time.sleep(0.002)
    second = new_session()
    assert first < second
    index = "redis://h:6379/0"
    assert PartKey("gpt", 7, 0, 0, incarnation_dir(index, first)).path != \
        PartKey("gpt", 7, 0, 0, incarnation_dir(index, second)).path
    assert index_dir(index) != index_dir("file:///elsewhere")
    assert incarnation_dir(index, first).startswith(index_dir(index) + "/")


def test_foreign_and_temporary_names_are_not_keys():
    for name in ("gpt/step-000000000001/.tmp-manifest.msgpack.1a2b", "gpt/notes.txt", "gpt/step-12/manifest.msgpack",
                 "gpt/step-000000000001/rank-00000/part-000000/x", "gpt/step-000000000001/manifest.msgpack.bak"):
        assert parse_key(name) is None, name
    assert parse_step_dir(".deleting-step-000000000001-ab12") is None


def test_part_ranges_tile_the_stream():
    ranges = [part_range(10_000, 4096, i) for i in range(3)]
    assert ranges == [(0, 4096), (4096, 8192), (8192, 10_000)]
