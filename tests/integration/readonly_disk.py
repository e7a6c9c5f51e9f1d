"""Helper process for test_readonly_disk, run inside its own mount namespace (`unshare --mount`): the disk
tier's folder is a bind mount that this process remounts read-only in the middle of a save, once the first
part of step 2 is on the disk (as ext4 does with `errors=remount-ro`): the next part's write fails, and
removing the failed parts fails too. Prints one JSON line per phase."""
import asyncio
import json
import subprocess
import sys
from pathlib import Path

import torch

import tiered_ckpt as tc
from tiered_ckpt.storage.tiers.local import LocalTier


def report(**what) -> None:
    print(json.dumps(what), flush=True)


def mount(*args: str) -> None:
    subprocess.run(["mount", *args], check=True)


def state(value: float) -> dict:
    return {"w": torch.full((300_000,), value), "b": torch.full((3, 5), value, dtype=torch.float64)}


def remount_read_only_after_first_part(disk: Path) -> None:
    """Wrap the disk tier's real write: once step 2's first part is written there, the folder turns read-only."""
    write = LocalTier.write

    async def write_then_remount(self, key, data):
        await write(self, key, data)
        if self.name == "disk" and "step-000000000002/" in key and key.endswith("part-000000"):
            mount("-o", "remount,bind,ro", str(disk))

    LocalTier.write = write_then_remount


async def main(root: Path) -> None:
    disk = root / "disk"
    disk.mkdir(parents=True)
    mount("--bind", str(disk), str(disk))
    config = root / "tiers.toml"
    config.write_text(f"""
[engine]
job = "ro"
index = "file://{root}/index"
part_size = "256KiB"
commit_timeout = 30
[[tiers]]
name = "host"
kind = "memory"
path = "{root}/shm"
keep_last = 3
[[tiers]]
name = "disk"
kind = "local"
path = "{disk}"
keep_last = 3
retries = 0
workers = 1
""")
    async with tc.Engine.from_toml(config) as engine:
        await (await engine.save(1, state(1.0))).wait()
        report(phase="saved", step=1)
        remount_read_only_after_first_part(disk)
        handle = await engine.save(2, state(2.0))
        try:
            await asyncio.wait_for(handle.wait(), 60)  # complete on the memory tier: no error, the disk's is named
            errors = handle.errors
            report(phase="step2", error=None, failed=sorted(errors), committed=list(handle.committed_on),
                   message="; ".join(f"{t}: {e}" for t, e in errors.items()))
        except tc.SaveError as e:
            report(phase="step2", error=type(e).__name__, failed=sorted(e.errors), message=str(e))
        except asyncio.TimeoutError:
            report(phase="step2", error="hang")
            return
    report(phase="closed")
    cli = subprocess.run([sys.executable, "-m", "tiered_ckpt.cli", "--config", str(config), "delete", "1", "-y"],
                         capture_output=True, text=True, timeout=120)
    report(phase="delete", rc=cli.returncode, out=cli.stdout + cli.stderr)
    async with tc.Engine.from_toml(config) as engine:
        steps = sorted(s.step for s in await engine.statuses())
        out = state(-1.0)
        info = await engine.load(out)
        report(phase="load", listed=steps, step=info.step, exact=bool((out["w"] == info.step).all()))
        try:
            await engine.load(state(-1.0), step=1)
            report(phase="load1", error=None)
        except tc.TieredCkptError as e:
            report(phase="load1", error=type(e).__name__)


if __name__ == "__main__":
    asyncio.run(main(Path(sys.argv[1])))
