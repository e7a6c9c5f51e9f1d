"""`python dcp_process_mode.py ROOT`: dcp.async_save in DCP's process mode with tiered_ckpt's StorageWriter, at one
rank of a gloo group; prints the error it ends in (test_dcp.py checks it)."""
import os
import socket
import sys

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

from tiered_ckpt.dcp import StorageWriter, close
from tiered_ckpt.testing.configs import stack

if __name__ == "__main__":
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=0, world_size=1)
    writer = StorageWriter(stack(sys.argv[1], "memory", "local"), step=1)
    try:
        dcp.async_save({"w": torch.ones(4)}, storage_writer=writer,
                       async_checkpointer_type=AsyncCheckpointerType.PROCESS).result()
        print("no error")
    except BaseException as e:  # DCP's CheckpointException is a BaseException
        print(f"{type(e).__name__}: {e}")
    close()
    dist.destroy_process_group()
    os._exit(0)  # DCP's checkpoint process is left to end with its parent
