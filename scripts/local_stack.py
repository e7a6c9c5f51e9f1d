"""The stack of docker-compose.yml with real processes and no Docker: a redis-server and a moto_server (in
MinIO's place, with the preset's bucket) on free ports, then the same 2-rank training example under torchrun
with tiers/compose.toml pointed at them; `tiered-ckpt ls`, and a resume as `docker compose run --rm trainer`
does it (same Redis, same disk and S3, an empty /dev/shm).

    python scripts/local_stack.py                                # compose's run: 200 steps, a save every 20
    python scripts/local_stack.py --tiny --steps 16 --save-every 4 --summary out.json   # a quick one

Everything it starts is stopped at the end, and its files removed (--keep leaves the files). Exit status 0
only when the resume happened and a checkpoint is complete on the S3 tier; --summary writes what it found
as JSON. Needs redis-server and moto_server (`pip install 'moto[server]'`, in the test extra)."""
from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import tiered_ckpt as tc
from tiered_ckpt.testing.servers import start_local_server

REPO = Path(__file__).resolve().parents[1]
PRESET = REPO / "tiers" / "compose.toml"
EXAMPLE = REPO / "examples" / "train_gpt_ddp.py"
# what docker-compose.yml gives the trainer (MinIO's root user); moto takes any credentials
CREDENTIALS = {"AWS_ACCESS_KEY_ID": "tiered", "AWS_SECRET_ACCESS_KEY": "tiered-secret",
               "AWS_DEFAULT_REGION": "us-east-1"}
RESUMED = re.compile(r"resumed from step (\d+).*?\(tier ([\w.-]+)")  # the example's rank 0 line


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=200, help="steps of the first run (the resume trains 2 saves more)")
    p.add_argument("--save-every", type=int, default=20)
    p.add_argument("--tiny", action="store_true", help="the example's tiny model (fast; for tests)")
    p.add_argument("--summary", type=Path, help="write what was found here as JSON")
    p.add_argument("--keep", action="store_true", help="leave the run's files (the servers are stopped anyway)")
    args = p.parse_args(argv)
    for tool in ("redis-server", "moto_server"):
        if shutil.which(tool) is None:
            raise SystemExit(f"{tool} is not installed (scripts/test.sh installs both)")
    # a SIGTERM (a timeout's kill) unwinds like Ctrl-C, so the finally below stops the servers
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    os.environ.update(CREDENTIALS)  # for the S3 tier of every process started here, and of this one

    run_dir = Path(tempfile.mkdtemp(prefix="tiered_ckpt-stack-"))
    # the memory tier's own folder, as a container's /dev/shm: emptied before the resume
    shm_dir = Path(tempfile.mkdtemp(prefix="tiered_ckpt-stack-", dir="/dev/shm" if Path("/dev/shm").is_dir() else None))
    servers: list[subprocess.Popen] = []
    try:
        redis, redis_port = start_local_server(lambda port: [
            "redis-server", "--port", str(port), "--bind", "127.0.0.1", "--dir", str(run_dir),
            # as docker-compose.yml runs it
            "--save", "", "--appendonly", "no", "--maxmemory", "2gb", "--maxmemory-policy", "noeviction"])
        servers.append(redis)
        moto, s3_port = start_local_server(lambda port: ["moto_server", "-H", "127.0.0.1", "-p", str(port)],
                                           log=run_dir / "moto.log")
        servers.append(moto)
        config = local_preset(run_dir, shm_dir, redis_port, s3_port)
        create_bucket(config)
        print(f"redis-server on 127.0.0.1:{redis_port}, moto_server (S3) on 127.0.0.1:{s3_port}; preset {config}",
              flush=True)

        train = ["--config", str(config), "--save-every", str(args.save_every), *(["--tiny"] if args.tiny else [])]
        torchrun(*train, "--steps", str(args.steps))
        cli(config, "ls")
        shutil.rmtree(shm_dir)  # a new container's /dev/shm is empty: the resume reads the other tiers
        shm_dir.mkdir(mode=0o700)
        output = torchrun(*train, "--steps", str(args.steps + 2 * args.save_every))
        cli(config, "ls")
        summary = summarize(config, output)
    finally:
        for server in servers:
            server.kill()
            server.wait()
        shutil.rmtree(shm_dir, ignore_errors=True)
        if args.keep:
            print(f"files kept in {run_dir}", flush=True)
        else:
            shutil.rmtree(run_dir, ignore_errors=True)

    print(json.dumps(summary, indent=2), flush=True)
    if args.summary:
        args.summary.write_text(json.dumps(summary, indent=2))
    return 0 if summary["resumed_from"] is not None and summary["complete_on_s3"] else 1


def local_preset(run_dir: Path, shm_dir: Path, redis_port: int, s3_port: int) -> Path:
    """tiers/compose.toml with the compose network's hosts replaced by this machine's servers, and its folders
    (the memory tier's, ./checkpoints) by this run's, so a run never sees another's checkpoints."""
    text = PRESET.read_text()
    swaps = {"redis://redis:6379/": f"redis://127.0.0.1:{redis_port}/",
             "http://minio:9000": f"http://127.0.0.1:{s3_port}",
             'kind = "memory"': f'kind = "memory"\npath = "{shm_dir}"',
             '"./checkpoints/': f'"{run_dir}/checkpoints/'}
    for compose_value, local_value in swaps.items():
        if compose_value not in text:
            raise SystemExit(f"{PRESET} has no {compose_value!r} any more: update scripts/local_stack.py to match")
        text = text.replace(compose_value, local_value)
    path = run_dir / "compose.toml"
    path.write_text(text)
    tc.load_config(path)  # a broken substitution fails here, naming the key, before anything starts
    return path


def create_bucket(config: Path) -> None:
    """What the compose file's createbucket job does with mc: the S3 tier's bucket exists before training."""
    import boto3

    s3 = next(t.options for t in tc.load_config(config).tiers if t.kind == "s3")
    boto3.client("s3", endpoint_url=s3.endpoint_url, region_name=s3.region).create_bucket(Bucket=s3.bucket)


def torchrun(*example_args: str) -> str:
    """The compose trainer's command, on this machine: 2 ranks, gloo. Its output is shown and returned."""
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", str(EXAMPLE),
               *example_args]
    return run(command)


def cli(config: Path, *args: str) -> str:
    print(f"$ tiered-ckpt -c {config} {' '.join(args)}", flush=True)
    return run([sys.executable, "-m", "tiered_ckpt.cli", "-c", str(config), *args], echo=False)


def run(command: list[str], echo: bool = True) -> str:
    if echo:
        print("$ " + " ".join(command), flush=True)
    proc = subprocess.Popen(command, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines = []
    try:
        for line in proc.stdout:  # shown as it comes: a long run shows its progress
            print(line, end="", flush=True)
            lines.append(line)
        proc.wait()
    except BaseException:  # interrupted (Ctrl-C, SIGTERM): torchrun stops its ranks on SIGTERM
        proc.terminate()
        proc.wait(timeout=60)
        raise
    if proc.wait() != 0:
        raise SystemExit(f"{' '.join(command)} exited {proc.returncode}")
    return "".join(lines)


def summarize(config: Path, resume_output: str) -> dict:
    """What the index says now, and where the resume started from."""
    resumed = RESUMED.search(resume_output)
    with tc.Checkpointer.from_toml(config) as ckpt:
        statuses = ckpt.list()
    complete = {s.step: sorted(s.complete) for s in statuses}
    return {"resumed_from": int(resumed.group(1)) if resumed else None,
            "resumed_tier": resumed.group(2) if resumed else None,
            "complete": complete,
            "complete_on_s3": [step for step, tiers in complete.items() if "s3" in tiers]}


if __name__ == "__main__":
    sys.exit(main())
