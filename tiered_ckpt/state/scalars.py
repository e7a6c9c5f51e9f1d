"""0-d tensors kept as plain values in a checkpoint's skeleton, and made tensors again when it is read.

Lightning's ModelCheckpoint keeps its scores as 0-d tensors: `best_model_score`, `current_score`, `kth_value`,
and one per kept checkpoint path in `best_k_models`. As tensors they change the checkpoint's set of tensors at
nearly every save, so each save planned anew and, with the memory tier staging its own files (whose size must
be the state's exactly), made a new staging buffer: with `save_top_k=-1`, one for every save. Kept as values,
the tensors of a Lightning checkpoint are the model's and the optimizers', the same at every save.

A value stands for a tensor as a dict with one key, `SCALAR`: `{SCALAR: [dtype name, number]}`. The number is
the tensor's `item()`, which holds every float, int and bool dtype's value exactly. No framework is imported
here (it lives below the integrations so that `tiered-ckpt export --to torch` can turn the values back into
tensors too).
"""
from __future__ import annotations

from typing import Any

import torch

SCALAR = "__tiered_ckpt_scalar__"
_DTYPES = {str(d).removeprefix("torch."): d for d in (
    torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.uint8, torch.int8, torch.int16, torch.int32,
    torch.int64, torch.bool)}


def scalars_as_values(tree: Any) -> Any:
    """A copy of `tree` (dicts, lists, tuples) with each 0-d tensor of a dtype above as a value. Reading a
    CUDA tensor's value waits for the kernels queued before it."""
    if isinstance(tree, dict):
        return {k: scalars_as_values(v) for k, v in tree.items()}
    if type(tree) in (list, tuple):
        return type(tree)(scalars_as_values(v) for v in tree)
    if isinstance(tree, torch.Tensor) and type(tree) in (torch.Tensor, torch.nn.Parameter) and tree.dim() == 0:
        name = str(tree.dtype).removeprefix("torch.")
        if name in _DTYPES:
            return {SCALAR: [name, tree.item()]}
    return tree


def values_as_scalars(tree: Any) -> Any:
    """`tree` with each value that stands for a 0-d tensor made that tensor again (on the CPU)."""
    if isinstance(tree, dict):
        marker = tree.get(SCALAR) if len(tree) == 1 else None
        if (type(marker) in (list, tuple) and len(marker) == 2 and marker[0] in _DTYPES
                and type(marker[1]) in (int, float, bool)):
            return torch.tensor(marker[1], dtype=_DTYPES[marker[0]])
        return {k: values_as_scalars(v) for k, v in tree.items()}  # (anything else that looks like one: as is)
    if type(tree) in (list, tuple):
        return type(tree)(values_as_scalars(v) for v in tree)
    return tree
