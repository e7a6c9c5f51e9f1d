"""How long `tiered-ckpt` takes to answer a script: `--help`, `config check`, `ls` and `gc --dry-run`, each in a
fresh process (interpreter start and imports included, as a shell sees it), on a throwaway job holding a few
small checkpoints; beside an empty interpreter and `import torch` for scale. Reports the wall times and each
process's CPU time (user + system), judges none (docs/benchmarks.md, *CLI start-up*). The job's index is a file
index in a temporary folder, or the Redis index at `--index redis://...` (which imports other modules).

    python -m tiered_ckpt.bench.cli_startup [--repeats 5] [--checkpoints 3] [--index redis://host:port/db]
"""
from __future__ import annotations

import argparse
import asyncio
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def commands(config: Path) -> dict[str, list[str]]:
    """What is timed: label → argv (the CLI as `python -m tiered_ckpt.cli`, the console script's code)."""
    cli = [sys.executable, "-m", "tiered_ckpt.cli"]
    return {
        "python -c pass (interpreter start)": [sys.executable, "-c", "pass"],
        "python -c 'import torch' (for scale)": [sys.executable, "-c", "import torch"],
        "tiered-ckpt --help": [*cli, "--help"],
        "tiered-ckpt config check FILE": [*cli, "config", "check", str(config)],
        "tiered-ckpt ls": [*cli, "-c", str(config), "ls"],
        "tiered-ckpt gc --dry-run": [*cli, "-c", str(config), "gc", "--dry-run"],
    }


def write_job(base: Path, shm: Path, checkpoints: int, index: str | None = None) -> Path:
    """A config with a memory tier and a disk tier, and `checkpoints` small saves of its job (in `index`, or a
    file index under `base`)."""
    import torch

    from ..engine import Engine

    config = base / "cli.toml"
    index = index or f"file://{base}/index"
    config.write_text(f'[engine]\njob = "cli-startup"\nindex = "{index}"\npart_size = "64KiB"\n'
                      f'[[tiers]]\nname = "host"\nkind = "memory"\npath = "{shm}"\nkeep_last = {checkpoints}\n'
                      f'[[tiers]]\nname = "disk"\nkind = "local"\npath = "{base}/disk"\n')

    async def save() -> None:
        async with Engine.from_toml(config) as engine:
            for step in range(1, checkpoints + 1):
                await (await engine.save(step, {"w": torch.full((50_000,), float(step))})).wait()

    asyncio.run(save())
    return config


def measure(timed: dict[str, list[str]], repeats: int) -> dict[str, list[tuple[float, float]]]:
    """(wall seconds, CPU seconds of the process) of every command (label → argv), `repeats` times each (one
    untimed run first: cold file caches would measure the disk, not the CLI)."""
    times: dict[str, list[tuple[float, float]]] = {}
    for label, argv in timed.items():
        subprocess.run(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=True, timeout=120)
        times[label] = []
        for _ in range(repeats):
            before = resource.getrusage(resource.RUSAGE_CHILDREN)
            t = time.perf_counter()
            subprocess.run(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=True, timeout=120)
            wall = time.perf_counter() - t
            after = resource.getrusage(resource.RUSAGE_CHILDREN)  # the child just reaped is the only new one
            times[label].append((wall, after.ru_utime - before.ru_utime + after.ru_stime - before.ru_stime))
    return times


def report(times: dict[str, list[tuple[float, float]]]) -> str:
    width = max(map(len, times))
    lines = [f"{'command':<{width}}  {'median':>8}  {'min':>8}  {'max':>8}  {'CPU med':>8}"]
    for label, runs in times.items():
        seconds = [wall for wall, _ in runs]
        lines.append(f"{label:<{width}}  {statistics.median(seconds):>7.2f}s  {min(seconds):>7.2f}s  "
                     f"{max(seconds):>7.2f}s  {statistics.median(cpu for _, cpu in runs):>7.2f}s")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tiered_ckpt.bench.cli_startup", description=__doc__.split("\n\n")[0])
    p.add_argument("--repeats", type=int, default=5, help="timed runs per command (default 5)")
    p.add_argument("--checkpoints", type=int, default=3, help="checkpoints of the job ls and gc look at")
    p.add_argument("--shm", default="/dev/shm", help="where the memory tier's folder goes (default /dev/shm)")
    p.add_argument("--index", help="the job's index, e.g. redis://127.0.0.1:6379/0 (default: a file index in a "
                                   "temporary folder)")
    args = p.parse_args(argv)
    base = Path(tempfile.mkdtemp(prefix="tiered_ckpt-cli-startup-"))
    shm = Path(tempfile.mkdtemp(prefix="tiered_ckpt-cli-startup-", dir=args.shm))
    try:
        print(report(measure(commands(write_job(base, shm, args.checkpoints, args.index)), args.repeats)))
        if sys.dont_write_bytecode:
            print("(PYTHONDONTWRITEBYTECODE is set: every run compiled the package's sources, which an installed "
                  "package does not; PYTHONPYCACHEPREFIX=DIR without it caches them outside the source tree)")
    finally:
        shutil.rmtree(base, ignore_errors=True)
        shutil.rmtree(shm, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
