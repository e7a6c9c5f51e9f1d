"""State ↔ (skeleton, tensors).

The skeleton is the state's nested structure with every tensor replaced by a TensorRef and every object
that has state_dict() replaced by its state dict. It is msgpack-encoded (never pickle unless the user opts
in), so plain values such as a learning rate or a step counter round-trip exactly. Every rank stores its
own skeleton. Loading walks the caller's state and a saved skeleton together and fills tensors in place.

The rules of what comes back (docs/state.md):
- a tensor is saved under its path ("model/layer/weight"); a plain tensor with the same path on several
  ranks is one replicated tensor, written once; `PerRank(x)` saves x under a per-rank name instead;
- entries that share one storage (tied weights) are saved once; the others are aliases of the first;
- a subtree that holds no tensors is a value: load replaces it whole (lists of any length, dicts, None);
- containers that hold tensors are matched strictly, key by key; a saved dtype is cast to the target's.

Split by direction: skeleton.py (the markers and the encoding), flatten.py (a state → skeleton and tensors,
for saves), match.py (a state paired with a saved skeleton, for loads).
"""
from .flatten import flatten
from .match import LoadTarget, Matcher, SavedTensor, match
from .skeleton import (MAX_DEPTH, MISSING_POLICIES, FlatState, PerRank, PerRankMark, Pickled, SavedName,
                       TensorAlias, TensorRef, _UNSUPPORTED, any_in_tree, check_dtype, decode_skeleton,
                       encode_skeleton, path_str, per_rank_name, saved_tree, tensor_ref)

__all__ = ["MAX_DEPTH", "MISSING_POLICIES", "FlatState", "LoadTarget", "Matcher", "PerRank", "PerRankMark",
           "Pickled", "SavedName", "SavedTensor", "TensorAlias", "TensorRef", "_UNSUPPORTED", "any_in_tree",
           "check_dtype", "decode_skeleton", "encode_skeleton", "flatten", "match", "path_str", "per_rank_name",
           "saved_tree", "tensor_ref"]
