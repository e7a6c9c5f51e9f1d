"""A trainer for the agent tests: saves steps 1 and 2 with [engine] agent = "on", prints "committed 1" once step 1
is complete everywhere, waits for a line on stdin, then "host 2" once step 2 is committed on the memory tier (the agent has it then), and
(with `kill`) SIGKILLs itself right there, before its disk copy is done."""
import asyncio
import os
import signal
import sys

import torch

import tiered_ckpt as tc


async def main(config: str, mode: str) -> None:
    async with tc.Engine.from_toml(config) as engine:
        await (await engine.save(1, {"w": torch.full((3 * 2**20,), 1.0)})).wait()
        print("committed 1", flush=True)
        await asyncio.to_thread(sys.stdin.readline)  # the test holds the disk's writes meanwhile
        handle = await engine.save(2, {"w": torch.arange(3 * 2**20, dtype=torch.float32)})
        await handle.wait("host")
        print("host 2", flush=True)
        if mode == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        await handle.wait()
        print("done 2", flush=True)


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1], sys.argv[2]))
