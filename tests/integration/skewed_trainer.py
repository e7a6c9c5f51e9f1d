"""Helper process for test_gc_clocks: a trainer whose wall clock is two hours behind (time.time shifted for
the whole process, as on a machine whose clock drifted). It commits step 1, then saves step 2 and holds its
disk write until the test creates the file `go`, printing `holding` once it waits there. Prints the outcome
of step 2 as JSON."""
import asyncio
import json
import sys
import time
from pathlib import Path

_real = time.time
time.time = lambda: _real() - 7200  # noqa: E731  (before the library is imported)

import torch  # noqa: E402

import tiered_ckpt as tc  # noqa: E402
from tiered_ckpt.storage.tiers.local import LocalTier  # noqa: E402


def hold_disk_writes_of_step_2(go: Path) -> None:
    write = LocalTier.write
    said = False

    async def held(self, key, data):
        nonlocal said
        if self.name == "disk" and "step-000000000002/" in key:
            if not said:
                said = True
                print("holding", flush=True)
            while not go.exists():  # the test's signal, not a guess at how long gc takes
                await asyncio.sleep(0.01)
        await write(self, key, data)

    LocalTier.write = held


async def main(config: str, go: Path) -> None:
    async with tc.Engine.from_toml(config) as engine:
        await (await engine.save(1, {"w": torch.ones(100_000)})).wait()
        hold_disk_writes_of_step_2(go)
        handle = await engine.save(2, {"w": torch.full((100_000,), 2.0)})
        try:
            await handle.wait()
            print(json.dumps({"step2": "ok"}), flush=True)
        except tc.SaveError as e:
            print(json.dumps({"step2": str(e)}), flush=True)


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1], Path(sys.argv[2])))
