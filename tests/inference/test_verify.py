"""verify_tree on a real tiny Llama: every node's logits/hidden states equal running its root-to-node
path as a plain sequence; keep_positions leaves a cache equal to a fresh one; a greedy loop built on
verify + greedy_accept + keep_positions reproduces plain greedy decoding."""

from __future__ import annotations

import pytest
import torch

from spechead.heads.attention import NAME as TREE_SDPA
from spechead.inference.acceptance import greedy_accept
from spechead.inference.kv_cache import cache_length, keep_positions
from spechead.inference.tree import TokenTree, depths, path_to_node, retrieve_indices
from spechead.inference.verify import prefill, verify_tree

VOCAB = 64
HIDDEN = (0, 1, 3, 4, -1, -2)  # 4 layers: embeddings, layer outputs, after the final norm


@pytest.fixture(params=["eager", "sdpa", TREE_SDPA])
def model(request, tiny_llama):
    m = tiny_llama(VOCAB, layers=4, hidden=32, seed=0)
    m.set_attn_implementation(request.param)
    assert m.config._attn_implementation == request.param
    return m


def random_tree(n: int, seed: int) -> TokenTree:
    g = torch.Generator().manual_seed(seed)
    parents = [-1] + [int(torch.randint(0, i, (), generator=g)) for i in range(1, n)]
    return TokenTree(torch.randint(0, VOCAB, (n,), generator=g), torch.tensor(parents))


def plain(model, ids: list[int]):
    """Full forward (no cache) with all hidden states: (logits [T, V], tuple of [T, H])."""
    out = model(torch.tensor([ids]), output_hidden_states=True)
    return out.logits[0], [h[0] for h in out.hidden_states]


@torch.no_grad()
def test_prefill_matches_plain_forward(model):
    prefix = list(range(5, 12))
    cache, logits, hidden = prefill(model, torch.tensor([prefix]), hidden_layers=HIDDEN)
    ref_logits, ref_hidden = plain(model, prefix)
    assert cache_length(cache) == len(prefix) and logits.dtype == torch.float32
    torch.testing.assert_close(logits, ref_logits, atol=1e-5, rtol=0)
    assert set(hidden) == set(HIDDEN)
    for k in HIDDEN:
        torch.testing.assert_close(hidden[k], ref_hidden[k], atol=1e-5, rtol=0)
    # 1-D input and logits_to_keep
    _, last, _ = prefill(model, torch.tensor(prefix), logits_to_keep=1)
    torch.testing.assert_close(last, ref_logits[-1:], atol=1e-5, rtol=0)


@torch.no_grad()
@pytest.mark.parametrize("seed", [0, 1])
def test_tree_logits_equal_plain_paths_then_keep_path(model, seed):
    prefix = [3, 9, 27, 17, 51, 25]
    tree = random_tree(12, seed)
    cache, _, _ = prefill(model, torch.tensor([prefix]))
    modules = [*model.get_decoder().layers, model.get_decoder().norm]
    n_hooks = [len(m._forward_hooks) + len(m._forward_pre_hooks) for m in modules]
    logits, hidden = verify_tree(model, cache, tree, len(prefix), hidden_layers=HIDDEN)
    assert [len(m._forward_hooks) + len(m._forward_pre_hooks) for m in modules] == n_hooks  # removed
    assert logits.shape == (12, VOCAB) and logits.dtype == torch.float32
    assert cache_length(cache) == len(prefix) + 12
    for node in range(12):
        ids = prefix + tree.tokens[path_to_node(tree.parents, node)].tolist()
        ref_logits, ref_hidden = plain(model, ids)
        torch.testing.assert_close(logits[node], ref_logits[-1], atol=1e-5, rtol=0)
        for k in HIDDEN:
            torch.testing.assert_close(hidden[k][node], ref_hidden[k][-1], atol=1e-5, rtol=0)

    # keep the deepest path; continuing from the compacted cache equals a fresh prefix + path
    deepest = int(depths(tree.parents).argmax())
    path = path_to_node(tree.parents, deepest)
    keep_positions(cache, len(prefix), torch.tensor(path))
    assert cache_length(cache) == len(prefix) + len(path)
    kept = prefix + tree.tokens[path].tolist()
    more = [7, 8, 60]
    out = model(torch.tensor([more]), cache=cache, use_cache=True)
    ref_logits, _ = plain(model, kept + more)
    torch.testing.assert_close(out.logits[0], ref_logits[-3:], atol=1e-5, rtol=0)


@torch.no_grad()
def test_greedy_tree_loop_reproduces_plain_greedy(model):
    """Speculative greedy with random trees in which some branches carry the true continuation."""
    prefix, steps = [1, 2, 3, 4], 24
    ids = list(prefix)
    for _ in range(steps):  # plain greedy reference
        ids.append(int(plain(model, ids)[0][-1].argmax()))
    truth = ids[len(prefix) :]

    g = torch.Generator().manual_seed(0)
    cache, _, _ = prefill(model, torch.tensor([prefix[:-1]]))
    out, root, past, rounds = [], prefix[-1], len(prefix) - 1, 0
    while len(out) < steps:
        tree = random_tree(10, int(torch.randint(0, 10_000, (), generator=g)))
        tree.tokens[0] = root
        # an oracle drafter: along one random root-to-leaf path, each level is right with prob 0.8
        paths = retrieve_indices(tree.parents)  # [paths, max_depth + 1]
        row = paths[int(torch.randint(0, paths.shape[0], (), generator=g))]
        for d, node in enumerate(row[1:].tolist()):
            if node >= 0 and len(out) + d < steps and torch.rand((), generator=g) < 0.8:
                tree.tokens[node] = truth[len(out) + d]
        logits, _ = verify_tree(model, cache, tree, past)
        acc = greedy_accept(tree, logits)
        keep_positions(cache, past, acc.path)
        past += len(acc.path)
        out += tree.tokens[acc.path[1:]].tolist() + [acc.next_token]
        root, rounds = acc.next_token, rounds + 1
        assert cache_length(cache) == past
    assert rounds < steps * 0.6, "the oracle drafts should make multi-token steps"
    assert out[:steps] == truth


@torch.no_grad()
def test_verify_errors(model):
    cache, _, _ = prefill(model, torch.tensor([[1, 2, 3]]))
    tree = random_tree(4, 0)
    with pytest.raises(ValueError, match="past_len"):
        verify_tree(model, cache, tree, past_len=2)
    with pytest.raises(ValueError, match="does not exist"):
        verify_tree(model, cache, tree, past_len=3, hidden_layers=(5,))
    with pytest.raises(ValueError, match="batch 1"):
        prefill(model, torch.tensor([[1, 2], [3, 4]]))
