"""Helper process for test_crash: commits step 1, then saves step 2 and stops inside one chosen phase of
that save, prints `phase <name>` and waits to be killed there. Phases are reached by wrapping the real
code paths of this process, never by wall-clock delays."""
import asyncio
import sys
import time

import torch

import tiered_ckpt as tc
import tiered_ckpt.storage.index.file as file_index
import tiered_ckpt.save.job as saving
from tiered_ckpt.lifecycle.retention import Retention
from tiered_ckpt.storage.tiers.local import LocalTier

STEP2 = "step-000000000002/"


def state(value: float) -> dict:
    return {"w": torch.full((6 * 2**20,), value), "v": torch.full((1000,), value, dtype=torch.float64)}


def reached(phase: str) -> None:
    print(f"phase {phase}", flush=True)


async def hold_forever() -> None:
    await asyncio.sleep(3600)


def arm(phase: str) -> None:
    """Make this process stop in `phase` of the save of step 2."""
    write, apply, atomic_create = LocalTier.write, Retention.apply, file_index._atomic_create
    written: dict[str, int] = {}

    async def held_write(self, key, data):
        if STEP2 not in key:
            return await write(self, key, data)
        if phase == "parts-partly-on-host":
            if self.name == "disk" or written.get(self.name, 0) >= 2:
                if self.name == "host":
                    reached(phase)  # two parts of step 2 are on the memory tier, none on disk
                await hold_forever()
            await write(self, key, data)
            written[self.name] = written.get(self.name, 0) + 1
            return None
        if phase == "host-committed" and self.name == "disk":
            await hold_forever()
        if phase == "manifest-written":
            if self.name == "host":
                await hold_forever()
            await write(self, key, data)
            if key.endswith("manifest.msgpack"):
                reached(phase)  # every part, the checksums and the manifest are on disk; no commit yet
                await hold_forever()
            return None
        if phase == "index-commit" and self.name == "host":
            await hold_forever()
        return await write(self, key, data)

    async def reporting_apply(self, tier, *, finishing=None):
        await apply(self, tier, finishing=finishing)
        if phase == "host-committed" and tier == "host" and finishing == 2:
            reached(phase)  # step 2 is complete on the memory tier; the disk write is held

    def held_create(path):
        if phase == "index-commit" and STEP2.rstrip("/") in str(path):
            reached(phase)  # the durable marker is written; the complete/<tier> record is not
            time.sleep(3600)
        return atomic_create(path)

    def held_stage(*args):
        reached(phase)  # inside the copy into the staging buffer
        time.sleep(3600)

    LocalTier.write = held_write
    Retention.apply = reporting_apply
    file_index._atomic_create = held_create
    if phase == "staging":
        saving.stage = held_stage


async def main(config: str, phase: str) -> None:
    async with tc.Engine.from_toml(config) as engine:
        await (await engine.save(1, state(1.0))).wait()
        print("committed 1", flush=True)
        arm(phase)
        handle = await engine.save(2, state(2.0), lazy=True)
        await handle.wait()
        print("committed 2", flush=True)  # no phase held the save: the test fails on this
        await asyncio.sleep(60)


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1], sys.argv[2]))
