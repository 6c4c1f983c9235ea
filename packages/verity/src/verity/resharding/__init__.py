"""verity.resharding: moving weights from the training layout to the rollout layout.

- :func:`iter_full_state_dict` gathers FSDP2 shards to full tensors in bounded buckets;
- :mod:`verity.resharding.names` maps trainer names to a rollout's names;
- :func:`slice_for_tp` cuts a full tensor for one rank of a tensor-parallel rollout
  (:func:`tp_slice_bounds`: where that rank's slice lies);
- :func:`iter_tp_slice_buckets` moves FSDP2 shards straight to each rank's TP slices (one
  all-to-all per bucket, about ``1 / TP`` of the model per rank); :func:`slice_full_buckets`
  slices a stream of full-tensor buckets locally;
- :func:`sync_weights` streams an engine's full weights (its ``iter_full_weights``, see
  :func:`iter_engine_weights`) into ``rollout.load_weights`` (in-process copy when
  colocated, :func:`copy_named_tensors_into`).
"""

from __future__ import annotations

from verity.resharding.gather import (
    DEFAULT_BUCKET_BYTES,
    iter_full_state_dict,
    iter_full_state_dict_buckets,
    named_weights,
    plan_buckets,
)
from verity.resharding.names import (
    NameMapper,
    add_prefix,
    compose,
    identity_names,
    map_names,
    regex_rename,
    skip_matching,
    strip_prefix,
)
from verity.resharding.sync import (
    ModuleWeightReceiver,
    SyncStats,
    copy_named_tensors_into,
    iter_engine_weights,
    sync_weights,
)
from verity.resharding.tp_reshard import iter_tp_slice_buckets, slice_full_buckets
from verity.resharding.tp_slice import slice_for_tp, tp_slice_bounds, tp_split_dim

__all__ = [
    "DEFAULT_BUCKET_BYTES",
    "ModuleWeightReceiver",
    "NameMapper",
    "SyncStats",
    "add_prefix",
    "compose",
    "copy_named_tensors_into",
    "identity_names",
    "iter_engine_weights",
    "iter_full_state_dict",
    "iter_full_state_dict_buckets",
    "iter_tp_slice_buckets",
    "map_names",
    "named_weights",
    "plan_buckets",
    "regex_rename",
    "skip_matching",
    "slice_for_tp",
    "slice_full_buckets",
    "strip_prefix",
    "sync_weights",
    "tp_slice_bounds",
    "tp_split_dim",
]
