"""`tiered-ckpt agent` (the node agent in the foreground) and `tiered-ckpt agent status` (what it drains)."""
from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
from pathlib import Path

from ..agent.client import agent_status
from ..agent.folder import IDLE_ENV, agent_folder
from ..agent.server import IDLE_SECONDS, run_agent
from ..agent.wire import VERSION
from .commands import EXIT_OK


def cmd_agent(args: argparse.Namespace) -> int:
    folder = agent_folder()
    if args.idle is None and os.environ.get(IDLE_ENV):
        args.idle = float(os.environ[IDLE_ENV])
    if args.action == "status":
        return _status(folder, args.json)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s: %(message)s")
    return run_agent(folder, IDLE_SECONDS if args.idle is None else args.idle)


def _status(folder: Path, as_json: bool) -> int:
    status = asyncio.run(agent_status(folder))
    if as_json:
        print(json.dumps({"folder": str(folder), "running": status is not None, **(status or {})}))
        return EXIT_OK
    if status is None:
        print(f"no agent runs at {folder}")
        return EXIT_OK
    drains = status.get("drains", [])
    version = status.get("version")
    other = "" if version == VERSION else (f" (protocol version {version}, this release's {VERSION}: it takes no "
                                           f"saves from this release and exits once idle)")
    print(f"agent pid {status['pid']} at {folder}{other}: {status.get('clients', 0)} trainer(s) attached, "
          f"{len(drains)} save(s) draining, {status.get('journal', 0)} journaled")
    for d in sorted(drains, key=lambda d: (d["job"], d["step"], d["rank"])):
        for tier, state in sorted(d["tiers"].items()):
            print(f"  job {d['job']}  step {d['step']}  rank {d['rank']}  tier {tier}: {state} "
                  f"({d['nbytes']} bytes, {d['seconds']}s)")
    return EXIT_OK
