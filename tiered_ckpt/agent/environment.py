"""What a tier's client reads from the process environment beside its config table: the AWS chain (credentials,
profile, config files, region, endpoint, CA bundle: AWS_*), HOME (~/.aws) and proxies. The agent writes with its
own environment, that of the trainer that started it, so a trainer hands a save that writes such a tier only to an
agent whose environment matches its own in these variables: compared as a digest, so no secret crosses the socket.
(An agent started by a job with other credentials would write this job's S3 tier with them, or fail for lack of
them: seen when one agent served two jobs.)"""
from __future__ import annotations

import hashlib
import os
from typing import Any, Mapping, Sequence

ENVIRONMENT_KINDS = frozenset({"s3"})  # tier kinds whose client reads the environment (config.py's kinds)
NAMES = frozenset({"HOME", "HTTP_PROXY", "HTTPS_PROXY", "NO_PROXY", "http_proxy", "https_proxy", "no_proxy",
                   "REQUESTS_CA_BUNDLE", "SSL_CERT_FILE", "SSL_CERT_DIR"})


def environment_digest(environ: Mapping[str, str] | None = None) -> str:
    """A digest of the variables those tiers read (the same in two processes when they would write alike)."""
    env = os.environ if environ is None else environ
    items = sorted((k, v) for k, v in env.items() if k.startswith("AWS_") or k in NAMES)
    return hashlib.sha256(repr(items).encode()).hexdigest()[:24]


def environment_tiers(tables: Sequence[Mapping[str, Any]]) -> list[str]:
    """The tiers (config tables, as handed over) whose writes depend on the environment."""
    return [str(t["name"]) for t in tables if t.get("kind") in ENVIRONMENT_KINDS]
