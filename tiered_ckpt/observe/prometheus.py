"""Prometheus metrics of one engine, from its records (events.py), in a registry of the engine's own, served
over HTTP by prometheus_client (the optional extra `prometheus`). `prometheus_client` is imported only when
metrics are made, so the package and the CLI never need it. The public helpers are `tiered_ckpt.metrics`."""
from __future__ import annotations

import logging
import os
import threading
from dataclasses import dataclass
from typing import Any, Callable, Protocol

from .events import Event, EventCallback, LoadEvent, RemovalEvent, SaveEvent, TierEvent

log = logging.getLogger(__name__)
EXTRA = "pip install -e '.[prometheus]' from a clone (or pip install 'prometheus_client>=0.20')"
# save() pauses training for milliseconds to seconds; a tier may take minutes to hold a large checkpoint
BLOCKED_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
MAX_PORT = 65535
DURABLE_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0, 1800.0)


def prometheus_client() -> Any:
    """The prometheus_client module, or an ImportError that names the extra to install."""
    try:
        import prometheus_client as client
    except ImportError as e:
        raise ImportError(f"Prometheus metrics need the prometheus_client package: {EXTRA}") from e
    return client


class EngineMetrics:
    """A subscriber (`engine.on_event(metrics)`) that keeps one engine's metrics in `registry` (a fresh
    CollectorRegistry unless given). Every series carries the job as label `job_name` (Prometheus's own `job`
    label names the scrape job)."""

    def __init__(self, job: str, registry: Any = None, *, saves_in_flight: Callable[[], int] | None = None):
        client = prometheus_client()
        self.job = job
        self.registry = client.CollectorRegistry(auto_describe=True) if registry is None else registry
        r, tier = self.registry, ["job_name", "tier"]
        self._newest: dict[str, int] = {}  # tier → the newest step committed there
        self.save_blocked = client.Histogram(
            "tiered_ckpt_save_blocked_seconds", "How long save() blocked the caller (the copy into staging buffers)",
            ["job_name"], registry=r, buckets=BLOCKED_BUCKETS)
        self.save_staged = client.Histogram(
            "tiered_ckpt_save_staged_seconds", "From save() until the copy into staging buffers was done",
            ["job_name"], registry=r, buckets=BLOCKED_BUCKETS)
        self.save_paused = client.Histogram(
            "tiered_ckpt_save_paused_seconds", "What the training loop waited for the save: save(), and for a lazy "
            "save its wait in staged()", ["job_name"], registry=r, buckets=BLOCKED_BUCKETS)
        self.save_durable = client.Histogram(
            "tiered_ckpt_save_durable_seconds", "From save() until the checkpoint was committed on the tier",
            tier, registry=r, buckets=DURABLE_BUCKETS)
        self.saves = client.Counter(
            "tiered_ckpt_saves", "Saves finished per tier, by outcome (committed, skipped, failed)",
            [*tier, "outcome"], registry=r)
        self.save_bytes = client.Counter(
            "tiered_ckpt_save_bytes", "Bytes of this process's parts committed to the tier", tier, registry=r)
        self.last_committed = client.Gauge(
            "tiered_ckpt_last_committed_step", "The newest step this process saw committed on the tier", tier,
            registry=r)
        self.loads = client.Counter(
            "tiered_ckpt_loads", "Loads, by outcome (ok, failed)", ["job_name", "outcome"], registry=r)
        self.load_seconds = client.Histogram(
            "tiered_ckpt_load_seconds", "How long successful load() calls took", ["job_name"], registry=r,
            buckets=DURABLE_BUCKETS)
        self.load_bytes = client.Counter(
            "tiered_ckpt_load_bytes", "Bytes this process read from the tier in loads", tier, registry=r)
        self.load_fallbacks = client.Counter(
            "tiered_ckpt_load_fallbacks", "Parts a load read from a slower tier because the preferred one could "
            "not serve them intact", ["job_name"], registry=r)
        self.last_loaded = client.Gauge(
            "tiered_ckpt_last_loaded_step", "The step the last successful load restored", ["job_name"], registry=r)
        self.removals = client.Counter(
            "tiered_ckpt_removals", "Checkpoints this process removed from the tier (retention, delete, cleanup)",
            tier, registry=r)
        if saves_in_flight is not None:
            self.in_flight = client.Gauge(
                "tiered_ckpt_saves_in_flight", "Saves not yet finished on every tier they target", ["job_name"],
                registry=r)
            self.in_flight.labels(job).set_function(saves_in_flight)

    def __call__(self, event: Event) -> None:
        job = self.job
        if isinstance(event, TierEvent):
            self.saves.labels(job, event.tier, event.outcome).inc()
            if event.committed:
                if event.seconds is not None:
                    self.save_durable.labels(job, event.tier).observe(event.seconds)
                self.save_bytes.labels(job, event.tier).inc(event.nbytes)
                # steps may commit out of order on a tier (a slow save, a skip): the gauge keeps the newest
                newest = max(event.step, self._newest.get(event.tier, event.step))
                self._newest[event.tier] = newest
                self.last_committed.labels(job, event.tier).set(newest)
        elif isinstance(event, SaveEvent):
            self.save_blocked.labels(job).observe(event.blocked_seconds)
            if event.staged_seconds is not None:
                self.save_staged.labels(job).observe(event.staged_seconds)
            if event.paused_seconds is not None:
                self.save_paused.labels(job).observe(event.paused_seconds)
        elif isinstance(event, LoadEvent):
            self.loads.labels(job, "failed" if event.error else "ok").inc()
            if event.error is None:
                self.load_seconds.labels(job).observe(event.seconds)
                for tier, nbytes in event.nbytes_by_tier.items():
                    self.load_bytes.labels(job, tier).inc(nbytes)
                self.load_fallbacks.labels(job).inc(event.fallbacks)
                if event.step is not None:
                    self.last_loaded.labels(job).set(event.step)
        elif isinstance(event, RemovalEvent):
            self.removals.labels(job, event.tier).inc()


@dataclass
class MetricsServer:
    """What `serve` started: the metrics, the HTTP server (its `port`, the one bound) and how to stop both."""

    metrics: EngineMetrics
    port: int
    addr: str
    _server: Any
    _thread: threading.Thread
    _unsubscribe: Callable[[], None]

    @property
    def registry(self) -> Any:
        return self.metrics.registry

    def close(self) -> None:
        """Stop recording and serving; the port is free again when this returns."""
        self._unsubscribe()
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=5)


class Observed(Protocol):
    """What `serve` reads of an Engine (this package sits below engine.py and does not import it)."""

    @property
    def job(self) -> str: ...

    @property
    def saves_in_flight(self) -> int: ...

    def on_event(self, callback: EventCallback) -> Callable[[], None]: ...


def rank_port(base: int, addr: str) -> int | None:
    """`[engine] metrics_port` plus this process's LOCAL_RANK (torchrun's; 0 without it), so the ranks of a node
    take consecutive ports; None, logged as an error, when that is no port (above 65535, or a LOCAL_RANK that is
    no whole number >= 0): like a taken port, it costs the metrics, never the training."""
    text = os.environ.get("LOCAL_RANK", "") or "0"
    try:
        local_rank = int(text)
    except ValueError:
        local_rank = -1
    if local_rank < 0:
        log.error("metrics are not served on %s: LOCAL_RANK=%r is no whole number >= 0 ([engine] metrics_port %d "
                  "adds it)", addr, text, base)
        return None
    port = base + local_rank
    if port > MAX_PORT:
        log.error("metrics are not served on %s: [engine] metrics_port %d + LOCAL_RANK %d is port %d, above %d "
                  "(give a metrics_port that leaves room for every rank of the node)", addr, base, local_rank,
                  port, MAX_PORT)
        return None
    return port


def serve(engine: Observed, port: int = 0, addr: str = "0.0.0.0") -> MetricsServer:
    """Record `engine`'s saves, loads and removals as Prometheus metrics and serve them at
    http://addr:port/metrics (port 0: a free port, see `.port`), from a daemon thread. `close()` stops it (the
    engine's own server, `[engine] metrics_port`, stops at engine.close())."""
    client = prometheus_client()
    metrics = EngineMetrics(engine.job, saves_in_flight=lambda: engine.saves_in_flight)
    server, thread = client.start_http_server(port, addr=addr, registry=metrics.registry)
    unsubscribe = engine.on_event(metrics)
    return MetricsServer(metrics, server.server_port, addr, server, thread, unsubscribe)
