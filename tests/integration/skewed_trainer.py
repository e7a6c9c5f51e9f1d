"""Helper process for test_gc_clocks: a trainer whose wall clock is two hours behind (time.time shifted for
the whole process, as on a machine whose clock drifted). It commits step 1, then saves step 2, whose disk
writes the test holds (its disk is a faulty tier). Prints the outcome of step 2 as JSON."""
import asyncio
import json
import sys
import time

_real = time.time
time.time = lambda: _real() - 7200  # noqa: E731  (before the library is imported)

import torch  # noqa: E402

import tiered_ckpt as tc  # noqa: E402


async def main(config: str) -> None:
    async with tc.Engine.from_toml(config) as engine:
        await (await engine.save(1, {"w": torch.ones(100_000)})).wait()
        handle = await engine.save(2, {"w": torch.full((100_000,), 2.0)})
        try:
            await handle.wait()
            print(json.dumps({"step2": "ok"}), flush=True)
        except tc.SaveError as e:
            print(json.dumps({"step2": str(e)}), flush=True)


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1]))
