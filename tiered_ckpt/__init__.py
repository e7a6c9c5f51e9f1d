"""tiered_ckpt: near-free checkpointing of PyTorch training through tiers of storage.

The public names are imported on first use (PEP 562), not with the package: `import tiered_ckpt.cli` must not
import torch, so that `tiered-ckpt ls` answers at once. `tc.Engine` and `from tiered_ckpt import Engine`
work as before; type checkers see the imports below.
"""
from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .config import Config, EngineConfig, TierConfig, load_config
    from .engine import Engine
    from .interval import Advice, FailureRates, SaveCosts, advise
    from .errors import (AuthenticationError, CheckpointExists, CheckpointLost, ConfigError, Fenced, FreshStart,
                         IncompleteCheckpoint,
                         IndexUnavailable, IntegrityError, RankFailed, SaveError, StateError, TieredCkptError,
                         TierError, TierFull, TierNotFound, TierTimeout, TierUnavailable, WriterConflict)
    from .load.heal import HealReport
    from .load.reads import LoadInfo
    from .observe.events import LoadEvent, RemovalEvent, SaveEvent, TierEvent
    from .save.handle import SaveHandle, TierDone
    from .save.reserve import Reservation
    from .state import PerRank
    from .storage.index import CheckpointStatus
    from .storage.verified_read import Fallback
    from .sync import Checkpointer, SyncSaveHandle
    from .train_state import TrainState

__version__ = "0.1.0"
__all__ = [
    "Engine", "Checkpointer", "TrainState", "PerRank", "SaveHandle", "SyncSaveHandle", "TierDone", "Reservation", "LoadInfo",
    "HealReport", "Fallback", "CheckpointStatus", "SaveEvent", "TierEvent", "LoadEvent", "RemovalEvent",
    "Config", "EngineConfig", "TierConfig", "load_config", "advise", "SaveCosts", "FailureRates", "Advice",
    "TieredCkptError", "ConfigError", "StateError", "TierError", "TierNotFound", "TierUnavailable", "TierTimeout",
    "TierFull", "IntegrityError", "IncompleteCheckpoint", "CheckpointLost", "FreshStart", "CheckpointExists",
    "SaveError", "RankFailed", "IndexUnavailable", "Fenced", "WriterConflict", "AuthenticationError",
]
_ERRORS = ("TieredCkptError", "ConfigError", "StateError", "TierError", "TierNotFound", "TierUnavailable",
           "TierTimeout", "TierFull", "IntegrityError", "IncompleteCheckpoint", "CheckpointLost", "FreshStart",
           "CheckpointExists",
           "SaveError", "RankFailed", "IndexUnavailable", "Fenced", "WriterConflict", "AuthenticationError")
_EVENTS = ("SaveEvent", "TierEvent", "LoadEvent", "RemovalEvent")
_MODULE_OF = {  # public name → the module that defines it
    "Engine": ".engine", "Checkpointer": ".sync", "SyncSaveHandle": ".sync", "TrainState": ".train_state",
    "PerRank": ".state", "SaveHandle": ".save.handle", "TierDone": ".save.handle", "Reservation": ".save.reserve",
    "LoadInfo": ".load.reads", "HealReport": ".load.heal", "Fallback": ".storage.verified_read",
    "CheckpointStatus": ".storage.index", "Config": ".config", "EngineConfig": ".config", "TierConfig": ".config",
    "load_config": ".config", **dict.fromkeys(("advise", "SaveCosts", "FailureRates", "Advice"), ".interval"), **dict.fromkeys(_EVENTS, ".observe.events"), **dict.fromkeys(_ERRORS, ".errors"),
}


def __getattr__(name: str) -> Any:
    module = _MODULE_OF.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(module, __name__), name)
    globals()[name] = value  # once: later lookups do not come here
    return value


def __dir__() -> list[str]:
    """The public names (resolved or not) and the module's own dunders; not the helpers of this file."""
    return sorted(set(__all__) | {"__version__"} | {n for n in globals() if n.startswith("__") and n.endswith("__")})
