"""Prometheus metrics of an engine (the optional extra `prometheus`: `pip install -e '.[prometheus]'`).

    server = tiered_ckpt.metrics.serve(engine, 9400)   # http://0.0.0.0:9400/metrics, until server.close()
    metrics = tiered_ckpt.metrics.EngineMetrics(engine.job, registry)   # or into a registry of your own:
    engine.on_event(metrics)                                              # serve it as you like

`[engine] metrics_port = 9400` does the same as serve() for the engine's lifetime. The metric names are in
docs/operations.md, *Observability*."""
from __future__ import annotations

from .observe.prometheus import EngineMetrics, MetricsServer, serve

__all__ = ["serve", "EngineMetrics", "MetricsServer"]
