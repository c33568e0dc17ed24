"""EagleDrafter: committed-cache consistency across propose/accept, agreement with the training
unroll (heads/unroll.ttt_forward) for chains and dynamic trees, and EAGLE-2 node selection."""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache

from spechead.heads import HeadError
from spechead.heads.eagle import EagleConfig, EagleHead
from spechead.heads.eagle3 import Eagle3Config, Eagle3Head
from spechead.heads.unroll import ttt_forward
from spechead.inference.drafters.eagle import EagleDrafter
from spechead.inference.sampling import SamplingParams
from spechead.inference.tree import TokenTree, path_to_node

from ...trees import depths
from ..one_row import OneRow

H, V, L, VD = 32, 64, 4, 40
GREEDY = SamplingParams()
STATIC = [[0], [1], [2], [0, 0], [0, 1], [1, 0], [0, 0, 0], [0, 0, 1], [0, 0, 0, 0]]


@pytest.fixture(scope="module")
def target(tiny_llama):
    return tiny_llama(V, layers=L, hidden=H).requires_grad_(False)


def make_head(target, kind: str):
    torch.manual_seed(3)
    if kind == "eagle":
        head = EagleHead(EagleConfig.from_target(target.config))
    else:
        layers = 2 if kind == "eagle3-2-layers" else 1  # (a cache layer each)
        head = Eagle3Head(Eagle3Config.from_target(target.config, draft_vocab_size=VD, num_layers=layers))
        # A non-trivial draft vocab: VD scattered target ids, so d2t offsets matter.
        chosen = torch.randperm(V)[:VD].sort().values
        t2d = torch.zeros(V, dtype=torch.bool)
        t2d[chosen] = True
        head.set_draft_vocab(chosen - torch.arange(VD), t2d)
    for p in head.parameters():  # sharper logits than the default init: no near-ties
        p.data.mul_(3.0)
    head.attach_target_modules(lm_head=target.lm_head, embed_tokens=target.get_input_embeddings())
    return head.eval().requires_grad_(False)


class Stream:
    """A committed sequence with random target states {layer: [T, H]} (the drafter never checks them)."""

    def __init__(self, head, length: int, seed: int) -> None:
        self.gen = torch.Generator().manual_seed(seed)
        self.layers = sorted(set(head.config.target_layers))
        self.tokens = torch.randint(V, (length,), generator=self.gen)
        self.states = {layer: torch.randn(length, H, generator=self.gen) for layer in self.layers}

    def extend(self, tokens: torch.Tensor) -> dict[int, torch.Tensor]:
        new = {layer: torch.randn(len(tokens), H, generator=self.gen) for layer in self.layers}
        self.tokens = torch.cat([self.tokens, tokens])
        self.states = {layer: torch.cat([self.states[layer], new[layer]]) for layer in self.layers}
        return new

    def features(self, head) -> torch.Tensor:
        """[1, T, H] head input features of every committed position."""
        states = [self.states[layer][None] for layer in head.config.target_layers]
        return head.fuse(states) if isinstance(head, Eagle3Head) else states[0]


def dynamic_scores(drafter, root: int) -> torch.Tensor:
    """The cumulative draft log-probs [N] (float64, root 0) of the nodes of the dynamic tree a batch of one
    proposes from `root` now (the growth run again: it writes scratch slots only)."""
    rows = drafter._rows
    with torch.inference_mode():  # (its cache is an inference tensor)
        return rows._grow_dynamic(rows.feature, torch.tensor([root]))[2][0]


def committed(drafter) -> tuple[int, list[tuple[torch.Tensor, torch.Tensor]], torch.Tensor]:
    """A batch of one's committed state in its rows: C, every head layer's keys / values [1, kv, C, D] and
    the last committed pair's output feature [1, H]."""
    rows = drafter._rows
    c = rows.lengths[0]
    assert int(rows.committed[0]) == c  # the device's copy of C agrees
    kv = [(layer.keys[:1, :, :c], layer.values[:1, :, :c]) for layer in rows.cache.row_layers]
    return c, kv, rows.feature[:1]


def chain_scores(
    head, stream: Stream, root: int, path: list[int], shift: int = 0
) -> tuple[torch.Tensor, torch.Tensor]:
    """Training's unroll over committed + root + path: (cumulative log-probs [D], argmax ids [D]).

    Entry j is TTT step j at position C - 1 + j, which predicts path[j] (EAGLE-3 ids mapped to target).
    shift != 0 moves positions >= C (a wrong convention for drafted nodes) to test sensitivity.
    """
    committed, depth = len(stream.tokens), len(path)
    ids = torch.cat([stream.tokens, torch.tensor([root, *path])])[None]  # [1, C + 1 + D]
    fused = torch.cat([stream.features(head), torch.zeros(1, depth + 1, H)], dim=1)  # unused tail
    positions = torch.arange(ids.shape[1])
    positions = (positions + shift * (positions >= committed).long())[None]  # [1, C + 1 + D]
    outs = ttt_forward(head, fused, ids, None, depth, position_ids=positions)
    logp = torch.stack(
        [torch.log_softmax(head.logits(outs[j])[0, committed - 1 + j], -1) for j in range(depth)]
    )
    to_target = head.draft_to_target if isinstance(head, Eagle3Head) else (lambda x: x)
    draft_ids = (
        head.target_to_draft(torch.tensor(path)) if isinstance(head, Eagle3Head) else torch.tensor(path)
    )
    picked = logp.gather(1, draft_ids[:, None].clamp(min=0))[:, 0]  # [D]
    return picked.double().cumsum(0), to_target(logp.argmax(-1))


def unroll_rank(head, stream: Stream, root: int, path: list[int], rank: int) -> int:
    """The target id of the rank-th best child after root + path under training's unroll."""
    committed_len, depth = len(stream.tokens), len(path) + 1
    ids = torch.cat([stream.tokens, torch.tensor([root, *path, 0])])[None]  # [1, C + 1 + D]
    fused = torch.cat([stream.features(head), torch.zeros(1, depth + 1, H)], dim=1)  # unused tail
    outs = ttt_forward(head, fused, ids, None, depth)
    logits = head.logits(outs[depth - 1])[0, committed_len - 1 + len(path)]  # [Vd]
    best = logits.topk(rank + 1).indices[rank]
    return int(head.draft_to_target(best[None])[0]) if isinstance(head, Eagle3Head) else int(best)


@pytest.mark.parametrize("api", ["accept", "accept_path"])
@pytest.mark.parametrize("kind", ["eagle", "eagle3", "eagle3-2-layers"])
@pytest.mark.parametrize("tree", ["dynamic", "static"])
def test_cache_stays_consistent_across_cycles(target, kind, tree, api) -> None:
    """accept_path (the decoding loop's call: every node's states, the path's indices) takes the path's
    rows: the tree's other rows hold noise, and the cache must still equal a fresh run's."""
    head = make_head(target, kind)
    opts = dict(tree="dynamic", top_k=3, depth=4, total_tokens=12) if tree == "dynamic" else dict(tree=STATIC)
    drafter = EagleDrafter(head, **opts)
    stream = Stream(head, 7, seed=0)
    root = 5
    OneRow(drafter).start(stream.tokens, stream.states, root)
    pick = torch.Generator().manual_seed(1)
    for _ in range(4):
        draft = OneRow(drafter).propose(root, GREEDY, None)
        assert draft.rule == "deterministic" and draft.q is None
        node = int(torch.randint(draft.tree.size, (1,), generator=pick))  # any accepted path, maybe root only
        path = path_to_node(draft.tree.parents, node)  # [K], in place (0..K-1) or not
        accepted = draft.tree.tokens[path]
        next_root = int(torch.randint(V, (1,), generator=pick))
        hidden = stream.extend(torch.cat([torch.tensor([root]), accepted[1:]]))
        if api == "accept":
            OneRow(drafter).accept(accepted, hidden, next_root)
        else:  # the whole tree's states [1, N, H]: the path's rows are the stream's, the rest noise
            whole = {layer: torch.randn(1, draft.tree.size, H) for layer in hidden}
            for layer, rows in hidden.items():
                whole[layer][0, path] = rows
            OneRow(drafter).accept_path(accepted.tolist(), whole, path, next_root)
        root = next_root
        # A fresh run over all committed pairs, at once, gives the same cache and last feature.
        fresh = DynamicCache()
        next_ids = torch.cat([stream.tokens[1:], torch.tensor([root])])[None]
        out = head.step(stream.features(head), next_ids, past_key_values=fresh)  # [1, C, H]
        c, kv, feature = committed(drafter)
        assert c == len(stream.tokens) == fresh.get_seq_length()
        for (keys, values), ref in zip(kv, fresh.layers, strict=True):  # (preallocated: the valid slots)
            torch.testing.assert_close(keys, ref.keys, atol=2e-4, rtol=1e-4)
            torch.testing.assert_close(values, ref.values, atol=2e-4, rtol=1e-4)
        torch.testing.assert_close(feature, out[:, -1], atol=2e-4, rtol=1e-4)
    # The next tree equals the one a drafter started on the whole committed sequence proposes.
    mine = OneRow(drafter).propose(root, GREEDY, None).tree
    other = EagleDrafter(head, **opts)
    OneRow(other).start(stream.tokens, stream.states, root)
    ref = OneRow(other).propose(root, GREEDY, None).tree
    assert torch.equal(mine.tokens, ref.tokens) and torch.equal(mine.parents, ref.parents)
    if tree == "dynamic":  # (a static tree's ranks need no scores)
        scores = dynamic_scores(drafter, root)
        torch.testing.assert_close(scores, dynamic_scores(other, root), atol=1e-4, rtol=0)


@pytest.mark.parametrize("kind", ["eagle", "eagle3"])
def test_a_drafter_reused_on_a_longer_sequence_accepts_as_a_fresh_one(target, kind) -> None:
    """The eager accept's masks are views of kept ones sized to the head's cache: a second, longer
    sequence gets a larger cache (300 tokens: 512 slots, not 256), and the kept masks must follow."""
    head = make_head(target, kind)
    drafter = EagleDrafter(head, tree=[[0], [0, 0], [0, 0, 0]])
    for length, seed in ((7, 0), (300, 1)):
        stream, root = Stream(head, length, seed=seed), 5
        OneRow(drafter).start(stream.tokens, stream.states, root)
        for _ in range(2):
            accepted = OneRow(drafter).propose(root, GREEDY, None).tree.tokens[:3]  # root + 2 drafts: K = 3
            hidden = stream.extend(accepted)
            root = 7
            OneRow(drafter).accept(accepted, hidden, root)
        next_ids = torch.cat([stream.tokens[1:], torch.tensor([root])])[None]
        out = head.step(stream.features(head), next_ids, past_key_values=DynamicCache())  # [1, C, H]
        torch.testing.assert_close(committed(drafter)[2], out[:, -1], atol=2e-4, rtol=1e-4)
    assert drafter._rows.cache.max_length == 512


@pytest.mark.parametrize("compile", [False, "eager"])
def test_the_head_cache_grows_as_the_rows_outgrow_it(target, compile) -> None:
    """An accept past the room `start` made grows the head cache first (eager rows: to twice its size at
    least; the graphs' rows: a multiple of 1024), keeping every committed entry: the next tree is a fresh
    drafter's on the whole sequence."""
    head = make_head(target, "eagle")
    drafter = EagleDrafter(head, tree=STATIC)
    drafter.use_compile(compile)
    stream, root = Stream(head, 7, seed=4), 5
    OneRow(drafter).start(stream.tokens, stream.states, root)
    sizes = [drafter._rows.cache.max_length]
    room = drafter._spec_room  # (a whole draft's slots)
    for k in (300, 2100, 3):  # (K > 16 runs the graphs' accept eagerly; K = 3 as a graph)
        accepted = torch.cat([torch.tensor([root]), torch.randint(V, (k - 1,), generator=stream.gen)])
        hidden = stream.extend(accepted)
        root = 7
        OneRow(drafter).accept(accepted, hidden, root)
        sizes.append(drafter._rows.cache.max_length)
    # eager: 256 (start), doubled, the need itself, doubled; graphs: 1024, the need rounded up (room left)
    need = 7 + 300 + 2100 + room
    assert sizes == ([256, 512, need, 2 * need] if not compile else [1024, 1024, 3072, 3072])
    mine = OneRow(drafter).propose(root, GREEDY, None).tree
    fresh = EagleDrafter(head, tree=STATIC)
    OneRow(fresh).start(stream.tokens, stream.states, root)
    ref = OneRow(fresh).propose(root, GREEDY, None).tree
    assert torch.equal(mine.tokens, ref.tokens) and torch.equal(mine.parents, ref.parents)


@pytest.mark.parametrize("tree", ["static", "dynamic"])
@pytest.mark.parametrize("kind", ["eagle", "eagle3", "eagle3-2-layers"])
def test_chain_matches_training_unroll(target, kind, tree) -> None:
    """A chain of 5 (static, or dynamic with one child a depth: its node scores kept) drafts the training
    unroll's argmax at every depth, with its cumulative log-probs."""
    head = make_head(target, kind)
    depth = 5
    chain = [[0] * d for d in range(1, depth + 1)]
    opts = (
        dict(tree=chain) if tree == "static" else dict(tree="dynamic", top_k=1, depth=depth, total_tokens=6)
    )
    drafter = EagleDrafter(head, **opts)
    stream = Stream(head, 6, seed=2)
    OneRow(drafter).start(stream.tokens, stream.states, 7)
    drafted = OneRow(drafter).propose(7, GREEDY, None).tree.tokens[1:]
    hidden = stream.extend(torch.tensor([7, int(drafted[0])]))  # accept one draft, then draft again
    OneRow(drafter).accept(torch.tensor([7, int(drafted[0])]), hidden, 11)
    draft = OneRow(drafter).propose(11, GREEDY, None).tree
    assert torch.equal(draft.parents, torch.arange(-1, depth))
    path = draft.tokens[1:].tolist()
    scores, argmax = chain_scores(head, stream, 11, path)
    assert argmax.tolist() == path  # greedy step by step, as training unrolls the head
    if tree == "dynamic":
        torch.testing.assert_close(dynamic_scores(drafter, 11)[1:], scores, atol=1e-4, rtol=0)
    # The check is sensitive to the convention: drafted nodes one position off give other scores.
    for shift in (1, -1):
        wrong = chain_scores(head, stream, 11, path, shift=shift)[0]
        assert (wrong[1:] - scores[1:]).abs().max() > 1e-3


# Branches off second children at every depth: a node's features come from a parent that is not the
# first node expanded at its depth (a wrong row there drafts from another branch).
BRANCHY = [[0], [1], [0, 0], [1, 0], [1, 1], [1, 0, 0], [1, 1, 0], [1, 1, 0, 0]]


@pytest.mark.parametrize("kind", ["eagle", "eagle3"])
def test_static_tree_nodes_follow_the_training_unroll(target, kind) -> None:
    head = make_head(target, kind)
    drafter = EagleDrafter(head, tree=BRANCHY)
    stream = Stream(head, 8, seed=5)
    OneRow(drafter).start(stream.tokens, stream.states, 4)
    tree = OneRow(drafter).propose(4, GREEDY, None).tree
    tokens = tree.tokens.tolist()
    for node, choice in enumerate(sorted(BRANCHY), start=1):
        path = [tokens[i] for i in path_to_node(tree.parents, node)[1:]]
        # the node is its parent's rank-r child under the training unroll after the parent's path
        assert path[-1] == unroll_rank(head, stream, 4, path[:-1], choice[-1]), (node, choice)


@pytest.mark.parametrize("kind", ["eagle", "eagle3"])
def test_dynamic_tree_shape_and_path_scores(target, kind) -> None:
    head = make_head(target, kind)
    top_k, depth, total = 3, 4, 15
    drafter = EagleDrafter(head, tree="dynamic", top_k=top_k, depth=depth, total_tokens=total)
    stream = Stream(head, 9, seed=4)
    OneRow(drafter).start(stream.tokens, stream.states, 3)
    tree = OneRow(drafter).propose(3, GREEDY, None).tree
    TokenTree(tree.tokens, tree.parents)  # a valid tree (the drafter hands it over unchecked)
    assert 2 <= tree.size <= total and int(depths(tree.parents).max()) <= depth
    parents, tokens = tree.parents.tolist(), tree.tokens.tolist()
    for p in set(parents[1:]):  # siblings are distinct tokens, at most top_k of them
        kids = [tokens[i] for i in range(1, tree.size) if parents[i] == p]
        assert len(kids) == len(set(kids)) <= top_k
    if kind == "eagle3":
        assert all(head.t2d[t] for t in tokens[1:])
    # Every node's score is the training unroll's cumulative log-prob of its root-to-node path.
    got = dynamic_scores(drafter, 3)
    for node in range(1, tree.size):
        path = [tokens[i] for i in path_to_node(tree.parents, node)[1:]]
        scores, _ = chain_scores(head, stream, 3, path)
        assert abs(float(scores[-1]) - float(got[node])) < 1e-4


def eagle2_oracle(table: torch.Tensor, root: int, top_k: int, depth: int, keep: int) -> dict[tuple, float]:
    """EAGLE-2 by token paths: children logp depend on the last token only (logp [V, V])."""
    logp = torch.log_softmax(table.double(), -1)
    pool: dict[tuple, float] = {}
    frontier = [((), 0.0)]
    for _ in range(depth):
        new = []
        for path, score in frontier:
            last = path[-1] if path else root
            values, ids = logp[last].topk(top_k)
            new += [(path + (int(i),), score + float(v)) for v, i in zip(values, ids)]
        pool.update(new)
        frontier = sorted(new, key=lambda x: -x[1])[:top_k]
    best = sorted(pool.items(), key=lambda x: -x[1])[:keep]
    return dict(best)


def test_dynamic_keeps_highest_cumulative_probability(target, monkeypatch) -> None:
    torch.manual_seed(0)
    model = type(target)(type(target.config)(**{**target.config.to_dict(), "vocab_size": H}))
    head = make_head(model.eval(), "eagle")
    table = torch.randn(H, H) * 3  # logits of a child given its parent's token: [V, V]
    real_step = head.step

    def step(features, next_ids, *args, **kwargs):  # keeps the cache real, output encodes the token
        real_step(features, next_ids, *args, **kwargs)
        return torch.nn.functional.one_hot(next_ids, H).float()  # [B, T, H]

    monkeypatch.setattr(head, "logits", lambda features: features @ table)
    top_k, depth, total = 4, 5, 20
    drafter = EagleDrafter(head, tree="dynamic", top_k=top_k, depth=depth, total_tokens=total)
    drafter.head_step = step  # what the drafter runs per depth
    stream = Stream(head, 5, seed=6)
    stream.tokens %= H
    OneRow(drafter).start(stream.tokens, stream.states, 2)
    tree = OneRow(drafter).propose(2, GREEDY, None).tree
    TokenTree(tree.tokens, tree.parents)  # a valid tree (the drafter hands it over unchecked)
    got, scores = {}, dynamic_scores(drafter, 2)
    for node in range(1, tree.size):
        got[tuple(int(tree.tokens[i]) for i in path_to_node(tree.parents, node)[1:])] = float(scores[node])
    expected = eagle2_oracle(table, 2, top_k, depth, total - 1)
    assert tree.size == total and set(got) == set(expected)
    for path, score in got.items():
        assert abs(score - expected[path]) < 1e-4
    assert committed(drafter)[0] == 5


def test_arguments_and_check_target(target) -> None:
    head = make_head(target, "eagle3")
    drafter = EagleDrafter(head)
    assert drafter.hidden_layers == tuple(head.config.target_layers)
    drafter.check_target(H, V, L)
    with pytest.raises(HeadError):
        drafter.check_target(H + 1, V, L)
    with pytest.raises(ValueError, match="top_k"):
        EagleDrafter(head, top_k=VD + 1)
    for name, bad in (("top_k", 0), ("depth", True), ("total_tokens", 1)):  # (drafters/base.at_least)
        with pytest.raises(ValueError, match=f"{name} must be an int >="):
            EagleDrafter(head, **{name: bad})
    with pytest.raises(ValueError, match="rank"):
        EagleDrafter(head, tree=[[VD]])
    with pytest.raises(RuntimeError, match="start first"):
        OneRow(drafter).propose(0, GREEDY, None)
    stream = Stream(head, 4, seed=9)
    OneRow(drafter).start(stream.tokens, stream.states, 1)
    with pytest.raises(KeyError, match="missing"):
        OneRow(drafter).accept(torch.tensor([1]), {}, 3)
    drafter.use_compile("eager")  # the fixed-shape rows (GraphRows) check the same way
    OneRow(drafter).start(stream.tokens, stream.states, 1)
    with pytest.raises(KeyError, match="missing"):
        OneRow(drafter).accept(torch.tensor([1]), {}, 3)


@pytest.mark.parametrize("kind", ["eagle", "eagle3"])
def test_a_static_tree_stays_as_proposed_after_the_next_propose(target, kind) -> None:
    """Eager static drafting fills kept buffers: the tokens a propose returns are the caller's (a new
    tensor), not views of the buffers the next propose overwrites."""
    head = make_head(target, kind)
    drafter = EagleDrafter(head, tree=STATIC)
    stream = Stream(head, 7, seed=2)
    OneRow(drafter).start(stream.tokens, stream.states, 5)
    first = OneRow(drafter).propose(5, GREEDY, None).tree
    kept = first.tokens.clone()
    OneRow(drafter).accept(torch.tensor([5]), stream.extend(torch.tensor([5])), 9)
    second = OneRow(drafter).propose(9, GREEDY, None).tree
    assert not torch.equal(second.tokens, kept)  # another tree (its root at least): an overwrite shows
    assert torch.equal(first.tokens, kept)
