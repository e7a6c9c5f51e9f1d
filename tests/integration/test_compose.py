"""No Docker engine runs here, so check what can be checked: docker-compose.yml, tiers/compose.toml, the
Dockerfile and .dockerignore agree on services, ports, bucket, credentials and the command; every image is
pinned, every service waited for has a healthcheck, and nothing is published on the host.
(scripts/local_stack.py runs the same stack without Docker: tests/integration/test_local_stack.py.)"""
import re
from pathlib import Path
from urllib.parse import urlparse

import yaml

import tiered_ckpt as tc

REPO = Path(__file__).resolve().parents[2]
# the port each service listens on inside the network: the image's default (the commands set no other)
LISTENS = {"redis": 6379, "minio": 9000}
# an exact version (7.4.6, 3.11.13-slim-bookworm) or a dated MinIO release, never a moving tag
PINNED_TAG = re.compile(r"\d+\.\d+\.\d+(-[a-z0-9.-]+)?|RELEASE\.\d{4}-\d\d-\d\dT\d\d-\d\d-\d\dZ")


def compose_services() -> dict:
    return yaml.safe_load((REPO / "docker-compose.yml").read_text())["services"]


def dockerfile() -> str:
    return (REPO / "Dockerfile").read_text()


def test_compose_file_and_preset_agree():
    services = compose_services()
    config = tc.load_config(REPO / "tiers" / "compose.toml")
    tiers = {t.kind: t for t in config.tiers}

    assert "--port" not in services["redis"]["command"] and "--address" not in services["minio"]["command"]
    for url in (config.engine.index, *tiers["redis"].options.urls):
        parsed = urlparse(url)
        assert parsed.hostname == "redis" and parsed.port == LISTENS["redis"], url
    s3 = tiers["s3"].options
    endpoint = urlparse(s3.endpoint_url)
    assert endpoint.hostname == "minio" and endpoint.port == LISTENS["minio"]
    assert f"local/{s3.bucket}" in services["createbucket"]["entrypoint"]  # the bucket exists at start
    trainer, minio = services["trainer"], services["minio"]
    assert trainer["environment"]["AWS_ACCESS_KEY_ID"] == minio["environment"]["MINIO_ROOT_USER"]
    assert trainer["environment"]["AWS_SECRET_ACCESS_KEY"] == minio["environment"]["MINIO_ROOT_PASSWORD"]
    command = trainer["command"]
    assert "tiers/compose.toml" in command and (REPO / command[command.index("--config") - 1]).exists()
    assert {"redis", "createbucket"} <= set(trainer["depends_on"])
    assert all(f"COPY {d}" in dockerfile() for d in ("tiered_ckpt", "examples", "tiers"))


def test_every_image_is_pinned_to_an_exact_version():
    images = [s["image"] for s in compose_services().values() if "image" in s]
    images += re.findall(r"^FROM\s+(\S+)", dockerfile(), flags=re.MULTILINE)
    assert len(images) == 4, images
    for image in images:
        name, _, tag = image.rpartition(":")
        assert name and "/" not in tag, f"{image} names no tag"
        assert PINNED_TAG.fullmatch(tag), f"{image}: pin an exact version (not {tag!r})"


def test_services_are_waited_for_until_healthy_or_done():
    services = compose_services()
    assert {"redis", "minio"} <= {name for name, s in services.items() if s.get("healthcheck", {}).get("test")}
    for name, service in services.items():
        for needed, how in service.get("depends_on", {}).items():
            # a long-running service is ready once healthy; the bucket-creating job once it exited 0
            expected = "service_healthy" if "healthcheck" in services[needed] else "service_completed_successfully"
            assert how["condition"] == expected, f"{name} waits for {needed}: {how}"
    assert services["trainer"]["depends_on"]["createbucket"]["condition"] == "service_completed_successfully"


def test_no_port_is_published_on_the_host():
    assert {name: s["ports"] for name, s in compose_services().items() if "ports" in s} == {}


def test_dockerignore_keeps_checkpoints_and_benchmarks_out_of_the_build_context():
    ignored = {line.strip() for line in (REPO / ".dockerignore").read_text().splitlines()
               if line.strip() and not line.startswith("#")}
    assert {"checkpoints", ".bench", ".venv", ".git"} <= ignored
    copied = re.findall(r"^COPY\s+(.+?)\s+\S+$", dockerfile(), flags=re.MULTILINE)
    for source in " ".join(copied).split():  # what the image needs is never ignored
        assert source not in ignored, source
