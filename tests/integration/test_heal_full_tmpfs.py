"""A heal that runs out of space on a real full tmpfs (a memory tier whose machine filled /dev/shm), in a
private mount namespace (full_tmpfs_heal.py): the load itself succeeds from the disk, the heal says which tier
it could not heal, and it takes back every part it wrote of that copy, so the memory tier holds no half copy
and the RAM it took is free again (before: the parts written until the tmpfs filled up stayed)."""
from pathlib import Path

import pytest

from .test_readonly_disk import run_in_mount_namespace

HELPER = str(Path(__file__).with_name("full_tmpfs_heal.py"))


@pytest.mark.timeout(300)
def test_a_heal_that_fills_the_tmpfs_leaves_no_part_of_its_copy(tmp_path):
    result = run_in_mount_namespace(HELPER, tmp_path)
    assert result["loaded"] == 1 and result["tier"] == "disk" and result["exact"], result
    assert result["errors"] and all(e.startswith("host: TierFull") for e in result["errors"]), result
    assert not [f for f in result["left"] if "step-000000000001" in f], result  # no part, no record of the copy
    assert result["room_after"] == result["room_before"], result  # the RAM it took is back
