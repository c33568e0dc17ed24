"""keep_positions: keep the prefix plus an accepted path's tree entries, contiguously, in every layer."""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache, LlamaConfig, StaticCache

from spechead.inference.kv_cache import SlotCache, cache_length, commit_path, keep_positions

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


def test_a_past_len_beyond_a_layer_and_a_full_slot_cache_are_refused_at_the_boundary():
    """One position past what a layer holds is refused (not silently cropped to nothing), and a slot cache
    refuses the first write past max_length in one line (not a copy error), the last one that fits passes."""
    with pytest.raises(ValueError, match=r"holds 9 positions < past_len=10"):
        keep_positions(filled_cache(), PAST + N + 1, [])
    keep_positions(filled_cache(), PAST + N, [])  # (exactly what it holds: a no-op crop)
    cache = SlotCache(1, 4)
    layer = cache.layers[0]
    layer.update(torch.ones(1, 1, 3, 2), torch.ones(1, 1, 3, 2))
    cache.set_length(3)
    with pytest.raises(ValueError, match=r"^preallocated KV cache full: 3 \+ 2 positions > max_length 4$"):
        layer.update(torch.ones(1, 1, 2, 2), torch.ones(1, 1, 2, 2))
    keys, _ = layer.update(torch.full((1, 1, 1, 2), 5.0), torch.ones(1, 1, 1, 2))  # 3 + 1 = 4: fits
    assert keys.shape[-2] == 4 and keys[0, 0, 3, 0] == 5.0


def test_empty_cache_length():
    assert cache_length(DynamicCache()) == 0


def filled_slots(max_length: int = 16, batch: int = 1) -> SlotCache:
    """A SlotCache with LAYERS layers holding PAST + N positions written as filled_cache's."""
    cache = SlotCache(LAYERS, max_length)
    pos = torch.arange(PAST + N, dtype=torch.float32)[None, None, :, None].expand(batch, 2, PAST + N, 4)
    for layer in range(LAYERS):
        keys = pos + 100 * layer
        cache.update(keys.clone(), -keys.clone(), layer)
    return cache


def slot_positions(cache: SlotCache, layer: int) -> list[int]:
    slot = cache.slot_layers[layer]
    keys = slot.keys[:, :, : slot.length]  # [B, 2, length, 4]
    assert torch.equal(slot.values[:, :, : slot.length], -keys)
    return [int(x) - 100 * layer for x in keys[0, 0, :, 0].tolist()]


def test_slot_cache_layers_share_one_buffer_and_commit_moves_every_layer():
    cache = filled_slots()
    assert cache.shared_storage() is not None and cache.storage.shape == (LAYERS, 2, 1, 2, 16, 4)
    assert all(
        layer.keys.data_ptr() == cache.storage[i, 0].data_ptr() for i, layer in enumerate(cache.slot_layers)
    )
    commit_path(cache, PAST, torch.tensor([0, 2, 5]))
    assert [slot_positions(cache, layer) for layer in range(LAYERS)] == [[0, 1, 2, 3, 5, 8]] * LAYERS
    cache.grow(40)  # reallocated: the valid entries stay, in one new buffer
    assert cache.shared_storage() is not None and cache.storage.shape[-2] == 40
    assert [slot_positions(cache, layer) for layer in range(LAYERS)] == [[0, 1, 2, 3, 5, 8]] * LAYERS


def test_crop_to_drops_every_layers_scratch_and_skips_only_when_the_layers_are_there():
    """crop_to(length): every layer back to `length`; an eager cache whose layers wrote exactly up to it
    is left alone (their own lengths moved as they wrote), a fixed-shape one is always set (its device
    length does not move as it writes)."""
    cache = filled_slots()  # every layer at PAST + N
    cache.crop_to(PAST + N)
    assert [layer.length for layer in cache.slot_layers] == [PAST + N] * LAYERS
    cache.slot_layers[-1].length = PAST + N + 2  # a later layer ahead: only the first is read
    cache.crop_to(PAST + N)
    assert cache.slot_layers[-1].length == PAST + N + 2
    cache.crop_to(PAST)  # scratch past PAST dropped in every layer
    assert [layer.length for layer in cache.slot_layers] == [PAST] * LAYERS
    fixed = SlotCache(LAYERS, 16, static_shapes=True)
    for layer in range(LAYERS):
        fixed.update(torch.zeros(1, 2, 3, 4), torch.zeros(1, 2, 3, 4), layer)
    fixed.slot_layers[0].length_t.fill_(5)  # the device length moved (as a graph's write_at moves it)
    fixed.crop_to(0)  # the host lengths are at 0 already: set anyway
    assert int(fixed.device_length()) == 0


def test_slot_cache_without_one_buffer_commits_layer_by_layer():
    """Layers that cannot share (another batch size in one layer, or fixed shapes) commit one by one."""
    cache = filled_slots()
    storage = cache.storage
    cache.update(torch.zeros(2, 2, 1, 4), torch.zeros(2, 2, 1, 4), 0)  # layer 0 now holds 2 rows: own buffer
    assert cache.shared_storage() is None and cache.storage is storage  # no second [L, ...] buffer
    assert cache.slot_layers[0].keys.shape == (2, 2, 16, 4)
    cache = SlotCache(LAYERS, 16, static_shapes=True)
    assert cache.shared_storage() is None
    pos = torch.arange(PAST + N, dtype=torch.float32)[None, None, :, None].expand(1, 2, PAST + N, 4)
    for layer in range(LAYERS):
        cache.update((pos + 100 * layer).clone(), -(pos + 100 * layer), layer)
    cache.set_length(PAST + N)  # fixed shapes: the length moves outside the layers
    commit_path(cache, PAST, torch.tensor([0, 2, 5]))
    assert cache.shared_storage() is None
    assert [slot_positions(cache, layer) for layer in range(LAYERS)] == [[0, 1, 2, 3, 5, 8]] * LAYERS


def test_fixed_shape_layers_write_after_one_shared_device_length():
    """static_shapes: every layer on a device reads one 0-d length (moving it is one kernel, not one per
    layer); set_length and write_at move it for all; a layer on another device gets that device's own."""
    cache = SlotCache(LAYERS, 16, static_shapes=True)
    states = torch.zeros(1, 2, 2, 4)
    for layer in range(LAYERS):
        cache.update(states, states, layer)
    lengths = {id(layer.length_t) for layer in cache.slot_layers}
    assert len(lengths) == 1 and cache.device_length() is cache.slot_layers[-1].length_t
    cache.set_length(5)
    assert int(cache.device_length()) == 5 and [layer.length for layer in cache.slot_layers] == [5] * LAYERS
    cache.update(torch.ones(1, 2, 2, 4), torch.ones(1, 2, 2, 4), LAYERS - 1)  # writes slots 5, 6
    assert cache.slot_layers[-1].keys[0, 0, :, 0].tolist() == [0.0] * 5 + [1.0] * 2 + [0.0] * 9
    cache.write_at(torch.tensor(9))
    assert int(cache.device_length()) == 9 and cache.slot_layers[0].length == 5  # (the host's stays)
    cache.slot_layers[0].lazy_initialization(states.to("meta"), states.to("meta"))  # a layer elsewhere
    assert cache.slot_layers[0].length_t.device.type == "meta" and int(cache.slot_layers[1].length_t) == 9
    cache.set_length(3)
    assert int(cache.slot_layers[1].length_t) == 3 and cache.slot_layers[0].length_t.device.type == "meta"
