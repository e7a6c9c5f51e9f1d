"""Helper process for test_readonly_open, run inside its own mount namespace (`unshare --mount`): the disk tier's
folder is a read-only bind mount from the start. Engines open on it with each role; prints one JSON line: the
warnings each open logged, what the memory tier's folder holds after the opens, and the first save's error."""
import asyncio
import json
import logging
import subprocess
import sys
from pathlib import Path

import torch

import tiered_ckpt as tc


class Kept(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


async def main(root: Path) -> None:
    disk = root / "disk"
    disk.mkdir(parents=True)
    subprocess.run(["mount", "--bind", str(disk), str(disk)], check=True)
    subprocess.run(["mount", "-o", "remount,bind,ro", str(disk)], check=True)
    config = root / "tiers.toml"
    config.write_text(f"""
[engine]
job = "ro"
index = "file://{root}/index"
part_size = "64KiB"
[[tiers]]
name = "host"
kind = "memory"
path = "{root}/shm"
[[tiers]]
name = "disk"
kind = "local"
path = "{disk}"  # a read-only copy: the folder exists
""")
    kept = Kept()
    logging.getLogger("tiered_ckpt").addHandler(kept)
    warned = {}
    for role in ("reader", "auto"):
        kept.messages.clear()
        async with tc.Engine.from_toml(config, role=role):
            warned[role] = list(kept.messages)
    created = sorted(str(p.relative_to(root)) for p in root.rglob("*") if p != config)
    async with tc.Engine.from_toml(config) as engine:
        try:
            await engine.save(1, {"w": torch.ones(1000)})
            error = None
        except tc.TierError as e:
            error = str(e)
    print(json.dumps({"warned": warned, "created": created, "save": error}), flush=True)


if __name__ == "__main__":
    asyncio.run(main(Path(sys.argv[1])))
