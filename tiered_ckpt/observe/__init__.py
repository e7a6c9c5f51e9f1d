"""Observability: a structured record of every save, load and retention removal (events.py), handed to the
application's callbacks, written as JSON lines (jsonl.py), and exported as Prometheus metrics (prometheus.py,
public as `tiered_ckpt.metrics`). docs/operations.md, *Observability*, describes the records and the metrics.

Base layer: nothing here imports the save or load path at run time; the engine hands over the SaveHandle and
the LoadInfo, whose public surface is all the records are built from."""
