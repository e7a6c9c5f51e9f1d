"""The load's broadcast plan (load/broadcast.py `plan_broadcasts`), which every rank computes from every rank's
wants and node holdings: who reads each part, and who it is sent to. The ranks nearest a saved rank's parts are
found from who holds what per tier; checked against the rule itself (each rank's fastest tier holding the parts,
the ranks at the fastest of those), for random worlds, holdings and tier orders, tiers a rank's holdings do not
name (shared to it) included."""
import random

import pytest

from tiered_ckpt.load.broadcast import plan_broadcasts, tiers_for


def _oracle(wanted, holdings=(), order=(), partly=()):
    needers, lengths = {}, {}
    for rank, parts in enumerate(wanted):
        for key, length in parts:
            needers.setdefault(key, []).append(rank)
            lengths[key] = length
    world = len(wanted)
    load, plan = [0] * world, []
    for key in sorted(needers):
        members = tuple(needers[key])
        if holdings:
            levels = []
            for r in range(world):
                near = tiers_for(order, holdings[r], key[0])
                levels.append(order.index(near[0]) if near else len(order))
            best = {r for r in range(world) if levels[r] == min(levels)}
            near = [r for r in members if r in best] or sorted(best)
        else:
            near = list(members)
        reader = min(near, key=lambda r: (-(partly[r].get(key, lengths[key]) if partly else 0), load[r], r))
        members = tuple(sorted({*members, reader}))
        if len(members) > 1:
            load[reader] += lengths[key]
            plan.append((key, members, reader))
    return plan, lengths


@pytest.mark.parametrize("seed", range(30))
def test_the_plan_is_the_rule_applied_to_every_rank(seed):
    rng = random.Random(seed)
    world, saved = rng.randint(1, 12), rng.randint(1, 12)
    order = rng.sample(["host", "disk", "peer", "s3"], rng.randint(1, 4))
    local = [t for t in order if t in ("host", "disk") or rng.random() < 0.3]
    holdings = []
    for r in range(world):
        mine = {}
        for t in local:
            if rng.random() < 0.9:  # (a rank whose holdings do not name a tier reads it as shared)
                mine[t] = frozenset(s for s in range(saved) if rng.random() < 0.3)
        holdings.append(mine)
    length = {(s, p): rng.randint(1, 100) for s in range(saved) for p in range(2)}  # (a part's, whoever wants it)
    wanted = [[(key, n) for key, n in length.items() if rng.random() < 0.3] for _ in range(world)]
    for r in range(1, world):  # ranks that want what rank 0 wants send nothing: rank 0's list stands for theirs
        if rng.random() < 0.4:
            wanted[r] = wanted[0]
    partly = [{key: rng.randint(1, n) for key, n in w if rng.random() < 0.2} for w in wanted]
    for args in ((wanted, holdings, order), (wanted, holdings, order, partly), (wanted,)):
        assert plan_broadcasts(*args) == _oracle(*args)
