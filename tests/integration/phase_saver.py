"""A trainer for the kill-at-every-phase test (test_agent_phases.py): with [engine] agent = "on", saves step 1 and
waits for every tier, then step 2 the same way, printing "committed 1", "host 2" (step 2 committed on the memory
tier) and "done 2 <tiers committed>". The test kills it (or its agent) at a phase through TIERED_CKPT_FAULT."""
import asyncio
import sys

import torch

import tiered_ckpt as tc

N = 1 << 16  # 256 KiB: four parts of 64 KiB


def state(step: int) -> dict[str, torch.Tensor]:
    return {"w": torch.arange(N, dtype=torch.float32) + 1000 * step}


async def main(config: str) -> None:
    async with tc.Engine.from_toml(config) as engine:
        await (await engine.save(1, state(1))).wait()
        print("committed 1", flush=True)
        handle = await engine.save(2, state(2))
        await handle.wait("host")
        print("host 2", flush=True)
        await handle.wait()
        print("done 2", " ".join(handle.committed_on), flush=True)


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1]))
