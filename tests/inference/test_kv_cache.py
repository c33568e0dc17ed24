"""crop (a draft model's own DynamicCache): keep the first positions (committed tokens) in every
layer. (The target's row cache: tests/inference/target/test_cache.py.)"""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache, LlamaConfig, StaticCache

from spechead.inference.kv_cache import crop

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


@pytest.mark.parametrize("length", [PAST + N, PAST + 3, PAST + 1, PAST, 0])
def test_crop_keeps_the_first_positions_of_every_layer(length):
    """The whole cache (a no-op), an accepted chain of 3 after the prefix, the root only, the prefix, none."""
    cache = filled_cache()
    assert cache.get_seq_length() == PAST + N
    crop(cache, length)
    assert cache.get_seq_length() == length
    for layer in range(LAYERS):
        assert positions(cache, layer) == list(range(length))
        assert cache.layers[layer].keys.shape == (1, 2, length, 4)
    # the cache keeps growing normally afterwards
    cache.update(torch.zeros(1, 2, 1, 4), torch.zeros(1, 2, 1, 4), 0)
    assert cache.layers[0].keys.shape[-2] == length + 1


def test_crop_errors():
    cfg = LlamaConfig(
        vocab_size=10, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2
    )
    with pytest.raises(NotImplementedError, match="StaticCache"):
        crop(StaticCache(config=cfg, max_cache_len=16), 0)
    cfg.sliding_window, cfg.layer_types = 4, ["sliding_attention", "full_attention"]
    with pytest.raises(NotImplementedError, match="DynamicSlidingWindowLayer"):
        crop(DynamicCache(config=cfg), 0)


def test_a_length_beyond_a_layer_is_refused_at_the_boundary():
    """One position past what a layer holds is refused (not silently kept short)."""
    with pytest.raises(ValueError, match=r"holds 9 positions < length=10"):
        crop(filled_cache(), PAST + N + 1)
