"""tiered_ckpt as a storage backend of torch.distributed.checkpoint (DCP).

    import torch.distributed.checkpoint as dcp
    from tiered_ckpt.dcp import StorageWriter, StorageReader

    dcp.save(state, storage_writer=StorageWriter("tiered.toml", step=step))
    future = dcp.async_save(state, storage_writer=StorageWriter("tiered.toml", step=step))  # the writer stages
    dcp.load(state, storage_reader=StorageReader("tiered.toml"))  # the newest complete checkpoint

The writers and readers of one job share one engine per process; `close()` closes it (at exit otherwise).
See docs/integrations.md.
"""
from .engines import close
from .reader import StorageReader
from .writer import StorageWriter

__all__ = ["StorageWriter", "StorageReader", "close"]
