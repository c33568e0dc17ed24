"""Rule A on the device (`QueuedAcceptance.sampled`, read now): coin for coin the walk's path and next
token, rows of a padded batch each as if alone, and the one-line error for probs without mass."""

from __future__ import annotations

import pytest
import torch

import spechead.inference.acceptance as acceptance
from spechead.inference.acceptance import walk
from spechead.inference.queued_acceptance import QueuedAcceptance
from spechead.inference.sampling import make_generator
from spechead.inference.tree import TokenTree, ancestors_on_device

V = 12


def random_tree(g: torch.Generator, n: int, p: torch.Tensor) -> TokenTree:
    """n nodes, each under a random earlier node, its token drawn from p at its parent [N, V] (so paths
    get accepted), now and then a repeat of an earlier sibling's token (rejected before it is tried)."""
    parents, tokens = [-1], [0]
    for i in range(1, n):
        par = int(torch.randint(0, i, (1,), generator=g))
        siblings = [tokens[j] for j in range(1, i) if parents[j] == par]
        if siblings and float(torch.rand((), generator=g)) < 0.25:
            tok = siblings[int(torch.randint(0, len(siblings), (1,), generator=g))]
        else:
            tok = int(torch.multinomial(p[par], 1, generator=g))
        parents.append(par)
        tokens.append(tok)
    return TokenTree(torch.tensor(tokens), torch.tensor(parents))


def walk_coins(parents: list[int], path: list[int], coins: list[float]) -> list[float]:
    """The coins `acceptance.walk` reads for this path, in its order: at each node on the path its
    children in index order, up to the accepted one (all of them at the path's last node)."""
    read = []
    for depth, node in enumerate(path):
        nxt = path[depth + 1] if depth + 1 < len(path) else None
        for child in (c for c in range(len(parents)) if parents[c] == node):
            read.append(coins[child])
            if child == nxt:
                break
    return read


def sample_accept_batch(
    tokens, parents, anc, probs, gens, sizes=None, coins=None
) -> list[acceptance.Acceptance]:
    """Rule A's device acceptance of B trees (`QueuedAcceptance.sampled`), read now."""
    return QueuedAcceptance.sampled(tokens, parents, anc, probs, gens, 0, sizes, coins).result()


def one(tree: TokenTree, p: torch.Tensor, seed: int, coins: torch.Tensor) -> acceptance.Acceptance:
    """`sample_accept_batch` on one tree [N] with probs [N, V] and coins [N]."""
    tokens, parents = tree.tokens[None], tree.parents[None]
    anc = ancestors_on_device(parents)
    return sample_accept_batch(tokens, parents, anc, p[None], [make_generator(seed)], coins=coins[None])[0]


@pytest.mark.parametrize("host", [True, False], ids=["numpy-rows", "torch-rows"])
def test_the_device_rule_is_the_walk_coin_for_coin(monkeypatch, host):
    """With the coins the walk would read for the device's path, the walk takes that very path (it
    reads no coin more or less) and draws the same next token from the same generator."""
    g = torch.Generator().manual_seed(0)
    lengths = set()
    for trial in range(300):
        n = int(torch.randint(2, 10, (1,), generator=g))
        p = torch.softmax(torch.randn(n, V, generator=g) * 2, -1)  # [N, V]
        if trial % 5 == 0:
            p[0] = 0.0
            p[0, 3] = 1.0  # a one-hot row: its children other than 3 are rejected for sure
        if trial % 3 == 0:  # rows need not be normalised (each is divided by its own mass)
            p = p * torch.rand(n, 1, generator=g) * 4
        if trial % 7 == 0:  # nor fp32
            p = p.double()
        tree = random_tree(g, n, p)
        coins = torch.rand(n, generator=g)  # [N]
        got = one(tree, p, trial, coins)
        queue = walk_coins(tree.parents.tolist(), got.path, coins.tolist())
        monkeypatch.setattr(acceptance, "_uniform", lambda generator, device, queue=queue: queue.pop(0))
        want = walk(tree, p, "deterministic", None, make_generator(trial), host)
        assert queue == [], f"trial {trial}: the walk read fewer coins than the device's path implies"
        assert (got.path, got.next_token, got.path_tokens) == (want.path, want.next_token, want.path_tokens)
        lengths.add(len(got.path))
    assert {1, 2, 3} <= lengths  # rejections at the root, and paths one and two deep


def test_padded_rows_are_each_their_own_tree():
    """Batches of trees of 3, 7 and 5 nodes padded to 7 (padding: token -1, parent 0, read as token 0
    under the root, which holds much of p): each row's path and next token are its own, padding never
    accepted nor taken for a child whose token the residual loses; with coins drawn, each row takes
    as many from its generator as alone (its size - 1), so it draws what it draws alone."""
    g = torch.Generator().manual_seed(1)
    sizes, n = [3, 7, 5], 7
    for trial in range(40):
        ps = [torch.softmax(torch.randn(n, V, generator=g) * 2, -1) for _ in sizes]  # [N, V] each
        for p in ps:
            p[:, 0] += 1.0  # token 0: the padding's token, likely at every node
            p /= p.sum(-1, keepdim=True)
        trees = [random_tree(g, size, p) for size, p in zip(sizes, ps)]
        coins = torch.rand(3, n, generator=g)  # [B, N]
        tokens = torch.full((3, n), -1)
        parents = torch.zeros(3, n, dtype=torch.long)
        for b, tree in enumerate(trees):
            tokens[b, : sizes[b]], parents[b, : sizes[b]] = tree.tokens, tree.parents
        anc = ancestors_on_device(parents)
        gens = [make_generator(100 * trial + b) for b in range(3)]
        batch = sample_accept_batch(tokens, parents, anc, torch.stack(ps), gens, sizes, coins)
        gens = [make_generator(100 * trial + b) for b in range(3)]
        drawn = sample_accept_batch(tokens, parents, anc, torch.stack(ps), gens, sizes)  # coins from gens
        for b, tree in enumerate(trees):
            alone = one(tree, ps[b][: sizes[b]], 100 * trial + b, coins[b, : sizes[b]])
            assert (batch[b].path, batch[b].next_token) == (alone.path, alone.next_token), f"trial {trial}"
            t, par = tree.tokens[None], tree.parents[None]  # each row alone drawing from its own seed
            own = sample_accept_batch(t, par, ancestors_on_device(par), ps[b][None, : sizes[b]],
                                      [make_generator(100 * trial + b)])[0]  # fmt: skip
            assert (drawn[b].path, drawn[b].next_token) == (own.path, own.next_token), f"trial {trial}"


def test_the_rule_draws_the_target_law():
    """Drawn coins (not given): the first token's frequencies follow p at the root whatever children
    the tree has (a 3-child root and a chain below the first)."""
    p = torch.tensor([0.5, 0.3, 0.15, 0.05])
    probs = p.expand(5, 4).clone()  # [N, V]: the same law at every node
    tree = TokenTree(torch.tensor([0, 1, 0, 3, 2]), torch.tensor([-1, 0, 0, 0, 1]))
    anc = ancestors_on_device(tree.parents[None])
    counts = torch.zeros(4)
    g = make_generator(0)
    for _ in range(4000):
        acc = sample_accept_batch(tree.tokens[None], tree.parents[None], anc, probs[None], [g])[0]
        first = acc.path_tokens[1] if len(acc.path) > 1 else acc.next_token
        counts[first] += 1
    assert (counts / 4000 - p).abs().max() < 0.03


def test_probs_without_mass_are_one_line():
    tree = TokenTree(torch.tensor([0, 1]), torch.tensor([-1, 0]))
    anc = ancestors_on_device(tree.parents[None])
    with pytest.raises(ValueError, match="no positive finite mass"):
        sample_accept_batch(tree.tokens[None], tree.parents[None], anc, torch.zeros(1, 2, V), [None])


def test_drawn_coins_are_the_generators_uniforms_for_nodes_1_on_then_the_next_token():
    """Without `coins`, node j (j >= 1) reads the row generator's j-th uniform (the root none) and the
    next token is drawn after them: the same acceptance as those uniforms passed as coins."""
    g = torch.Generator().manual_seed(3)
    for trial in range(60):
        n = int(torch.randint(2, 9, (1,), generator=g))
        p = torch.softmax(torch.randn(n, V, generator=g) * 2, -1)  # [N, V]
        tree = random_tree(g, n, p)
        t, par = tree.tokens[None], tree.parents[None]
        drawn = sample_accept_batch(t, par, ancestors_on_device(par), p[None], [make_generator(trial)])[0]
        gen = make_generator(trial)
        coins = torch.cat([torch.ones(1), torch.rand(n - 1, generator=gen)])  # [N]: root's never read
        given = sample_accept_batch(t, par, ancestors_on_device(par), p[None], [gen], coins=coins[None])[0]
        assert (drawn.path, drawn.next_token) == (given.path, given.next_token), f"trial {trial}"
