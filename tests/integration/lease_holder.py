"""Helper process for test_redis_index: opens an engine with role = "writer" on the Redis index given (its writer
lease lasting the seconds given), commits step 1, prints `ready <its fencing epoch>` and waits to be killed
with -9."""
import asyncio
import sys

import torch

import tiered_ckpt as tc


async def main(config: str, lease_seconds: float) -> None:
    engine = tc.Engine.from_toml(config, role="writer")
    engine.store.index.lease_seconds = lease_seconds
    await engine.open()
    await (await engine.save(1, {"w": torch.full((50_000,), 1.0)})).wait()
    print(f"ready {engine.store.index.epoch}", flush=True)
    await asyncio.sleep(3600)


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1], float(sys.argv[2])))
