"""No Docker engine runs here, so check what can be checked: docker-compose.yml, tiers/compose.toml and
the Dockerfile agree on services, ports, bucket, credentials and the command."""
from pathlib import Path
from urllib.parse import urlparse

import yaml

import tiered_ckpt as tc

REPO = Path(__file__).resolve().parents[2]


def test_compose_file_and_preset_agree():
    compose = yaml.safe_load((REPO / "docker-compose.yml").read_text())
    services = compose["services"]
    config = tc.load_config(REPO / "tiers" / "compose.toml")
    tiers = {t.kind: t for t in config.tiers}

    def published(service: str) -> set[int]:
        return {int(p.split(":")[-1]) for p in services[service].get("ports", [])}

    for url in (config.engine.index, *tiers["redis"].options.urls):
        parsed = urlparse(url)
        assert parsed.hostname in services and parsed.port in published(parsed.hostname) | {6379}
    s3 = tiers["s3"].options
    endpoint = urlparse(s3.endpoint_url)
    assert endpoint.hostname == "minio" and endpoint.port in published("minio")
    assert f"local/{s3.bucket}" in services["createbucket"]["entrypoint"]  # the bucket exists at start
    trainer, minio = services["trainer"], services["minio"]
    assert trainer["environment"]["AWS_ACCESS_KEY_ID"] == minio["environment"]["MINIO_ROOT_USER"]
    assert trainer["environment"]["AWS_SECRET_ACCESS_KEY"] == minio["environment"]["MINIO_ROOT_PASSWORD"]
    command = trainer["command"]
    assert "tiers/compose.toml" in command and (REPO / command[command.index("--config") - 1]).exists()
    assert {"redis", "createbucket"} <= set(trainer["depends_on"])
    dockerfile = (REPO / "Dockerfile").read_text()
    assert all(f"COPY {d}" in dockerfile for d in ("tiered_ckpt", "examples", "tiers"))
