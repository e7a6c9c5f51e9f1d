"""The GPU paths, measured on a GPU beside raw CUDA copies in the same run (#30 item 7).

`python -m tiered_ckpt.bench.gpu [--size 1GiB] [--json]`, on a machine with CUDA:

- **staging (device → host):** the blocked time of `save()` of a state held in GPU memory (saves 1–6, with
  and without `reserve`, and without the copies launched during the walk) beside one pinned `cudaMemcpy` of the same bytes (the hardware's D2H bandwidth),
  the same tensors copied one by one into a pinned buffer, a copy into pageable memory, and DCP's
  `async_save` with its pinned stager;
- **ordering:** a save issued right behind a queue of kernels that still write the saved tensor holds the
  tensor's final values (the side stream waits for the training stream), lazy and not;
- **load into GPU tensors** from the memory tier, bit-exact, beside pinned and pageable host → device copies;
- **the training loop's share:** a GPT trained on the GPU with no checkpoint, and with lazy saves every
  `--every` steps (memory tier), interleaved; the step-time slowdown and the exposed time per save.

With `--device cpu` (and small sizes) the same code runs without a GPU: the tests run it that way so it
stays working; its figures then mean nothing.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import statistics
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any, Callable

import torch
import torch.nn.functional as F

from ..config import parse_config
from ..sizes import format_size, parse_size
from .measure import mixed_state, state_nbytes


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _timed(fn: Callable[[], Any], device: torch.device, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        _sync(device)
        started = time.perf_counter()
        fn()
        _sync(device)
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def _config(shm: Path, work: Path, job: str, nbytes: int, **engine: Any) -> Any:
    return parse_config({"engine": {"job": job, "index": f"file://{work}/index", "part_size": "64MiB", **engine},
                         "tiers": [{"name": "host", "kind": "memory", "path": str(shm / job),
                                    "capacity": 4 * nbytes + (1 << 30), "keep_last": 1}]})


def copy_baselines(state: dict[str, torch.Tensor], device: torch.device, repeats: int) -> dict[str, float]:
    """Raw copies of the state's bytes: one flat pinned cudaMemcpy each way, per tensor into pinned views,
    and into/out of pageable memory."""
    nbytes = state_nbytes(state)
    pin = device.type == "cuda"
    flat = torch.empty(nbytes, dtype=torch.uint8, device=device)
    pinned = torch.empty(nbytes, dtype=torch.uint8, pin_memory=pin)
    pageable = torch.empty(nbytes, dtype=torch.uint8)
    flat.zero_()
    pinned.zero_()
    pageable.zero_()
    views, at = [], 0
    for t in state.values():
        n = t.numel() * t.element_size()
        views.append((t, pinned[at:at + n].view(t.dtype).view(t.shape)))
        at += n

    def per_tensor() -> None:
        for src, dst in views:
            dst.copy_(src, non_blocking=pin)

    out = {"d2h_pinned": _timed(lambda: pinned.copy_(flat, non_blocking=pin), device, repeats),
           "d2h_pinned_per_tensor": _timed(per_tensor, device, repeats),
           "d2h_pageable": _timed(lambda: pageable.copy_(flat), device, repeats),
           "h2d_pinned": _timed(lambda: flat.copy_(pinned, non_blocking=pin), device, repeats),
           "h2d_pageable": _timed(lambda: flat.copy_(pageable), device, repeats)}
    del flat, pinned, pageable, views
    if pin:  # what pinning costs: one allocation per tensor, or one for all (the host allocator emptied after each)
        empty_cache = getattr(torch._C, "_host_emptyCache", lambda: None)

        def allocate(sizes: list[int]) -> None:
            held = [torch.empty(n, dtype=torch.uint8, pin_memory=True) for n in sizes]
            del held
            empty_cache()

        sizes = [t.numel() * t.element_size() for t in state.values()]
        out["pin_alloc_per_tensor"] = _timed(lambda: allocate(sizes), device, 1)
        out["pin_alloc_one"] = _timed(lambda: allocate([nbytes]), device, 1)
    return out


async def staging(state: dict[str, torch.Tensor], device: torch.device, shm: Path, work: Path,
                  saves: int = 6) -> dict[str, Any]:
    """Blocked time of saves 1..`saves` of `state` (on `device`), without and with reserve(), and with the
    copies launched during the walk turned off (save/early.py) beside the same engine with them on; then a
    load of the last save into zeroed tensors on `device`, checked bit-exact."""
    import tiered_ckpt as tc

    nbytes = state_nbytes(state)
    out: dict[str, Any] = {}
    for reserved, gather, early in ((False, True, True), (True, True, False), (True, False, True), (True, True, True)):
        job = ("reserved" if reserved else "plain") + ("" if gather else "_nogather") + ("" if early else "_noearly")
        async with tc.Engine(_config(shm, work, job, nbytes, **({} if gather else {"gpu_gather": 0}))) as engine:
            if not early:
                engine._saver.early = None  # the walk launches nothing: every copy waits for the plan
            if reserved:
                await engine.reserve(state)
            blocked, durable = [], []
            for step in range(1, saves + 1):
                for t in state.values():
                    t.add_(1)  # the training step: kernels still queued when save() is called
                started = time.perf_counter()
                handle = await engine.save(step, state)
                blocked.append(time.perf_counter() - started)
                await handle.wait()
                durable.append(time.perf_counter() - started)
            out[f"save_{job}"] = blocked
            out[f"durable_{job}"] = durable
            if job == "reserved":
                out["save_steps"] = await save_steps(state, engine.config.engine.part_size,
                                                     engine.pool.gatherer)
            if job == "reserved":
                out["gather_bytes"] = engine.pool.gatherer.nbytes
                expected = {k: v.clone() for k, v in state.items()}
                target = {k: torch.zeros_like(v) for k, v in state.items()}
                loads = []
                for _ in range(3):
                    _sync(device)
                    started = time.perf_counter()
                    info = await engine.load(target, tiers=["host"])
                    _sync(device)
                    loads.append(time.perf_counter() - started)
                out["load_host"] = statistics.median(loads)
                out["load_exact"] = info.step == saves and all(torch.equal(target[k], expected[k]) for k in state)
    return out


async def ordering(device: torch.device, shm: Path, work: Path) -> dict[str, bool]:
    """Saves issued while kernels that write the saved tensor are still queued on the training stream: the
    checkpoint must hold the values those kernels leave, not the ones before them. On a GPU, also a load
    issued while a write to the target is still queued on the caller's stream: the load's values must win."""
    import tiered_ckpt as tc

    out = {}
    x = torch.ones(64 << 20, device=device)  # 256 MiB: each kernel on it takes a while
    async with tc.Engine(_config(shm, work, "ordering", x.numel() * 4)) as engine:
        _early_on_the_cpu(engine, device)
        # saves 2 and 3 launch their copy during the walk (save/early.py), with the kernels still queued
        for step, lazy in ((1, False), (2, True), (3, False)):
            if device.type == "cuda":
                torch.cuda._sleep(1 << 30)  # holds the training stream for ~0.5 s: the writes below wait behind it
            for _ in range(20):
                x.mul_(1.0001).add_(0.5)  # queued, not finished, when save() is called
            handle = await engine.save(step, {"x": x}, lazy=lazy)
            await handle.staged()
            expected = x.clone()
            await handle.wait()
            back = {"x": torch.zeros_like(x)}
            await engine.load(back, step=step, tiers=["host"])
            out["lazy" if lazy else "eager" if step == 1 else "eager, launched during the walk"] = \
                bool(torch.equal(back["x"], expected))
        if device.type == "cuda":  # a load while the caller's own stream still has a write to the target queued
            stream = torch.cuda.Stream(device)
            with torch.cuda.stream(stream):
                torch.cuda._sleep(1 << 30)
                back["x"].fill_(7.0)
                await engine.load(back, step=3, tiers=["host"])
            torch.cuda.synchronize(device)
            out["load"] = bool(torch.equal(back["x"], expected))
        # a stateful object whose state_dict() queues the kernels that make what it returns (during the walk, on
        # the walk's thread): the copy launched during the walk must wait for them
        maker = _Doubling(x, device)
        for step in (4, 5):
            handle = await engine.save(step, {"m": maker})
            await handle.wait()
            back = {"m": {"y": torch.zeros_like(x)}}
            await engine.load(back, step=step, tiers=["host"])
            out["state_dict kernels" + (", launched during the walk" if step == 5 else "")] = \
                bool(torch.equal(back["m"]["y"], x * 2))
    return out


class _Doubling:
    """A stateful object whose state_dict() makes a new tensor with kernels queued behind a 0.5 s sleep."""

    def __init__(self, x: torch.Tensor, device: torch.device):
        self.x, self.device = x, device

    def state_dict(self) -> dict[str, torch.Tensor]:
        if self.device.type == "cuda":
            torch.cuda._sleep(1 << 30)
        return {"y": self.x * 2}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pass


def _early_on_the_cpu(engine: Any, device: torch.device) -> None:
    """On the CPU (the tests' run) the engine launches nothing during the walk: make it launch the host copies,
    so the checks here run the same guesses and fallbacks as on a GPU."""
    if device.type == "cpu":
        from ..save.early import EarlyCopies
        engine._saver.early = EarlyCopies(min_bytes=1, host_sources=True)


async def early_fallbacks(device: torch.device, shm: Path, work: Path) -> dict[str, bool]:
    """The copies launched during the walk are a guess from the last save. A save whose state changed since
    must still hold its own values: checked bit-exact for the same state again, a tensor moved to the host, a
    tensor cut shorter and a tensor added, each saved between two saves of the first state (which must also
    come back exact after the change)."""
    import tiered_ckpt as tc

    first = {"a": torch.randn(4 << 20, device=device), "b": torch.randn(1 << 20, device=device),
             **{f"n{i}": torch.randn(1000, device=device) for i in range(10)}}  # the ten are gathered
    changes: dict[str, Callable[[dict], dict]] = {
        "same": lambda s: s,
        "moved to the host": lambda s: {**s, "b": s["b"].cpu()},
        "cut shorter": lambda s: {**s, "b": s["b"][: 1 << 19]},
        "added": lambda s: {**s, "z": torch.randn(2 << 20, device=device)}}
    out = {}
    async with tc.Engine(_config(shm, work, "early", 2 * state_nbytes(first))) as engine:
        _early_on_the_cpu(engine, device)
        await (await engine.save(1, first)).wait()
        step = 1
        for name, change in changes.items():
            exact = True
            for state in (change(first), first):
                step += 1
                for t in first.values():
                    t.add_(1)  # queued on the training stream when save() is called
                handle = await engine.save(step, state)
                expected = {k: v.clone() for k, v in state.items()}
                await handle.wait()
                back = {k: torch.zeros_like(v) for k, v in state.items()}
                await engine.load(back, step=step, tiers=["host"])
                exact = exact and all(torch.equal(back[k], expected[k]) for k in state)
            out[name] = exact
    return out


def dcp_async(state: dict[str, torch.Tensor], work: Path, repeats: int) -> dict[str, Any]:
    """DCP async_save, the time it blocks and the time until staged (the first call allocates: not counted):
    with its pinned stager reused across saves, or, where that fails, with its default staging (a copy to
    CPU memory before it returns)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions
    from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

    warnings.filterwarnings("ignore", message=".*assuming the intent is to.*single process")
    cuda = torch.cuda.is_available()

    def run(stager: Any) -> dict[str, float]:
        returned, staged = [], []
        for i in range(repeats + 1):
            path = work / f"dcp{i}"
            options: dict[str, Any] = {"async_stager": stager} if stager is not None else {}
            started = time.perf_counter()
            resp = dcp.async_save(state, storage_writer=dcp.FileSystemWriter(path, thread_count=2),
                                  async_checkpointer_type=AsyncCheckpointerType.THREAD, **options)
            t_return = time.perf_counter()
            if stager is not None:
                resp.staging_completion.result()
            t_staged = time.perf_counter()
            (resp.upload_completion if stager is not None else resp).result()
            shutil.rmtree(path, ignore_errors=True)
            if i:
                returned.append(t_return - started)
                staged.append(t_staged - started)
        return {"dcp_async_return": statistics.median(returned), "dcp_async_staged": statistics.median(staged)}

    stager = DefaultStager(StagingOptions(use_pinned_memory=cuda, use_shared_memory=False, use_async_staging=True,
                                          use_non_blocking_copy=cuda))
    try:
        return {**run(stager), "dcp_staging": "pinned stager"}
    except Exception as e:  # torch 2.11 + CUDA: KeyError: <class 'type'> in the stager's deepcopy
        failed = f"{type(e).__name__}: {e}"[:200]
    finally:
        stager.close()
    return {**run(None), "dcp_staging": f"default (the pinned stager failed: {failed})"}


class _Block(torch.nn.Module):
    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = torch.nn.LayerNorm(dim), torch.nn.LayerNorm(dim)
        self.qkv, self.proj = torch.nn.Linear(dim, 3 * dim), torch.nn.Linear(dim, dim)
        self.mlp = torch.nn.Sequential(torch.nn.Linear(dim, 4 * dim), torch.nn.GELU(), torch.nn.Linear(4 * dim, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, d // self.heads).transpose(1, 3).unbind(2)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, d)
        x = x + self.proj(y)
        return x + self.mlp(self.ln2(x))


def gpt(vocab: int, dim: int, layers: int, heads: int) -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.Embedding(vocab, dim), *[_Block(dim, heads) for _ in range(layers)],
                               torch.nn.LayerNorm(dim), torch.nn.Linear(dim, vocab))


def training_loop(device: torch.device, shm: Path, work: Path, *, dim: int, layers: int, batch: int, ctx: int,
                  steps: int, every: int, repeats: int, vocab: int = 32000) -> dict[str, Any]:
    """Seconds per run of `steps` training steps: no checkpoint, and lazy saves every `every` steps (memory
    tier, reserved up front), interleaved `repeats` times."""
    from ..sync import Checkpointer

    torch.manual_seed(0)
    model = gpt(vocab, dim, layers, max(dim // 128, 1)).to(device)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-4)
    state = {"model": model, "optim": optim}
    params = sum(p.numel() for p in model.parameters())
    g = torch.Generator(device=device).manual_seed(0)
    autocast = torch.autocast(device.type, dtype=torch.bfloat16)
    saved = [0]  # the steps saved so far: each save a new step number

    def train(n: int, save: Callable[[int], Any] | None) -> tuple[float, list[float]]:
        pending = None
        waits = []
        _sync(device)
        started = time.perf_counter()
        for step in range(1, n + 1):
            x = torch.randint(0, vocab, (batch, ctx + 1), generator=g, device=device)
            with autocast:
                loss = F.cross_entropy(model(x[:, :-1]).reshape(-1, vocab).float(), x[:, 1:].reshape(-1))
            loss.backward()
            if pending is not None:
                t = time.perf_counter()
                pending.staged()  # the lazy copy is done before the weights change
                waits.append(time.perf_counter() - t)
                pending = None
            optim.step()
            optim.zero_grad(set_to_none=True)
            if save is not None and step % every == 0:
                saved[0] += 1
                pending = save(saved[0])
        if pending is not None:
            pending.staged()
        _sync(device)
        return time.perf_counter() - started, waits

    train(3, None)  # the optimizer's state exists from here on: the state saved has its final size
    nbytes = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    nbytes += sum(t.numel() * t.element_size() for s in optim.state.values() for t in s.values()
                  if isinstance(t, torch.Tensor))
    times: dict[str, list[float]] = {"none": [], "lazy": []}
    waits: list[float] = []
    with Checkpointer(_config(shm, work, "loop", nbytes)) as ckpt:
        ckpt.reserve(state)
        train(every, lambda s: ckpt.save(s, state, lazy=True))  # warm: the first save's plan
        for _ in range(repeats):
            times["none"].append(train(steps, None)[0])
            seconds, w = train(steps, lambda s: ckpt.save(s, state, lazy=True))
            times["lazy"].append(seconds)
            waits += w
    none, lazy = statistics.median(times["none"]), statistics.median(times["lazy"])
    saves_per_run = steps // every
    return {"params": params, "state_bytes": nbytes, "steps": steps, "every": every, "runs": times,
            "step_seconds": none / steps, "slowdown": lazy / none - 1,
            "exposed_per_save": (lazy - none) / saves_per_run if saves_per_run else 0.0,
            "staged_wait_median": statistics.median(waits) if waits else 0.0}


async def save_steps(state: dict[str, torch.Tensor], part_size: int, gatherer: Any,
                     repeats: int = 5) -> dict[str, float]:
    """Where a save's blocked time goes, step by step, on the same state (medians): walking the state
    (flatten), the plan cache's key, the producer events, and the staging copy into a pinned buffer as a save
    runs it (side streams, one select per run of copies). What a save blocks beyond their sum is the hand-offs
    between the event loop and its threads."""
    from ..save.copy import producer_events, stage
    from ..save.plan import Planner, structure_key
    from ..save.staging_buffer import StagingBuffer
    from ..state import flatten

    flat = flatten(state)
    plan = await Planner(part_size).plan(flat.paths, flat.tensors)
    buf = StagingBuffer(plan.nbytes, pin=torch.cuda.is_available())
    device = next(iter(state.values())).device

    def copy() -> None:
        stage(plan, flat.tensors, buf, producer_events(flat.tensors), None, gatherer)

    out = {"flatten": _timed(lambda: flatten(state), device, repeats),
           "plan_key": _timed(lambda: structure_key(flat.paths, flat.tensors, 1, part_size), device, repeats),
           "events": _timed(lambda: producer_events(flat.tensors), device, repeats),
           "stage": _timed(copy, device, repeats)}
    del buf
    return out


def measure(args: argparse.Namespace) -> dict[str, Any]:
    device = torch.device(args.device)
    nbytes = parse_size(args.size)
    out: dict[str, Any] = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
                           "torch": torch.__version__}
    with tempfile.TemporaryDirectory(prefix="tiered_ckpt-gpu-", dir=args.shm) as shm_dir, \
            tempfile.TemporaryDirectory(prefix="tiered_ckpt-gpu-") as work_dir:
        shm, work = Path(shm_dir), Path(work_dir)
        if args.small_tensors:  # many small tensors (an MoE's biases and norms, per-parameter optimizer states)
            state = {f"t{i}": torch.randn(nbytes // args.small_tensors // 4, device=device)
                     for i in range(args.small_tensors)}
        else:
            state = {k: v.to(device) for k, v in mixed_state(nbytes, even=True).items()}
        out["bytes"], out["tensors"] = state_nbytes(state), len(state)
        out.update(copy_baselines(state, device, args.repeats))
        out.update(asyncio.run(staging(state, device, shm, work)))
        out["ordering"] = asyncio.run(ordering(device, shm, work))
        out["early_fallbacks"] = asyncio.run(early_fallbacks(device, shm, work))
        if args.dcp:
            try:
                out.update(dcp_async(state, work, args.repeats))
            except Exception as e:  # a peer's failure is reported, not ours to fix
                out["dcp_error"] = f"{type(e).__name__}: {e}"[:300]
        del state
        if args.steps:
            out["loop"] = training_loop(device, shm, work, dim=args.dim, layers=args.layers, batch=args.batch,
                                        ctx=args.ctx, steps=args.steps, every=args.every, repeats=args.loop_repeats)
    return out


def report(r: dict[str, Any]) -> str:
    gib = r["bytes"] / 2**30
    memcpy = r["d2h_pinned"]
    lines = [f"{r['device']}, torch {r['torch']}: {format_size(r['bytes'])} in {r['tensors']} tensors; medians", "",
             "| device → host | s | GiB/s | pinned cudaMemcpy / this |", "|---|---:|---:|---:|"]

    def row(name: str, s: float) -> None:
        lines.append(f"| {name} | {s:.4f} | {gib / s:.1f} | {memcpy / s:.2f} |")

    lines.insert(2, "durable on the memory tier (from save()): " + ", ".join(
        f"{job} {' '.join(f'{d:.3f}' for d in r['durable_' + job])} s"
        for job in ("plain", "reserved", "reserved_nogather", "reserved_noearly") if "durable_" + job in r))
    lines.insert(3, "")
    row("pinned cudaMemcpy, one flat copy", memcpy)
    row("pinned, tensor by tensor", r["d2h_pinned_per_tensor"])
    row("pageable", r["d2h_pageable"])
    names = {"plain": "", "reserved": " (reserved)", "reserved_nogather": " (reserved, gpu_gather = 0)",
             "reserved_noearly": " (reserved, no copies launched during the walk)"}
    for job, suffix in names.items():
        for i, s in enumerate(r.get(f"save_{job}", []), 1):
            row(f"tiered_ckpt save {i}{suffix}", s)
    if "save_steps" in r:
        st = r["save_steps"]
        later = r["save_reserved"][2:] or r["save_reserved"]  # steady saves (3 on): what the steps add up to
        rest = statistics.median(later) - sum(st.values())
        lines.append(f"| GPU scratch the engine keeps to gather small tensors: {format_size(r.get('gather_bytes', 0))} | | | |")
        lines.append("| its steps, timed apart: " + ", ".join(f"{k} {1000 * v:.1f} ms" for k, v in st.items())
                     + f"; a steady save beyond their sum {1000 * rest:.1f} ms (hand-offs between the loop and its "
                     f"threads; below 0 where the copy runs during the walk) | | | |")
    if "dcp_async_return" in r:
        row(f"DCP async_save, returned ({r['dcp_staging']})", r["dcp_async_return"])
        row(f"DCP async_save, staged ({r['dcp_staging']})", r["dcp_async_staged"])
    if "dcp_error" in r:
        lines.append(f"| DCP async_save: failed ({r['dcp_error']}) | | | |")
    lines += ["", "| host → device | s | GiB/s | × pinned copy |", "|---|---:|---:|---:|"]
    for name, s in (("pinned cudaMemcpy, one flat copy", r["h2d_pinned"]), ("pageable", r["h2d_pageable"]),
                    (f"tiered_ckpt load from the memory tier (bit-exact: {r['load_exact']})", r["load_host"])):
        lines.append(f"| {name} | {s:.4f} | {gib / s:.1f} | {s / r['h2d_pinned']:.2f} |")
    if "pin_alloc_one" in r:
        lines += ["", f"pinning {format_size(r['bytes'])}: {r['pin_alloc_one']:.3f} s in one allocation, "
                      f"{r['pin_alloc_per_tensor']:.3f} s in one per tensor"]
    lines += ["", f"ordering behind queued kernels: {r['ordering']}",
              f"saves of a changed state, after copies launched for the old one (bit-exact): {r['early_fallbacks']}"]
    if "loop" in r:
        lp = r["loop"]
        lines += ["", f"training loop: GPT of {lp['params'] / 1e6:.0f}M parameters, state "
                  f"{format_size(lp['state_bytes'])} (weights + AdamW), {lp['steps']} steps per run at "
                  f"{1000 * lp['step_seconds']:.1f} ms/step, a lazy save every {lp['every']} steps: slowdown "
                  f"{100 * lp['slowdown']:.2f}%, exposed {1000 * lp['exposed_per_save']:.1f} ms per save, staged() "
                  f"waited {1000 * lp['staged_wait_median']:.1f} ms (median); runs {lp['runs']}"]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tiered_ckpt.bench.gpu", description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda")
    p.add_argument("--size", default="1GiB")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--shm", default="/dev/shm")
    p.add_argument("--no-dcp", dest="dcp", action="store_false")
    p.add_argument("--small-tensors", type=int, default=0, metavar="N",
                   help="a state of N equal float32 tensors of --size in all, instead of the mixed one")
    p.add_argument("--steps", type=int, default=200, help="steps per training run (0: no training loop)")
    p.add_argument("--every", type=int, default=100)
    p.add_argument("--loop-repeats", type=int, default=2)
    p.add_argument("--dim", type=int, default=1024)
    p.add_argument("--layers", type=int, default=16)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--ctx", type=int, default=1024)
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    result = measure(args)
    print(json.dumps(result) if args.json else report(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
