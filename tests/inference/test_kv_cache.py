"""keep_positions (a draft model's own DynamicCache): keep the prefix plus an accepted path's tree entries,
contiguously, in every layer. (The target's row cache: tests/inference/target/test_cache.py.)"""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache, LlamaConfig, StaticCache

from spechead.inference.kv_cache import cache_length, keep_positions

PAST, N, LAYERS = 3, 6, 3


def filled_cache() -> DynamicCache:
    """A DynamicCache with LAYERS layers of PAST + N positions; keys[..., s, :] = s (+100 per layer),
    values = -keys, shapes [1, kv_heads=2, S, D=4]."""
    cache = DynamicCache()
    pos = torch.arange(PAST + N, dtype=torch.float32)[None, None, :, None].expand(1, 2, PAST + N, 4)
    for layer in range(LAYERS):
        keys = pos + 100 * layer
        cache.update(keys.clone(), -keys.clone(), layer)
    return cache


def positions(cache: DynamicCache, layer: int) -> list[int]:
    keys = cache.layers[layer].keys  # [1, 2, S, 4]
    assert torch.equal(cache.layers[layer].values, -keys)
    return [int(x) - 100 * layer for x in keys[0, 0, :, 0].tolist()]


@pytest.mark.parametrize(
    ("keep", "expected"),
    [
        ([0, 2, 5], [0, 1, 2, 3, 5, 8]),  # a branch: gather
        (torch.tensor([0, 1, 2]), [0, 1, 2, 3, 4, 5]),  # a chain prefix: plain crop
        ([0], [0, 1, 2, 3]),  # nothing drafted accepted: only the root
        ([], [0, 1, 2]),  # crop back to the prefix
    ],
)
def test_keep_positions_every_layer(keep, expected):
    cache = filled_cache()
    assert cache_length(cache) == PAST + N
    keep_positions(cache, PAST, keep)
    assert cache_length(cache) == len(expected)
    for layer in range(LAYERS):
        assert positions(cache, layer) == expected
        assert cache.layers[layer].keys.shape == (1, 2, len(expected), 4)
    # the cache keeps growing normally afterwards
    cache.update(torch.zeros(1, 2, 1, 4), torch.zeros(1, 2, 1, 4), 0)
    assert cache.layers[0].keys.shape[-2] == len(expected) + 1


def test_keep_positions_errors():
    cache = filled_cache()
    with pytest.raises(ValueError, match="cannot keep node"):
        keep_positions(cache, PAST, [0, N])
    with pytest.raises(ValueError, match=">= 0"):
        keep_positions(cache, PAST, [-1])
    cfg = LlamaConfig(
        vocab_size=10, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2
    )
    with pytest.raises(NotImplementedError, match="StaticCache"):
        keep_positions(StaticCache(config=cfg, max_cache_len=16), 0, [0])
    cfg.sliding_window, cfg.layer_types = 4, ["sliding_attention", "full_attention"]
    with pytest.raises(NotImplementedError, match="DynamicSlidingWindowLayer"):
        keep_positions(DynamicCache(config=cfg), 0, [0])


def test_a_past_len_beyond_a_layer_is_refused_at_the_boundary():
    """One position past what a layer holds is refused (not silently cropped to nothing)."""
    with pytest.raises(ValueError, match=r"holds 9 positions < past_len=10"):
        keep_positions(filled_cache(), PAST + N + 1, [])
    keep_positions(filled_cache(), PAST + N, [])  # (exactly what it holds: a no-op crop)


def test_empty_cache_length():
    assert cache_length(DynamicCache()) == 0
