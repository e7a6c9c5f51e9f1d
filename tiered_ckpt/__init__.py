"""tiered_ckpt: near-free checkpointing of PyTorch training through tiers of storage."""
from .config import Config, EngineConfig, TierConfig, load_config
from .engine import Engine
from .errors import (AuthenticationError, CheckpointExists, ConfigError, Fenced, IncompleteCheckpoint, IndexUnavailable,
                     IntegrityError, RankFailed, SaveError, StateError, TieredCkptError, TierError, TierFull,
                     TierNotFound, TierTimeout, TierUnavailable, WriterConflict)
from .storage.index import CheckpointStatus
from .load.reads import LoadInfo
from .save.handle import SaveHandle
from .state import PerRank
from .sync import Checkpointer, SyncSaveHandle
from .storage.tier_io import Fallback
from .train_state import TrainState

__version__ = "0.1.0"
__all__ = [
    "Engine", "Checkpointer", "TrainState", "PerRank", "SaveHandle", "SyncSaveHandle", "LoadInfo", "Fallback", "CheckpointStatus",
    "Config", "EngineConfig", "TierConfig", "load_config",
    "TieredCkptError", "ConfigError", "StateError", "TierError", "TierNotFound", "TierUnavailable", "TierTimeout",
    "TierFull", "IntegrityError", "IncompleteCheckpoint", "CheckpointExists", "SaveError", "RankFailed",
    "IndexUnavailable", "Fenced", "WriterConflict", "AuthenticationError",
]
