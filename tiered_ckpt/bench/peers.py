"""`tiered-ckpt bench --peers`: what a user's first benchmark against the libraries they would pick instead
sees. Every library runs in a fresh process (`python -m tiered_ckpt.bench.peers --one NAME ...`, one JSON
line), the libraries interleaved over the repetitions (A B C A B C ...), medians reported.

In each process: save 1 (measured only with `--first-saves`), every tensor changed in place (like an
optimizer step), save 2 (measured: *blocked*, until the caller may change the tensors; *durable on disk*,
until the library's completion plus an fsync of its files where it does not fsync), the same change again,
then a *cold load* (the library's files dropped from the page cache) into the live tensors, checked bit for
bit against the tensors as they were at save 2. Each save waits for the previous one to be durable, so a
save is never slowed by one still writing."""
from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import uvloop

from ..sizes import parse_size
from . import baselines
from .measure import drop_cache, mixed_state, state_nbytes
from .peer_libs import LIBRARIES, RAW, Library, State
from .peer_report import report

ORDER = [RAW, "torch_save", "dcp_async", "torch_checkpointing", "torchsnapshot_async", "torchsnapshot_take",
         "dlrover", "tiered_ckpt", "tiered_ckpt_reserved"]
RESULT = "TIERED_CKPT_PEER_RESULT "  # marks the child's JSON line among whatever a library prints


class Mismatch(AssertionError):
    """A load did not give back the tensors as they were saved."""


def change_every_tensor(state: State) -> None:
    """What an optimizer step does to the saved tensors between two saves."""
    for tensor in state.values():
        tensor.add_(1)


def check_same_bits(state: State, expected: State, what: str) -> None:
    """Raise unless every tensor holds exactly the bytes it held when it was saved."""
    for key, want in expected.items():
        got = state[key]
        if got.dtype != want.dtype or got.shape != want.shape:
            raise Mismatch(f"{what}: {key} came back as {got.dtype}{list(got.shape)}, saved {want.dtype}"
                           f"{list(want.shape)}")
        if not torch.equal(got.reshape(-1).view(torch.uint8), want.reshape(-1).view(torch.uint8)):
            raise Mismatch(f"{what}: {key} differs from the tensor that was saved")


def _first_line(error: BaseException) -> str:
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[0]}" if text else type(error).__name__


# --- the child: one library, one fresh process -------------------------------------------------------------

def measure_raw(state: State, folder: Path) -> dict[str, Any]:
    """The limits of this machine for the same bytes: memcpy, one write + fsync, one cold read."""
    folder.mkdir(parents=True, exist_ok=True)
    nbytes = state_nbytes(state)
    return {"memcpy": baselines.memcpy(state, 1), "raw_write": baselines.raw_write_once(folder, nbytes),
            "raw_read": baselines.raw_read_once(folder, nbytes)}


async def measure_library(lib: Library, state: State, saves: int) -> dict[str, Any]:
    out: dict[str, Any] = {"saves": []}
    expected: State = {}
    started = time.perf_counter()
    if await lib.prepare(state):
        out["prepare"] = time.perf_counter() - started
    for step in range(1, saves + 1):
        if step == saves:  # untimed: the bytes the load must give back
            expected = {k: v.clone() for k, v in state.items()}
        lib.returned = None
        started = time.perf_counter()
        pending = await lib.save(step, state, started)
        blocked = time.perf_counter() - started
        change_every_tensor(state)
        durable = await pending.durable()
        returned = lib.returned if lib.returned is not None else blocked
        out["saves"].append({"returned": returned, "blocked": blocked, "durable": durable})
    drop_cache(lib.folder)
    started = time.perf_counter()
    await lib.load_cold(saves, state)
    out["cold_load"] = time.perf_counter() - started
    check_same_bits(state, expected, f"{lib.name}: cold load")
    if lib.loads_from_memory:
        change_every_tensor(state)
        started = time.perf_counter()
        await lib.load_memory(saves, state)
        out["memory_load"] = time.perf_counter() - started
        check_same_bits(state, expected, f"{lib.name}: load from memory")
    out["verified"] = True
    return out


async def measure_one(name: str, nbytes: int, folder: Path, shm: Path, saves: int) -> dict[str, Any]:
    """One library in this process; failures come back as data (the parent reports them beside the rest)."""
    state = mixed_state(nbytes, even=True)
    head: dict[str, Any] = {"name": name, "bytes": state_nbytes(state), "tensors": len(state)}
    if name == RAW:
        return head | measure_raw(state, folder)
    lib = LIBRARIES[name](folder, shm, nbytes)
    head.update(library=lib.name, fsyncs_itself=lib.fsyncs_itself)
    try:
        await lib.open()
    except ImportError as e:
        return head | {"unavailable": f"not installed ({_first_line(e)})"}
    except Exception as e:  # noqa: BLE001 - reported, the other libraries go on
        return head | {"error": _first_line(e)}
    try:
        return head | await measure_library(lib, state, saves)
    except Mismatch as e:
        return head | {"error": _first_line(e), "mismatch": True}
    except Exception as e:  # noqa: BLE001
        return head | {"error": _first_line(e)}
    finally:
        try:
            await lib.close()
        except Exception as e:  # noqa: BLE001
            print(f"closing {name}: {_first_line(e)}", file=sys.stderr)


# --- the parent: fresh processes, interleaved --------------------------------------------------------------

def run_child(name: str, nbytes: int, work: Path, shm: Path, saves: int, timeout: float) -> dict[str, Any]:
    folder = Path(tempfile.mkdtemp(prefix=f"{name}-", dir=work))
    shm_dir = Path(tempfile.mkdtemp(prefix="tiered_ckpt-peers-", dir=shm))
    root = str(Path(__file__).resolve().parents[2])  # this tree's tiered_ckpt, whatever is installed
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")])))
    command = [sys.executable, "-m", "tiered_ckpt.bench.peers", "--one", name, "--size", str(nbytes),
               "--dir", str(folder / "data"), "--shm", str(shm_dir), "--saves", str(saves)]
    # a session of its own: what a library left running (a saver process) ends with the child
    child = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                             start_new_session=True)
    try:
        stdout, stderr = child.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"name": name, "error": f"timed out after {timeout:.0f} s"}
    finally:
        _end_group(child)
        if name in LIBRARIES:
            LIBRARIES[name].clean_after(child.pid)
        shutil.rmtree(folder, ignore_errors=True)
        shutil.rmtree(shm_dir, ignore_errors=True)
    for line in reversed(stdout.splitlines()):
        if line.startswith(RESULT):
            return json.loads(line[len(RESULT):])
    tail = [line for line in stderr.strip().splitlines() if line.strip()]
    return {"name": name, "error": f"exit {child.returncode}: {tail[-1] if tail else 'no output'}"}


def _end_group(child: subprocess.Popen) -> None:
    try:
        os.killpg(child.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    child.communicate()


def measure_size(nbytes: int, names: list[str], repeats: int, saves: int, work: Path, shm: Path) -> dict[str, Any]:
    runs: dict[str, list[dict[str, Any]]] = {n: [] for n in names}
    problems: dict[str, dict[str, Any]] = {}
    timeout = 300 + 600 * saves * nbytes / (1 << 30)
    for repeat in range(repeats):
        for name in names:
            if name in problems:
                continue
            print(f"  {name}, {nbytes} bytes, repetition {repeat + 1}/{repeats} ...", file=sys.stderr, flush=True)
            result = run_child(name, nbytes, work, shm, saves, timeout)
            if "error" in result or "unavailable" in result:
                problems[name] = result | {"repetition": repeat + 1}
            else:
                runs[name].append(result)
    return {"bytes": nbytes, "repeats": repeats, "saves": saves, "runs": {n: r for n, r in runs.items() if r},
            "problems": problems}


def run_peers(sizes: list[int], repeats: int, names: list[str], first_saves: int, base: Path,
              shm: Path) -> dict[str, Any]:
    base.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="peers-", dir=base))
    try:
        results = [measure_size(n, names, repeats, max(2, first_saves), work, shm) for n in sizes]
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return {"torch": torch.__version__, "python": sys.version.split()[0], "cpus": os.cpu_count(),
            "first_saves": first_saves, "sizes": results}


def run_cli(sizes: list[int], repeats: int, names: list[str], first_saves: int, base: Path, shm: Path,
            json_path: str | None) -> int:
    """Measure, print a markdown table per size; exit 1 if tiered_ckpt failed or any load gave back other bytes."""
    unknown = set(names) - set(ORDER)
    if unknown:
        raise SystemExit(f"unknown libraries {sorted(unknown)}; known: {', '.join(ORDER)}")
    names = [n for n in ORDER if n in names]
    results = run_peers(sizes, repeats, names, first_saves, base, shm)
    print(report(results))
    if json_path:
        Path(json_path).write_text(json.dumps(results, indent=2))
    failed = [p for s in results["sizes"] for p in s["problems"].values()
              if p.get("mismatch") or (p["name"] == "tiered_ckpt" and "error" in p)]
    return 1 if failed else 0


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--libraries", default=",".join(ORDER),
                   help=f"with --peers: which to run (default all, always in this order: {','.join(ORDER)})")
    p.add_argument("--first-saves", type=int, default=0, metavar="N",
                   help="with --peers: also report the blocked time of saves 1..N of each fresh process")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tiered_ckpt.bench.peers", description=__doc__.split("\n\n")[0])
    p.add_argument("--one", help="(child) measure this library in this process and print one JSON line")
    p.add_argument("--saves", type=int, default=2, help="(child) saves in this process")
    p.add_argument("--size", default="100MiB,1GiB", help="state sizes, comma-separated")
    p.add_argument("--repeats", type=int, default=2, help="fresh processes per library and size (median)")
    p.add_argument("--dir", default=".bench", help="where the libraries write (one folder each)")
    p.add_argument("--shm", default="/dev/shm", help="tiered_ckpt's memory tier")
    p.add_argument("--json", help="also write the raw figures here")
    add_arguments(p)
    args = p.parse_args(argv)
    if args.one:
        result = uvloop.run(measure_one(args.one, parse_size(args.size), Path(args.dir), Path(args.shm), args.saves))
        print(RESULT + json.dumps(result), flush=True)
        return 1 if "error" in result else 0
    sizes = [parse_size(s) for s in args.size.split(",")]
    return run_cli(sizes, args.repeats, args.libraries.split(","), args.first_saves, Path(args.dir),
                   Path(args.shm), args.json)


if __name__ == "__main__":
    sys.exit(main())
