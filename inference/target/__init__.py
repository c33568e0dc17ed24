"""The target side of decoding: one row cache (cache.py), one runner (runner.py: prefill, verify token
trees by tree-size bucket, commit accepted paths, keep rows) and the hidden-state capture (capture.py)."""

from spechead.inference.target.cache import RowCache
from spechead.inference.target.capture import check_tree_attention
from spechead.inference.target.runner import CUDA_BUCKETS, TargetRunner, batch_capacity

__all__ = ["CUDA_BUCKETS", "RowCache", "TargetRunner", "batch_capacity", "check_tree_attention"]
