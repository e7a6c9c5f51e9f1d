"""BlockedDict is a dict (every operation agrees with one), cut into blocks; all_distinct is len(set(x)) == len(x)."""
import random

import pytest

from tiered_ckpt.release import BlockedDict, by_hash, by_index, by_rank_offset
from tiered_ckpt.manifest.pieces import all_distinct


@pytest.mark.parametrize("block", [by_index, lambda k: k % 7, by_hash])
def test_a_blocked_dict_answers_as_a_dict_does(block):
    rng = random.Random(5)
    plain: dict[int, int] = {}
    blocked: BlockedDict[int, int] = BlockedDict(block)
    for n in range(20000):
        key = rng.randrange(300000)
        op = rng.random()
        if op < 0.6:
            plain[key] = blocked[key] = n
        elif op < 0.8 and plain:
            gone = rng.choice(list(plain)) if n % 50 == 0 else key
            if gone in plain:
                del plain[gone]
                del blocked[gone]
            else:
                with pytest.raises(KeyError):
                    del blocked[gone]
        else:
            assert blocked.get(key) == plain.get(key) and (key in blocked) == (key in plain)
            assert blocked.setdefault(key, -n) == plain.setdefault(key, -n)
    assert len(blocked) == len(plain) and dict(blocked.items()) == plain and sorted(blocked) == sorted(plain)
    with pytest.raises(KeyError):
        blocked[-1]
    assert blocked.pop(next(iter(plain))) == plain.pop(next(iter(plain)))
    blocked.release()
    assert len(blocked) == 0 and list(blocked) == [] and blocked.get(1) is None


def test_a_rank_offset_key_blocks_by_rank_and_stream_window():
    assert by_rank_offset((3, 64)) == by_rank_offset((3, (1 << 22) - 64)) != by_rank_offset((3, 1 << 22))
    assert by_rank_offset((3, 64)) != by_rank_offset((4, 64))


class Colliding:
    """Equal hashes for every value: all_distinct must compare the values themselves."""

    def __init__(self, value: int):
        self.value = value

    def __hash__(self) -> int:
        return 7

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Colliding) and other.value == self.value


def test_all_distinct_is_a_sets_answer():
    paths = [f"model.layers.{i}.weight" for i in range(50000)]
    assert all_distinct([]) and all_distinct(paths[:1]) and all_distinct(paths)
    twice = paths + [paths[31234]]
    random.Random(1).shuffle(twice)
    assert not all_distinct(twice)
    assert all_distinct([Colliding(i) for i in range(5)])
    assert not all_distinct([Colliding(1), Colliding(2), Colliding(1)])
