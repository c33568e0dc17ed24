"""The row cache: every layer's keys and values live in one buffer [L, 2, B, kv, S_max, D] when they share a
shape, so a commit (each row's accepted path moved into place after its own prefix) is one gather and a
row drop moves the later rows up in place; layers of several shapes keep their own buffers and give the
same results. A batch of one writes in a row (slices, no scatter); fixed shapes write after device
lengths and return the whole buffers."""

from __future__ import annotations

import pytest
import torch

from spechead.inference.target.cache import RowCache
from spechead.inference.target.commit import commit_row, commit_rows, move_fixed, padded_paths

LAYERS, S_MAX = 3, 16
LENGTHS = [3, 5, 4]  # committed positions of rows 0, 1, 2 before the tree entries
CPU = torch.device("cpu")


def filled(dims: list[int], batch: int = 3, lengths: list[int] = LENGTHS) -> RowCache:
    """A cache whose slot s of row b in layer i holds key 1000 b + 100 i + s (values: minus that), for
    layers of head dims `dims`, with `lengths` committed."""
    cache = RowCache(LAYERS, batch, S_MAX)
    cache.write_slots, cache.view_length = torch.arange(S_MAX).expand(batch, S_MAX), S_MAX
    for i, dim in enumerate(dims):
        slot = torch.arange(S_MAX, dtype=torch.float32)[None, None, :, None]
        rows = torch.arange(float(batch))[:, None, None, None]
        keys = (slot + 100 * i + 1000 * rows).expand(batch, 2, S_MAX, dim)
        cache.layers[i].update(keys.clone(), -keys.clone())
    cache.write_slots = None
    cache.set_lengths(lengths)
    return cache


def slots(cache: RowCache, row: int, length: int, first_row: int) -> list[list[int]]:
    """Per layer: the slot each of `row`'s first `length` entries was written at (`first_row`: the row's
    index when it was written); its values are checked to match."""
    out = []
    for i, layer in enumerate(cache.row_layers):
        keys = layer.keys[row, 0, :length, 0]  # [length]
        assert torch.equal(layer.values[row, :, :length], -layer.keys[row, :, :length])
        out.append([int(x) - 100 * i - 1000 * first_row for x in keys.tolist()])
    return out


@pytest.mark.parametrize("dims", [[4, 4, 4], [4, 6, 4]], ids=["one-buffer", "own-buffers"])
def test_commits_and_row_drops_move_every_layer(dims):
    cache = filled(dims)
    shared = cache.buffer.whole()
    assert (shared is not None) == (len(set(dims)) == 1)
    if shared is not None:  # every layer's keys and values are views of the one buffer
        assert shared.shape == (LAYERS, 2, 3, 2, S_MAX, 4)
        assert all(
            layer.keys.data_ptr() == shared[i, 0].data_ptr() for i, layer in enumerate(cache.row_layers)
        )
    commit_rows(cache, [[0, 2], [0, 1, 3], [0]], CPU)  # row 0: tree slots 3, 5 kept; row 1: 5, 6, 8; row 2: 4
    assert cache.lengths == [5, 8, 5]
    assert slots(cache, 0, 5, 0) == [[0, 1, 2, 3, 5]] * LAYERS
    assert slots(cache, 1, 8, 1) == [[0, 1, 2, 3, 4, 5, 6, 8]] * LAYERS
    assert slots(cache, 2, 5, 2) == [[0, 1, 2, 3, 4]] * LAYERS
    generation = cache.generation
    cache.keep_rows([0, 2], 8)  # row 1 finished: rows 0 and 2 go on untouched, row 2 now as row 1
    assert cache.lengths == [5, 5] and cache.batch == 2 and cache.generation == generation  # (in place)
    assert all(layer.keys.shape[0] == 2 for layer in cache.row_layers)
    assert slots(cache, 0, 5, 0) == [[0, 1, 2, 3, 5]] * LAYERS
    assert slots(cache, 1, 5, 2) == [[0, 1, 2, 3, 4]] * LAYERS
    assert (cache.buffer.whole() is not None) == (shared is not None)
    cache.keep_rows([1, 0], 5)  # another order: one gather (new buffers: graphs of the old ones dropped)
    assert cache.generation != generation
    assert slots(cache, 0, 5, 2) == [[0, 1, 2, 3, 4]] * LAYERS and cache.lengths == [5, 5]
    cache.grow(40)  # reallocated: the entries stay (one buffer again when they share a shape)
    assert (cache.buffer.whole() is not None) == (shared is not None)
    assert all(layer.keys.shape[2] == 40 for layer in cache.row_layers)
    assert slots(cache, 0, 5, 2) == [[0, 1, 2, 3, 4]] * LAYERS


@pytest.mark.parametrize("dims", [[4, 4, 4], [4, 6, 4]], ids=["one-buffer", "own-buffers"])
def test_row_drops_with_a_capacity_keep_the_buffers_rows(dims):
    """keep_rows(capacity=B): the kept rows move up as without it, the buffers keep their B rows (a
    compiled graph's shape), the rows past B' idle at length 0; in place when ascending, else a gather."""
    cache = filled(dims)
    ptrs, generation = [layer.keys.data_ptr() for layer in cache.row_layers], cache.generation
    cache.keep_rows([0, 2], capacity=3)  # row 1 finished: row 2 up to row 1, in place
    assert cache.batch == 3 and cache.lengths == [3, 4, 0] and cache.generation == generation
    assert all(layer.keys.shape[0] == 3 for layer in cache.row_layers)
    assert [layer.keys.data_ptr() for layer in cache.row_layers] == ptrs
    assert slots(cache, 0, 3, 0) == [[0, 1, 2]] * LAYERS and slots(cache, 1, 4, 2) == [[0, 1, 2, 3]] * LAYERS
    cache.keep_rows([1, 0], capacity=3)  # another order: one gather, still 3 rows
    assert cache.batch == 3 and cache.lengths == [4, 3, 0] and cache.generation != generation
    assert all(layer.keys.shape[0] == 3 for layer in cache.row_layers)
    assert slots(cache, 0, 4, 2) == [[0, 1, 2, 3]] * LAYERS and slots(cache, 1, 3, 0) == [[0, 1, 2]] * LAYERS
    cache.keep_rows([], capacity=3)  # every row finished: all idle
    assert cache.batch == 3 and cache.lengths == [0, 0, 0]


@pytest.mark.parametrize("dims", [[4, 4, 4], [4, 6, 4]], ids=["one-buffer", "own-buffers"])
def test_a_batch_of_ones_commit_moves_an_off_path_node_or_only_its_length(dims):
    """Past 3, tree nodes at slots 3..8: a path off the first branch is copied into place in every layer
    (one gather of the shared buffer, or layer by layer); a path in place (0..K-1) only moves the
    length: the slots keep what they held."""
    cache = filled(dims, batch=1, lengths=[3])
    commit_row(cache, [0, 2, 5], CPU)
    assert cache.lengths == [6] and [layer.length for layer in cache.row_layers] == [6] * LAYERS
    assert slots(cache, 0, 6, 0) == [[0, 1, 2, 3, 5, 8]] * LAYERS
    before = [layer.keys.clone() for layer in cache.row_layers]
    commit_row(cache, [0, 1], CPU)  # in place: nothing moves
    commit_row(cache, [0], CPU)
    assert cache.lengths == [9] and all(torch.equal(a, b.keys) for a, b in zip(before, cache.row_layers))


def test_a_batch_of_one_writes_in_a_row_and_a_full_cache_is_refused_at_the_boundary():
    """No write slots: each layer writes its n entries at its own cursor (slices) and returns views up to
    them; the first write past max_length is refused in one line, the last one that fits passes."""
    cache = RowCache(1, 1, 4)
    layer = cache.row_layers[0]
    keys, _ = layer.update(torch.ones(1, 1, 3, 2), torch.ones(1, 1, 3, 2))
    assert keys.shape == (1, 1, 3, 2) and layer.length == 3 and cache.get_seq_length() == 3
    assert layer.get_mask_sizes(2) == (5, 0)
    cache.set_length(3)
    with pytest.raises(ValueError, match=r"^preallocated KV cache full: 3 \+ 2 positions > max_length 4$"):
        layer.update(torch.ones(1, 1, 2, 2), torch.ones(1, 1, 2, 2))
    keys, _ = layer.update(torch.full((1, 1, 1, 2), 5.0), torch.ones(1, 1, 1, 2))  # 3 + 1 = 4: fits
    assert keys.shape[-2] == 4 and keys[0, 0, 3, 0] == 5.0
    with pytest.raises(ValueError, match="a cache of 1 rows got states of 2 rows"):
        RowCache(1, 1, 4, static_shapes=True).update(torch.ones(2, 1, 1, 2), torch.ones(2, 1, 1, 2), 0)


def test_fixed_shapes_write_after_device_lengths_and_return_whole_buffers():
    cache = RowCache(1, 1, 8, static_shapes=True)
    layer = cache.row_layers[0]
    first = torch.arange(12.0).view(1, 1, 3, 4)  # [B, kv, n, D]
    keys, _ = layer.update(first, -first)
    assert keys.shape == (1, 1, 8, 4)  # the whole buffer: one shape for every length
    assert cache.buffer.whole() is None  # (fixed addresses: buffers of their own)
    cache.set_length(3)
    assert cache.lengths_t.tolist() == [3] and layer.get_mask_sizes(2) == (8, 0)
    second = torch.full((1, 1, 2, 4), 7.0)
    keys, values = layer.update(second, -second)
    assert torch.equal(keys[0, 0, :3], first[0, 0]) and torch.equal(keys[0, 0, 3:5], second[0, 0])
    assert torch.equal(values[0, 0, 3:5], -second[0, 0])
    move_fixed(cache, torch.tensor([[1, 1]]))  # keep the second new entry only (padded: itself again)
    cache.set_length(4)
    assert cache.lengths_t.tolist() == [4] and torch.equal(layer.keys[0, 0, 3], second[0, 0, 1])


def test_fixed_shape_layers_write_after_one_shared_device_length():
    """static_shapes: every layer reads one lengths tensor [B] (moving it is one kernel, not one a layer),
    made by the first write; set_length and set_lengths move it for all; rows write after their own
    lengths; a length made ahead (a graph's owner: its address) is kept."""
    cache = RowCache(LAYERS, 2, 16, static_shapes=True)
    states = torch.zeros(2, 2, 2, 4)
    for layer in range(LAYERS):
        cache.update(states, states, layer)
    assert cache.lengths_t.device == CPU and cache.lengths_t.tolist() == [0, 0]
    cache.set_lengths([5, 2])
    assert cache.lengths_t.tolist() == [5, 2] and cache.lengths == [5, 2]
    cache.update(torch.ones(2, 2, 2, 4), torch.ones(2, 2, 2, 4), LAYERS - 1)  # row 0: slots 5, 6; row 1: 2, 3
    keys = cache.row_layers[-1].keys[:, 0, :, 0]
    assert keys[0].tolist() == [0.0] * 5 + [1.0] * 2 + [0.0] * 9
    assert keys[1].tolist() == [0.0] * 2 + [1.0] * 2 + [0.0] * 12
    cache.set_length(3)
    assert cache.lengths_t.tolist() == [3, 3]
    ahead = RowCache(1, 2, 8, static_shapes=True)
    made = ahead.lengths_t = torch.zeros(2, dtype=torch.long)
    ahead.update(states, states, 0)
    assert ahead.lengths_t is made


def test_writes_to_named_slots_scatter_and_view_what_the_caller_says():
    cache = RowCache(1, 2, 8)
    cache.write_slots, cache.view_length = torch.tensor([[0, 1], [4, 5]]), 6
    keys, _ = cache.update(torch.ones(2, 1, 2, 3), torch.ones(2, 1, 2, 3), 0)
    assert keys.shape == (2, 1, 6, 3) and cache.get_seq_length() == 6
    assert keys[:, 0, :, 0].tolist() == [[1, 1, 0, 0, 0, 0], [0, 0, 0, 0, 1, 1]]


def test_a_row_copied_in_from_another_cache_and_a_grown_cache_keep_their_entries():
    cache = RowCache(2, 3, 8)
    keys = torch.arange(2 * 2 * 5 * 4, dtype=torch.float32).view(2, 2, 5, 4)  # [G, kv, T, D]
    cache.write_rows(torch.tensor([2, 0]), [(keys, -keys), (keys + 1, -keys - 1)])
    layer = cache.row_layers[1]
    assert torch.equal(layer.keys[2, :, :5], keys[0] + 1) and torch.equal(layer.keys[0, :, :5], keys[1] + 1)
    assert cache.buffer.whole() is not None and not layer.keys[1].any()
    cache.grow(20)
    assert layer.keys.shape == (3, 2, 20, 4) and torch.equal(cache.row_layers[1].keys[2, :, :5], keys[0] + 1)


def test_padded_paths_for_the_fixed_shape_commit():
    """Active rows' paths in their physical rows, padded to a power of 2 by their last node; idle rows
    node 0; nothing at all when every path is in place."""
    assert padded_paths([[0, 1], [0]], [0, 1], 4) is None
    nodes = padded_paths([[0, 2, 3], [0]], [3, 1], 4)
    assert nodes.tolist() == [[0, 0, 0, 0], [0, 0, 0, 0], [0, 0, 0, 0], [0, 2, 3, 3]]


def test_a_layer_bound_after_a_row_drop_does_not_revive_the_dropped_buffer():
    """Layers 0 and 1 share a buffer, layer 2 is not written yet; a gathering row drop gives 0 and 1 their
    own buffers, so when layer 2 is written later `buffers()` must still hold every layer's entries (one
    op over the old shared buffer would miss rows 0 and 1's moved copies)."""
    cache = RowCache(LAYERS, 2, S_MAX)
    states = torch.randn(2, 2, 3, 4)  # [B, kv, n, D]
    for layer in cache.row_layers[:2]:
        layer.update(states.clone(), states.clone())
    cache.keep_rows([1, 0])  # a gather: new buffers
    cache.row_layers[2].update(states.clone(), states.clone())
    for buffer in cache.buffers():
        buffer.zero_()
    assert not any(x.any() for layer in cache.row_layers for x in (layer.keys, layer.values))
