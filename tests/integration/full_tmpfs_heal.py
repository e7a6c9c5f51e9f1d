"""Helper process for test_heal_full_tmpfs, run inside its own mount namespace (`unshare --mount`): the memory
tier lives on a 2 MiB tmpfs. Step 1 is saved; its memory copy is then lost (the folder removed, as a reboot
does) and the tmpfs filled up but for room for a few of its parts; a load from the disk heals the memory copy,
and runs out of space part-way. Prints one JSON line: the heal's report and what the memory tier holds."""
import asyncio
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import torch

import tiered_ckpt as tc

PARTS = 8  # of 64 KiB each


def state(value: float) -> dict:
    return {"w": torch.full((PARTS * 2**16 // 4,), value)}


async def main(root: Path) -> None:
    shm = root / "shm"
    shm.mkdir(parents=True)
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(shm)], check=True)
    config = root / "tiers.toml"
    config.write_text(f"""
[engine]
job = "heal"
index = "file://{root}/index"
part_size = "64KiB"
stage_in_memory_tier = false
[[tiers]]
name = "host"
kind = "memory"
path = "{shm}/host"
keep_last = 2
[[tiers]]
name = "disk"
kind = "local"
path = "{root}/disk"
""")
    async with tc.Engine.from_toml(config) as engine:
        await (await engine.save(1, state(1.0))).wait()
    step = shm / "host" / "heal" / "step-000000000001"
    shutil.rmtree(step)  # the memory copy is lost
    free = os.statvfs(shm).f_bavail * os.statvfs(shm).f_frsize
    filler = shm / "filler"
    with open(filler, "wb") as f:  # room for three parts and a half
        f.write(bytes(free - 3 * 2**16 - 2**15))
    room = os.statvfs(shm).f_bavail * os.statvfs(shm).f_frsize
    async with tc.Engine.from_toml(config) as engine:
        out = {"w": torch.zeros(PARTS * 2**16 // 4)}
        info = await engine.load(out)
        reports = await engine.wait_healed()
    left = sorted(str(p.relative_to(shm)) for p in (shm / "host").rglob("*") if p.is_file())
    print(json.dumps({"loaded": info.step, "tier": info.tier, "exact": bool(torch.all(out["w"] == 1.0)),
                      "errors": [e for r in reports for e in r.errors], "parts": [r.parts for r in reports],
                      "left": left, "room_before": room,
                      "room_after": os.statvfs(shm).f_bavail * os.statvfs(shm).f_frsize}), flush=True)


if __name__ == "__main__":
    asyncio.run(main(Path(sys.argv[1])))
