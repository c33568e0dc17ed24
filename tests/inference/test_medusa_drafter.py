"""MedusaDrafter fills its static tree from controlled head logits: a node at depth d with child rank
r carries head (d-1)'s r-th best token, read at the LAST committed position."""

from __future__ import annotations

import pytest
import torch

from spechead.heads import MedusaConfig, MedusaHead
from spechead.inference.drafters.medusa import DEFAULT_MEDUSA_CHOICES, MedusaDrafter
from spechead.inference.sampling import SamplingParams
from spechead.inference.tree import depth_first, tree_from_choices

H, V, K = 8, 24, 4  # hidden size, vocab, Medusa heads
LAYER = 2  # the target layer the heads read (target_num_layers = 2: index -1 resolves to 2)


def controlled_head(seed: int = 0, vocab: int = V) -> tuple[MedusaHead, torch.Tensor, torch.Tensor]:
    """A Medusa head whose head k, on state e_0 (e_1), ranks the vocab as rankings[0][k] ([1][k]).

    ResBlocks stay zero (the identity), so head k's logits on e_j are column j of its projection.
    Returns (head, rankings [2, K, V]: [j, k, r] = head k's r-th best token on e_j, one-hot states [2, H]).
    """
    head = MedusaHead(MedusaConfig(hidden_size=H, vocab_size=vocab, num_heads=K, target_num_layers=LAYER))
    g = torch.Generator().manual_seed(seed)
    rankings = torch.stack(
        [torch.stack([torch.randperm(vocab, generator=g) for _ in range(K)]) for _ in range(2)]
    )
    with torch.no_grad():
        for k in range(K):
            proj = head.heads[k][-1].weight  # (V, H)
            proj.zero_()
            for j in range(2):
                proj[rankings[j, k], j] = torch.linspace(
                    5.0, -5.0, vocab
                )  # r-th ranked token gets the r-th value
    return head.eval(), rankings, torch.eye(H)[:2]


def expected_tokens(choices: list[list[int]], ranking: torch.Tensor, root: int) -> list[int]:
    """Tokens [N] of the static tree (depth-first: the rank-0 chain first): root, then node (depth d,
    rank r) = ranking[d - 1, r]."""
    static = depth_first(tree_from_choices(choices))
    return [root] + [
        int(ranking[d - 1, r]) for d, r in zip(static.depth[1:].tolist(), static.rank[1:].tolist())
    ]


def test_depth_d_nodes_carry_head_d_minus_1_ranked_candidates():
    head, rankings, states = controlled_head()
    choices = [[0], [1], [2], [0, 0], [0, 1], [1, 0], [2, 3], [0, 0, 0], [0, 0, 5], [1, 0, 0], [0, 0, 0, 0]]
    drafter = MedusaDrafter(head, choices)
    root = 7
    prompt = torch.tensor([3, 4, 5])
    # The prompt's last position holds e_0; an earlier one e_1 (which must not be read).
    drafter.start(prompt, {LAYER: torch.stack([states[1], states[1], states[0]])}, root)
    draft = drafter.propose(root, SamplingParams(), None)
    assert draft.rule == "deterministic" and draft.q is None
    # depth-first, rank 0 first: [0], [0, 0], [0, 0, 0], [0, 0, 0, 0] (the main path) are nodes 1..4
    assert draft.tree.parents.tolist() == [-1, 0, 1, 2, 3, 2, 1, 0, 7, 8, 0, 10]
    assert draft.tree.tokens.tolist() == expected_tokens(choices, rankings[0], root)
    # Spelled out for a few nodes ([1] is node 7, [2, 3] node 11, [0, 0, 5] node 5).
    tokens = draft.tree.tokens.tolist()
    assert tokens[7] == int(rankings[0, 0, 1])  # depth 1, rank 1: head 0's second best
    assert tokens[11] == int(rankings[0, 1, 3])  # depth 2, rank 3: head 1's fourth best
    assert tokens[5] == int(rankings[0, 2, 5])  # depth 3, rank 5: head 2's sixth best
    assert tokens[4] == int(rankings[0, 3, 0])  # depth 4: the last head's best

    # accept() moves the heads to the last ACCEPTED row's state (here e_1).
    drafter.accept(torch.tensor([root, 9]), {LAYER: torch.stack([states[0], states[1]])}, 11)
    draft = drafter.propose(11, SamplingParams(temperature=1.0), None)
    assert draft.tree.tokens.tolist() == expected_tokens(choices, rankings[1], 11)

    # accept_path (the decoding loop's call): the path [0, 7, 8] of the whole tree's states, whose last
    # node holds e_0 (every other node e_1): the heads move to e_0
    tree_states = states[1].repeat(1, draft.tree.size, 1)  # [1, N, H]
    tree_states[0, 8] = states[0]
    drafter.accept_path([11, 4, 6], {LAYER: tree_states}, [0, 7, 8], 13)
    assert drafter.propose(13, SamplingParams(), None).tree.tokens.tolist() == expected_tokens(
        choices, rankings[0], 13
    )


@pytest.mark.parametrize("chunk", ["auto", None, 100])
def test_a_large_vocabulary_ranks_through_the_chunked_topk(chunk, monkeypatch):
    """24,000 ids a head (past "auto"'s threshold on a CPU): batch 1 and the batch fill both carry each
    head's ranked candidates whichever top-k runs; "auto" runs the chunked one (topk.py), None one topk."""
    from spechead.inference.drafters import medusa as medusa_module

    calls, real = [], medusa_module.topk_rows  # the chunk each chunked search was asked for
    monkeypatch.setattr(medusa_module, "topk_rows", lambda x, k, c: (calls.append(c), real(x, k, c))[1])
    head, rankings, states = controlled_head(vocab=24000)
    choices = [[0], [1], [2], [0, 0], [0, 1], [1, 0], [2, 3], [0, 0, 0], [0, 0, 5], [0, 0, 0, 0]]
    drafter = MedusaDrafter(head, choices)
    drafter.topk_chunk = chunk
    drafter.start(torch.tensor([3, 4]), {LAYER: torch.stack([states[1], states[0]])}, 7)
    assert drafter.propose(7, SamplingParams(), None).tree.tokens.tolist() == expected_tokens(
        choices, rankings[0], 7
    )
    batch = drafter.with_tree(choices).batched()
    assert batch.drafter.topk_chunk == chunk
    batch.start([torch.tensor([3]), torch.tensor([4])], [{LAYER: states[1:]}, {LAYER: states[:1]}], [5, 6])
    rows = batch.propose([5, 6], [SamplingParams()] * 2, [None, None]).tokens.tolist()
    assert rows == [expected_tokens(choices, rankings[1], 5), expected_tokens(choices, rankings[0], 6)]
    assert calls == ([64, "auto"] if chunk == "auto" else [100, 100] if chunk == 100 else [None])
    assert MedusaDrafter(head).topk_chunk == "auto"  # the default


def test_default_tree_is_clipped_to_the_number_of_heads():
    head, rankings, states = controlled_head(seed=1)
    drafter = MedusaDrafter(head)  # DEFAULT_MEDUSA_CHOICES go 8 deep; K = 4 heads
    drafter.start(torch.tensor([1]), {LAYER: states[:1]}, 2)
    tokens = drafter.propose(2, SamplingParams(), None).tree.tokens.tolist()
    clipped = [c for c in DEFAULT_MEDUSA_CHOICES if len(c) <= K]
    assert tokens == expected_tokens(clipped, rankings[0], 2)


class HeardAccept(MedusaDrafter):
    """A subclass with an `accept` of its own: the loop's `accept_path` must still reach it."""

    def __init__(self, head, choices) -> None:
        super().__init__(head, choices)
        self.heard: list[list[int]] = []

    def accept(self, tokens, hidden, next_root):
        self.heard.append(tokens.tolist())
        super().accept(tokens, hidden, next_root)


def test_a_subclass_accept_hears_the_loops_paths():
    head, rankings, states = controlled_head(seed=2)
    drafter = HeardAccept(head, [[0], [1], [0, 0]])
    drafter.start(torch.tensor([1]), {LAYER: states[1:]}, 2)
    tree_states = states[1].repeat(1, 4, 1)  # [1, N, H]: the path's last node (2) holds e_0
    tree_states[0, 2] = states[0]
    drafter.accept_path([2, 5, 6], {LAYER: tree_states}, [0, 1, 2], 3)
    assert drafter.heard == [[2, 5, 6]]
    assert torch.equal(drafter.last_hidden, states[0])


def test_each_draft_is_its_own_tensor_and_the_heads_may_change_dtype():
    """One row's tree comes from kept buffers: a later propose must not change an earlier draft's
    tokens, and heads moved to another dtype between proposes remake the buffers."""
    head, rankings, states = controlled_head()
    choices = [[0], [1], [0, 0], [0, 1], [0, 0, 0]]
    drafter = MedusaDrafter(head, choices)
    drafter.start(torch.tensor([3, 4]), {LAYER: states[[1, 0]]}, 7)
    first = drafter.propose(7, SamplingParams(), None)
    drafter.accept(torch.tensor([7]), {LAYER: states[1:2]}, 9)  # the heads move to e_1
    second = drafter.propose(9, SamplingParams(), None)
    assert first.tree.tokens.tolist() == expected_tokens(choices, rankings[0], 7)
    assert second.tree.tokens.tolist() == expected_tokens(choices, rankings[1], 9)
    head.to(torch.float64)
    drafter.accept(torch.tensor([9]), {LAYER: states[0:1]}, 5)
    assert drafter.propose(5, SamplingParams(), None).tree.tokens.tolist() == expected_tokens(
        choices, rankings[0], 5
    )
