"""Helper process for test_crash: commits step 1, then starts step 2 and waits to be killed."""
import asyncio
import sys

import torch

import tiered_ckpt as tc


def state(value: float) -> dict:
    return {"w": torch.full((6 * 2**20,), value), "v": torch.full((1000,), value, dtype=torch.float64)}


async def main(config: str) -> None:
    async with tc.Engine.from_toml(config) as engine:
        await (await engine.save(1, state(1.0))).wait()
        print("committed 1", flush=True)
        handle = await engine.save(2, state(2.0))
        print("staged 2", flush=True)
        await handle.wait()
        print("committed 2", flush=True)
        await asyncio.sleep(60)


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1]))
