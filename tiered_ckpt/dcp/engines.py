"""One open engine per job and process, shared by every StorageWriter and StorageReader made for it.

DCP makes a new StorageWriter for each save, but an engine is opened once per job (opening joins the other
ranks on a gloo group of its own, becomes the job's writer and fences earlier runs): the first writer or reader
of a (config, job) opens a Checkpointer, later ones reuse it, and `close()` (or the process's exit) closes it.
The engine's event loop runs on the Checkpointer's thread, so DCP's calls, made from the training thread or
from async_save's background thread, block on it like any Checkpointer call.
"""
from __future__ import annotations

import atexit
import os
import threading
from typing import Any

from ..config import Config, load_config
from ..sync import Checkpointer

ConfigLike = Config | str | os.PathLike[str]
_lock = threading.Lock()
_open: dict[tuple[Any, str], Checkpointer] = {}


def resolve(config: ConfigLike, job: str | None) -> Config:
    """The Config a writer or reader names: a TOML file (a ConfigError names it when it is missing or wrong) or a
    Config, with `job` replacing `[engine] job` when given."""
    if isinstance(config, (str, os.PathLike)):
        return load_config(config, **({"job": job} if job is not None else {}))
    if not isinstance(config, Config):
        raise TypeError(f"config must be a TOML file's path or a tiered_ckpt.Config, not {type(config).__name__}")
    return config.replace_engine(job=job) if job is not None and job != config.engine.job else config


def _key(config: Config) -> tuple[Any, str]:
    # a Config is frozen and compares by value: the same keys share one engine whichever object carries them
    return (config.engine, config.tiers), config.engine.job


def checkpointer(config: Config) -> Checkpointer:
    """The open engine of `config`'s job in this process, opened now if none is (under torch.distributed every
    rank must make its first writer or reader at the same point: opening is collective)."""
    key = _key(config)
    with _lock:
        ckpt = _open.get(key)
        if ckpt is None or ckpt._loop.is_closed():
            ckpt = Checkpointer(config)
            _open[key] = ckpt
        return ckpt


def close(config: ConfigLike | None = None, *, job: str | None = None) -> None:
    """Wait for the saves in flight and close the engine of `config` (every engine when None). Under
    torch.distributed call it on every rank, before destroy_process_group()."""
    with _lock:
        if config is None:
            ckpts = list(_open.values())
            _open.clear()
        else:
            ckpt = _open.pop(_key(resolve(config, job)), None)
            ckpts = [ckpt] if ckpt is not None else []
    for ckpt in ckpts:
        ckpt.close()


def _close_at_exit() -> None:
    """Saves still in flight finish before the process ends (their tiers would otherwise hold partial copies):
    run before the interpreter stops its thread pools, which the engine's I/O runs on."""
    with _lock:
        ckpts = list(_open.values())
        _open.clear()
    for ckpt in ckpts:
        try:
            ckpt.close(raise_errors=False)
        except Exception:  # the process group may be gone by now: the saves were waited for all the same
            pass


try:  # before concurrent.futures' own exit hook (these run in reverse order of registration)
    threading._register_atexit(_close_at_exit)  # type: ignore[attr-defined]
except (AttributeError, RuntimeError):
    atexit.register(_close_at_exit)
