#!/usr/bin/env python3
"""Mutation check of the promises the tests guard: each mutant breaks one promise in a copy of the
tree; the tests named for it must then fail. Prints each mutant as killed or SURVIVED; exits 1 if any
survived.

    python scripts/mutants.py              # all mutants
    python scripts/mutants.py lazy ties    # some of them
    python scripts/mutants.py --baseline   # the same tests on the unmutated copy: all must pass
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

# name: (file, code as it is, the mutant, the tests that must catch it)
MUTANTS = {
    "lazy": ("tiered_ckpt/engine.py", "            if not lazy:\n                await saver.staged(handle)",
             "            if True:\n                await saver.staged(handle)",
             ["tests/unit/test_save_semantics.py", "-k", "lazy"]),
    "load-protects-from-retention": (
        "tiered_ckpt/lifecycle/busy.py", "            self.begin_load(step)\n",
        "            self.begin_load(-1)\n",
        ["tests/unit/test_retention.py", "-k", "retention_spares"]),
    "max-inflight": ("tiered_ckpt/save/pool.py", "self.max_inflight = max_inflight", "self.max_inflight = 10**9",
                     ["tests/unit/test_staging.py", "-k", "backpressure"]),
    "pipeline-workers": ("tiered_ckpt/storage/pipeline.py", "self._workers = asyncio.Semaphore(workers)",
                         "self._workers = asyncio.Semaphore(10**6)", ["tests/unit/test_pipeline.py"]),
    "commit-before-records": (
        "tiered_ckpt/lifecycle/copy_commit.py", "        blobs = await self.records()\n",
        "        await self.commit()\n        blobs = await self.records()\n",
        ["tests/integration/test_crash.py", "-k", "manifest"]),
    "unverified-bytes-reach-the-state": (
        "tiered_ckpt/storage/verified_read.py", "        if part.bounce:", "        if False:",
        ["tests/integration/test_corruption.py", "-k", "unverified"]),
    "s3-single-get": ("tiered_ckpt/storage/tiers/s3.py", "if expected <= size:", "if True:",
                      ["tests/tiers/test_s3_tier.py", "-k", "ranged"]),
    "gpu-copy-without-wait": (
        "tiered_ckpt/save/copy.py",
        '        yield ("wait_event", d, events[d]) if d in events else ("wait_stream", d)\n', "",
        ["tests/unit/test_staging_streams.py"]),
    "gpu-stream-selected-per-copy": (  # thousands of stream switches: 0.37x instead of 0.6x cudaMemcpy on an H200
        "tiered_ckpt/save/copy.py", "        if d is not None and d != selected:", "        if d is not None:",
        ["tests/unit/test_staging_streams.py"]),
    "gpu-gathered-bytes-misplaced": (  # every gathered tensor lands at its run's start in the scratch
        "tiered_ckpt/save/gather.py", "                at = r.start + c.offset - r.offset",
        "                at = r.start", ["tests/unit/test_gather.py"]),
    "gpu-target-bytes-misplaced": (  # a load's write into a GPU target lands at the slice's start, not its own
        "tiered_ckpt/buffers.py", "        return self.start + lo, self.start + max(hi, lo)",
        "        return lo, max(hi, lo)", ["tests/unit/test_device_bytes.py"]),
    "decision-errors-become-rankfailed": (  # "no checkpoint to load" on rank 0 reads as a failure elsewhere
        "tiered_ckpt/distributed/coordinator.py", "        if answer is not None:\n            raise answers[answer](message)\n",
        "", ["tests/multirank/test_coordinator.py"]),
    "partial-copy-counts-as-whole": (  # the one "is this copy whole?" that the catalog, gc and loads ask
        "tiered_ckpt/lifecycle/lineage.py", "        return len(self.ranks_held(manifest)) == len(manifest.ranks)",
        "        return True", ["tests/unit/test_catalog.py", "tests/unit/test_gc.py", "tests/unit/test_field_faults.py"]),
    "collectives-out-of-step": (  # a rank that failed locally skips the load's read collectives
        "tiered_ckpt/load/loader.py", "                await read_parts(self.io,", "                if error is None: await read_parts(self.io,",
        ["tests/multirank/test_rank_state.py", "-k", "one_rank_failing"]),
    "rank-0-skeleton-everywhere": (
        "tiered_ckpt/load/loader.py", "source = rank if rank < manifest.world_size else 0", "source = 0",
        ["tests/multirank/test_rank_state.py", "-k", "same_world_size"]),
    "chunks-copied-unverified": (  # a chunk read copied to the state without its digest checked
        "tiered_ckpt/storage/verified_read.py", "        if actual != expected:\n", "        if False:\n",
        ["tests/integration/test_corruption.py", "-k", "chunk_is_verified"]),
    "whole-part-unchecked": (  # verify trusts chunk digests that do not add up to the part's checksum
        "tiered_ckpt/storage/verified_read.py", "    if whole != part.checksum:", "    if False:",
        ["tests/integration/test_corruption.py", "-k", "follows_from_its_chunk_digests"]),
    "no-dtype-cast": ("tiered_ckpt/load/reads.py", " and local.dtype == dtype\n", "\n",
                      ["tests/unit/test_state_rules.py", "-k", "cast"]),
    "ties-written-twice": ("tiered_ckpt/state/flatten.py", "earlier = seen.get(ptr)\n", "earlier = None\n",
                           ["tests/unit/test_state_rules.py", "-k", "tied"]),
    "module-keys-unchecked": ("tiered_ckpt/state/match.py", "        if not left:\n            return None",
                              "        return None",
                              ["tests/integration/test_corruption.py", "-k", "module_missing"]),
    "zombie-shares-keys": ("tiered_ckpt/save/commit.py", "self.incarnation = incarnation_dir(index.identity, session)",
                           'self.incarnation = ""',
                           ["tests/integration/test_redis_index.py", "-k", "never_overwrites"]),
    "retention-deletes-other-indexes": (
        "tiered_ckpt/lifecycle/removal.py", 'await self.io.delete(tier, f"{prefix}{mine}/")',
        "await self.io.delete(tier, prefix)",
        ["tests/unit/test_retention.py", "-k", "unrelated_runs"]),
    "older-save-supersedes-newer": ("tiered_ckpt/storage/pipeline.py", "if newest is not None and newest > step:",
                                    "if False:", ["tests/unit/test_pipeline.py", "-k", "newest_waiting"]),
    "skip-not-shared-by-ranks": (
        "tiered_ckpt/save/commit.py", "await self.index.mark_skipped(self.job, step, tier, self.rank, self.session, newer)",
        "pass", ["tests/multirank/test_save_dist.py", "-k", "skipping"]),
    "memory-tier-copied-not-staged": ("tiered_ckpt/save/tier_write.py", "in_place = tier == source.files_tier",
                                      "in_place = False", ["tests/unit/test_staging.py", "-k",
                                                              "memory_tier_copy"]),
    "retired-file-rewritten-under-a-reader": (
        "tiered_ckpt/save/mapped.py", "                    _lock_exclusive(fd, self.paths[p], wait)", "                    pass",
        ["tests/unit/test_memory_tier_reads.py", "-k", "waits_for_a_reader"]),
    "verify-holds-the-checkpoint": ("tiered_ckpt/load/verify.py", "slots = asyncio.Semaphore(VERIFY_PARTS)",
                                    "slots = asyncio.Semaphore(10**6)",
                                    ["tests/integration/test_corruption.py", "-k", "few_parts"]),
    "tier-op-without-timeout": (  # retention's delete straight to the driver: a hung store blocks the save
        "tiered_ckpt/storage/tier_io.py",
        'await self._pipelines[tier].attempt(lambda: self._drivers[tier].delete(prefix), f"delete {prefix}")',
        "await self._drivers[tier].delete(prefix)",
        ["tests/unit/test_tier_io.py", "-k", "delete_hangs"]),
    "host-budget-not-applied-to-retention": (  # the memory tier keeps keep_last whatever host_memory says
        "tiered_ckpt/save/saver.py",
        "            retention.rules[tier] = dataclasses.replace(retention.rules[tier], keep_last=keep_last)\n",
        "", ["tests/unit/test_host_budget.py"]),
    "background-failure-lost-at-next-save": (
        "tiered_ckpt/save/saver.py", "        self.raise_unobserved()\n        engine, rank =", "        engine, rank =",
        ["tests/unit/test_save_semantics.py", "-k", "nobody_waited"]),
    "writer-never-probes-its-tiers": (  # a path it can never write fails only in the background, at saves
        "tiered_ckpt/lifecycle/writer.py", "        await self.coordinator.agree(await self._probe())\n", "",
        ["tests/unit/test_open_checks.py", "-k", "never_be_written"]),
    "reader-deletes": ("tiered_ckpt/engine.py", 'if self.config.engine.role == "reader":', "if False:",
                       ["tests/unit/test_open_checks.py", "-k", "reader_never_saves"]),
    "free-deletes-the-step-folder": (  # an earlier format's keys removed by their prefix: the whole step folder
        "tiered_ckpt/lifecycle/free.py", "for prefix in (sorted(by[f]) if not f else [checkpoint_prefix(job, step, f)]):",
        "for prefix in [checkpoint_prefix(job, step, f)]:",
        ["tests/unit/test_host_memory.py", "-k", "live_writer"]),
    "reserve-makes-nothing": ("tiered_ckpt/save/pool.py", "return max(0, most - (self._count - unfit) - fitting_retained)",
                              "return 0", ["tests/unit/test_reserve.py"]),
    "failed-reader-sends-nothing": (  # the ranks waiting for its spans would wait forever
        "tiered_ckpt/load/broadcast.py", "        await asyncio.to_thread(post, i, key, members, buffer)\n",
        "        if buffer is not None:\n            await asyncio.to_thread(post, i, key, members, buffer)\n",
        ["tests/multirank/test_reshard.py", "-k", "reader_cannot_read"]),
    "posted-sends-never-waited": (  # a send dropped unfinished is cancelled: its receiver waits out the timeout
        "tiered_ckpt/load/broadcast.py", "        await asyncio.to_thread(wait_sent)\n", "        pass\n",
        ["tests/multirank/test_span_exchange.py"]),
    "early-copy-never-made": (  # a box counted as launched during the walk, its copy never queued
        "tiered_ckpt/save/early.py", "                dst.copy_(piece, non_blocking=expected >= 0)\n",
        "                pass\n", ["tests/unit/test_early_copies.py"]),
    "early-launch-kept-for-another-plan": (  # staging skips boxes launched for the old layout
        "tiered_ckpt/save/copy.py", "    if launch is not None and not launch.fits(plan, devices):",
        "    if False:", ["tests/unit/test_early_copies.py", "-k", "another_plan"]),
    "early-buffer-kept-after-a-failed-walk": (  # the buffer a dropped launch took never goes back to the pool
        "tiered_ckpt/save/saver.py", "            await self.services.pool.release(launch.buffer)",
        "            pass", ["tests/unit/test_early_copies.py", "-k", "refused_mid_walk"]),
    "automatic-gc-never-paused": (  # a full collection then stops every thread for 100-170 ms mid-save or mid-load
        "tiered_ckpt/gc_pause.py", "            gc.disable()\n", "            pass\n",
        ["tests/unit/test_gc_pause.py"]),
    "lightning-scores-kept-as-tensors": (  # a new set of tensors, so a new plan and buffer, at nearly every save
        "tiered_ckpt/integrations/lightning.py",
        "            checkpoint = {**checkpoint, \"callbacks\": scalars_as_values(checkpoint[\"callbacks\"])}",
        "            checkpoint = dict(checkpoint)", ["tests/integration/test_lightning.py", "-k", "reuses"]),
    "retired-buffer-dropped-beside-a-new-one": (  # back-to-back saves: each makes a buffer, one is dropped
        "tiered_ckpt/save/pool.py",
        "                most = self.max_inflight + (self.arena.held + 1 if self.arena is not None else 0)",
        "                most = self.max_inflight", ["tests/integration/test_lightning.py", "-k", "reuses"]),
    "capacity-refusal-wrapped": (  # the capacity check runs in the write's thread call: its TierFull (an OSError)
        "tiered_ckpt/storage/tiers/local.py",  # must not be taken for a failed write (wrapped, uncounted twice)
        "        except TierFull:  # (an OSError too) raised by the capacity check: nothing was counted or written\n"
        "            raise\n", "",
        ["tests/tiers/test_file_tiers.py", "-k", "capacity_is_enforced"]),
    "capacity-write-beside-write": (  # a retry beside a timed-out write of the same file counts it twice
        "tiered_ckpt/storage/tiers/local.py",
        "            while path in self._writing:\n", "            while False:\n",
        ["tests/tiers/test_file_tiers.py", "-k", "retry_beside"]),
    "retention-ignores-picking-loads": (  # a pass removed the step a load was still picking
        "tiered_ckpt/lifecycle/retention.py",
        "                for s in older:\n                    await self.busy.no_load_picking()\n",
        "                for s in older:\n",
        ["tests/unit/test_retention.py", "-k", "still_picking"]),
    "cancelled-check-keeps-buffer": (  # a save cancelled while its reused buffer is checked kept it held
        "tiered_ckpt/save/pool.py",
        "                    self._held.discard(id(buf))\n                    self._free.append(buf)\n", "",
        ["tests/unit/test_cancel_and_close.py", "-k", "reused_buffer"]),
    "second-close-returns-at-once": (  # a second close() returned before the closing was done
        "tiered_ckpt/engine.py",
        "        await asyncio.shield(self._closing)\n", "",
        ["tests/unit/test_cancel_and_close.py", "-k", "close"]),
    "save-starts-at-once": (  # saves called together each became the writer: the second was refused as a second
        "tiered_ckpt/save/saver.py",  # writer of its own job
        "        async with self.starting:\n            return await self._start(",
        "        if True:\n            return await self._start(",
        ["tests/unit/test_save_semantics.py", "-k", "one_at_a_time"]),
    "renamed-tier-copies-removed": (  # the first save through a config whose tier was renamed removed its copies
        "tiered_ckpt/lifecycle/retention.py",
        "(tier not in by_step[st].tiers and\n                                                         "
        "set(by_step[st].tiers) <= known)", "tier not in by_step[st].tiers",
        ["tests/unit/test_retention.py", "-k", "renamed"]),
    "optimizer-groups-unchecked": (  # an optimizer over other parameters: the model overwritten, then torch's error
        "tiered_ckpt/state/match.py", "            _check_group_sizes(value, saved_value, where)", "            pass",
        ["tests/unit/test_state_rules.py", "-k", "optimizer_over"]),
    "cancelled-save-unrecorded": (  # a plain save cancelled during its copy went on unseen: no records, and after
        "tiered_ckpt/engine.py",  # a SIGTERM the process went on training
        "            self._began(handle, lazy)\n            raise\n", "            raise\n",
        ["tests/unit/test_cancel_and_close.py", "-k", "recorded or sigterm"]),
}


def copy_tree(dest: Path) -> None:
    files = subprocess.run(["git", "ls-files", "-co", "--exclude-standard"], cwd=REPO, capture_output=True,
                           text=True, check=True).stdout.split()
    for name in files:
        src = REPO / name
        if src.is_file():
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / name)


def run(name: str, mutate: bool = True) -> bool:
    """True when the mutant is killed (its tests fail); with mutate=False, when the tests fail unmutated."""
    path, original, mutant, tests = MUTANTS[name]
    mutant = mutant if mutate else original
    with tempfile.TemporaryDirectory(prefix=f"mutant-{name}-") as tmp:
        root = Path(tmp)
        copy_tree(root)
        source = (root / path).read_text()
        if source.count(original) != 1:
            raise SystemExit(f"mutant {name}: the code to mutate is not found once in {path}; update scripts/mutants.py")
        (root / path).write_text(source.replace(original, mutant))
        env = dict(os.environ, PYTHONPATH=str(root))  # subprocesses (ranks, crash helpers) import the mutant too
        proc = subprocess.run([sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", *tests],
                              cwd=root, env=env, capture_output=True, text=True)
        return proc.returncode != 0


def main(names: list[str]) -> int:
    if names[:1] == ["--baseline"]:
        failing = [name for name in names[1:] or list(MUTANTS) if run(name, mutate=False)]
        print(f"baseline: {'tests fail unmutated for ' + ', '.join(failing) if failing else 'every selection passes'}")
        return 1 if failing else 0
    survivors = []
    for name in names or list(MUTANTS):
        killed = run(name)
        print(f"{'killed  ' if killed else 'SURVIVED'}  {name}", flush=True)
        if not killed:
            survivors.append(name)
    if survivors:
        print(f"{len(survivors)} mutant(s) survived: {', '.join(survivors)}")
        return 1
    print(f"all {len(names or MUTANTS)} mutants killed")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
