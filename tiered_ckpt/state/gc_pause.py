"""Moved to tiered_ckpt/gc_pause.py (it needs no torch, and this package imports torch: the Redis index, which
the torch-free CLI commands open, uses it); this name stays for code that imports it from here."""
from ..gc_pause import automatic_gc_paused

__all__ = ["automatic_gc_paused"]
