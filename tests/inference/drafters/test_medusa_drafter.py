"""MedusaDrafter fills its static tree from controlled head logits: a node at depth d with child rank
r carries head (d-1)'s r-th best token, read at the LAST committed position; one class for B rows and a
batch of one (row b's tree at B rows is its batch-of-one tree)."""

from __future__ import annotations

import pytest
import torch

from spechead.heads import MedusaConfig, MedusaHead
from spechead.inference.drafters.base import BatchDraft
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


def one(drafter: MedusaDrafter, root: int, params: SamplingParams | None = None) -> BatchDraft:
    """A batch of one's draft (the batched API the engine calls)."""
    return drafter.propose([root], [params or SamplingParams()], [None])


def test_depth_d_nodes_carry_head_d_minus_1_ranked_candidates():
    head, rankings, states = controlled_head()
    choices = [[0], [1], [2], [0, 0], [0, 1], [1, 0], [2, 3], [0, 0, 0], [0, 0, 5], [1, 0, 0], [0, 0, 0, 0]]
    drafter = MedusaDrafter(head, choices)
    root = 7
    prompt = torch.tensor([3, 4, 5])
    # The prompt's last position holds e_0; an earlier one e_1 (which must not be read).
    drafter.start([prompt], [{LAYER: torch.stack([states[1], states[1], states[0]])}], [root])
    draft = one(drafter, root)
    assert draft.rule == "deterministic" and draft.q is None and draft.sizes == [12]
    tree = draft.tree(0)
    # depth-first, rank 0 first: [0], [0, 0], [0, 0, 0], [0, 0, 0, 0] (the main path) are nodes 1..4
    assert tree.parents.tolist() == [-1, 0, 1, 2, 3, 2, 1, 0, 7, 8, 0, 10]
    assert tree.tokens.tolist() == expected_tokens(choices, rankings[0], root)
    # Spelled out for a few nodes ([1] is node 7, [2, 3] node 11, [0, 0, 5] node 5).
    tokens = tree.tokens.tolist()
    assert tokens[7] == int(rankings[0, 0, 1])  # depth 1, rank 1: head 0's second best
    assert tokens[11] == int(rankings[0, 1, 3])  # depth 2, rank 3: head 1's fourth best
    assert tokens[5] == int(rankings[0, 2, 5])  # depth 3, rank 5: head 2's sixth best
    assert tokens[4] == int(rankings[0, 3, 0])  # depth 4: the last head's best

    # accept() moves the heads to the last ACCEPTED row's state (here e_1).
    drafter.accept(torch.tensor([[root, 9]]), [2], {LAYER: torch.stack([states[0], states[1]])[None]}, [11])
    draft = one(drafter, 11, SamplingParams(temperature=1.0))
    assert draft.tokens[0].tolist() == expected_tokens(choices, rankings[1], 11)

    # accept_paths (the decoding loop's call): the path [0, 7, 8] of the whole tree's states, whose last
    # node holds e_0 (every other node e_1): the heads move to e_0
    tree_states = states[1].repeat(1, draft.tokens.shape[1], 1)  # [1, N, H]
    tree_states[0, 8] = states[0]
    drafter.accept_paths([[11, 4, 6]], {LAYER: tree_states}, [[0, 7, 8]], [13])
    assert one(drafter, 13).tokens[0].tolist() == expected_tokens(choices, rankings[0], 13)


def test_b_rows_each_propose_their_batch_of_one_tree():
    """The class at B rows (`_draft`: one head call over every row) proposes row b's batch-of-one tree
    (`_draft`'s kept buffers) through every call: start, accept, accept_paths, keep and the queued form."""
    head, rankings, states = controlled_head(seed=3)
    choices = [[0], [1], [2], [0, 0], [0, 1], [1, 0], [0, 0, 0], [0, 0, 1]]
    # row b's states: e_0 or e_1, and a mix that is neither (the heads' ranking then is the float result)
    mix = 0.3 * states[0] - 0.7 * states[1]
    rows = [states[0], states[1], mix]
    lasts = [torch.stack([s, mix, s]) for s in rows]  # [3, H] each: the last one is read
    roots = [4, 5, 6]
    batch = MedusaDrafter(head, choices)
    batch.start([torch.tensor([1, 2, 3])] * 3, [{LAYER: x} for x in lasts], roots)

    def alone(b: int, root: int, last: torch.Tensor) -> list[int]:
        single = MedusaDrafter(head, choices)
        single.start([torch.tensor([1])], [{LAYER: last[None]}], [root])
        return one(single, root).tokens[0].tolist()

    draft = batch.propose(roots, [SamplingParams()] * 3, [None] * 3)
    assert draft.sizes == [9] * 3 and draft.parents.shape == (3, 9)
    assert draft.tokens.tolist() == [alone(b, roots[b], rows[b]) for b in range(3)]
    assert draft.tokens[0].tolist() == expected_tokens(choices, rankings[0], 4)
    assert draft.tokens[1].tolist() == expected_tokens(choices, rankings[1], 5)
    assert all(draft.parents[b].tolist() == batch.tree.static.parents.tolist() for b in range(3))
    # accept: row b's lengths[b]-th token's state; row 0 moves to e_1, row 1 to the mix, row 2 to e_0
    accepted = torch.stack(
        [torch.stack([mix, states[1]]), torch.stack([mix, mix]), torch.stack([states[0], mix])]
    )
    batch.accept(torch.zeros(3, 2, dtype=torch.long), [2, 1, 1], {LAYER: accepted}, [7, 8, 9])
    want = [states[1], mix, states[0]]
    draft = batch.propose([7, 8, 9], [SamplingParams()] * 3, [None] * 3)
    assert draft.tokens.tolist() == [alone(b, 7 + b, want[b]) for b in range(3)]
    # accept_paths: row b's path's last node (rows' trees of 9 nodes)
    tree_states = mix.repeat(3, 9, 1)  # [3, N, H]
    tree_states[0, 5], tree_states[1, 8], tree_states[2, 0] = states[1], states[0], states[1]
    batch.accept_paths([[1, 2], [1, 2, 3], [1]], {LAYER: tree_states}, [[0, 5], [0, 7, 8], [0]], [1, 2, 3])
    want = [states[1], states[0], states[1]]
    draft = batch.propose([1, 2, 3], [SamplingParams()] * 3, [None] * 3)
    assert draft.tokens.tolist() == [alone(b, 1 + b, want[b]) for b in range(3)]
    # keep: rows 2 and 0, in that order
    batch.keep([2, 0])
    draft = batch.propose([3, 1], [SamplingParams()] * 2, [None] * 2)
    assert draft.tokens.tolist() == [alone(2, 3, want[2]), alone(0, 1, want[0])]
    # the queued form: each path's last entry (the last node repeated), roots from device tensors
    paths = torch.tensor([[0, 3, 3], [0, 1, 2]])
    tree_states = mix.repeat(2, 9, 1)
    tree_states[0, 3], tree_states[1, 2] = states[0], states[1]
    assert batch.queues(2) and batch.commit_width == 1
    batch.accept_queued({LAYER: tree_states}, draft.tokens, paths, torch.tensor([2, 3]), torch.tensor([5, 6]))
    queued = batch.propose_queued(torch.tensor([5, 6]))
    assert queued.tokens.tolist() == [alone(0, 5, states[0]), alone(1, 6, states[1])]
    # a batch of one, queued: the same tree as read first
    single = MedusaDrafter(head, choices)
    single.start([torch.tensor([1])], [{LAYER: mix[None]}], [2])
    single.accept_queued(
        {LAYER: tree_states[1:]}, draft.tokens[1:], paths[1:], torch.tensor([3]), torch.tensor([6])
    )
    assert single.propose_queued(torch.tensor([6])).tokens.tolist() == [alone(0, 6, states[1])]


def test_a_batch_of_one_keeps_one_parents_view():
    """A batch of one's parents are the SAME kept [1, N] host tensor every pass (the target runner knows
    a static tree again by it, reading nothing), queued or read first; B rows expand the static tree's."""
    head, _, states = controlled_head()
    drafter = MedusaDrafter(head, [[0], [1], [0, 0]])
    drafter.start([torch.tensor([1])], [{LAYER: states[:1]}], [2])
    first, second = one(drafter, 2), one(drafter, 3)
    assert first.parents is second.parents and first.parents.shape == (1, 4) and first.parents.is_cpu
    assert drafter.propose_queued(torch.tensor([4])).parents is first.parents
    assert first.tokens.data_ptr() != second.tokens.data_ptr()  # each draft its own tokens
    drafter.start([torch.tensor([1])] * 2, [{LAYER: states[:1]}] * 2, [2, 2])
    rows = drafter.propose([2, 3], [SamplingParams()] * 2, [None] * 2)
    assert rows.parents.tolist() == [[-1, 0, 1, 0]] * 2


@pytest.mark.parametrize("chunk", ["auto", None, 100])
def test_a_large_vocabulary_ranks_through_the_chunked_topk(chunk, monkeypatch):
    """24,000 ids a head (past "auto"'s threshold on a CPU): a batch of one and B rows both carry each
    head's ranked candidates whichever top-k runs; "auto" runs the chunked one (topk.py), None one topk."""
    from spechead.inference.drafters import medusa as medusa_module

    calls, real = [], medusa_module.topk_rows  # the chunk each chunked search was asked for
    monkeypatch.setattr(medusa_module, "topk_rows", lambda x, k, c: (calls.append(c), real(x, k, c))[1])
    head, rankings, states = controlled_head(vocab=24000)
    choices = [[0], [1], [2], [0, 0], [0, 1], [1, 0], [2, 3], [0, 0, 0], [0, 0, 5], [0, 0, 0, 0]]
    drafter = MedusaDrafter(head, choices)
    drafter.topk_chunk = chunk
    drafter.start([torch.tensor([3, 4])], [{LAYER: torch.stack([states[1], states[0]])}], [7])
    assert one(drafter, 7).tokens[0].tolist() == expected_tokens(choices, rankings[0], 7)
    batch = drafter.with_tree(choices)
    assert batch.topk_chunk == chunk
    batch.start([torch.tensor([3]), torch.tensor([4])], [{LAYER: states[1:]}, {LAYER: states[:1]}], [5, 6])
    rows = batch.propose([5, 6], [SamplingParams()] * 2, [None, None]).tokens.tolist()
    assert rows == [expected_tokens(choices, rankings[1], 5), expected_tokens(choices, rankings[0], 6)]
    assert calls == ([64, 64] if chunk == "auto" else [100, 100] if chunk == 100 else [])  # (None: topk)
    assert MedusaDrafter(head).topk_chunk == "auto"  # the default


def test_default_tree_is_clipped_to_the_number_of_heads():
    head, rankings, states = controlled_head(seed=1)
    drafter = MedusaDrafter(head)  # DEFAULT_MEDUSA_CHOICES go 8 deep; K = 4 heads
    drafter.start([torch.tensor([1])], [{LAYER: states[:1]}], [2])
    tokens = one(drafter, 2).tokens[0].tolist()
    clipped = [c for c in DEFAULT_MEDUSA_CHOICES if len(c) <= K]
    assert tokens == expected_tokens(clipped, rankings[0], 2)


def test_a_root_only_tree_drafts_the_root_alone():
    head, _, states = controlled_head()
    drafter = MedusaDrafter(head, [[0] * (K + 1)])  # no path fits K heads: the root alone (none runs)
    drafter.start([torch.tensor([1])], [{LAYER: states[:1]}], [2])
    assert one(drafter, 2).tokens.tolist() == [[2]] and one(drafter, 2).parents.tolist() == [[-1]]
    assert drafter.propose_queued(torch.tensor([5])).tokens.tolist() == [[5]]
    drafter.start([torch.tensor([1])] * 2, [{LAYER: states[:1]}] * 2, [2, 3])
    assert drafter.propose([2, 3], [SamplingParams()] * 2, [None] * 2).tokens.tolist() == [[2], [3]]


class HeardAccept(MedusaDrafter):
    """A subclass with an `accept` of its own: the loop's `accept_paths` must still reach it."""

    def __init__(self, head, choices) -> None:
        super().__init__(head, choices)
        self.heard: list[list[list[int]]] = []

    def accept(self, tokens, lengths, hidden, next_roots):
        self.heard.append([row[:k] for row, k in zip(tokens.tolist(), lengths)])
        super().accept(tokens, lengths, hidden, next_roots)


def test_a_subclass_accept_hears_the_loops_paths():
    head, rankings, states = controlled_head(seed=2)
    drafter = HeardAccept(head, [[0], [1], [0, 0]])
    drafter.start([torch.tensor([1])], [{LAYER: states[1:]}], [2])
    tree_states = states[1].repeat(1, 4, 1)  # [1, N, H]: the path's last node (2) holds e_0
    tree_states[0, 2] = states[0]
    drafter.accept_paths([[2, 5, 6]], {LAYER: tree_states}, [[0, 1, 2]], [3])
    assert drafter.heard == [[[2, 5, 6]]]
    assert torch.equal(drafter.last_hidden, states[:1])


def test_each_draft_is_its_own_tensor_and_the_heads_may_change_dtype():
    """One row's tree comes from kept buffers: a later propose must not change an earlier draft's
    tokens, and heads moved to another dtype between proposes remake the buffers."""
    head, rankings, states = controlled_head()
    choices = [[0], [1], [0, 0], [0, 1], [0, 0, 0]]
    drafter = MedusaDrafter(head, choices)
    drafter.start([torch.tensor([3, 4])], [{LAYER: states[[1, 0]]}], [7])
    first = one(drafter, 7)
    drafter.accept(torch.tensor([[7]]), [1], {LAYER: states[None, 1:2]}, [9])  # the heads move to e_1
    second = one(drafter, 9)
    assert first.tokens[0].tolist() == expected_tokens(choices, rankings[0], 7)
    assert second.tokens[0].tolist() == expected_tokens(choices, rankings[1], 9)
    head.to(torch.float64)
    drafter.accept(torch.tensor([[9]]), [1], {LAYER: states[None, 0:1]}, [5])
    assert one(drafter, 5).tokens[0].tolist() == expected_tokens(choices, rankings[0], 5)


def test_the_engine_takes_it_as_it_is_with_every_knob_the_generator_reads():
    """A `Drafter` itself: `rows_drafter` hands it back (its `start` resets it), and it carries what the
    generator reads of any drafter (DrafterBase)."""
    from spechead.inference.drafters.per_row import rows_drafter

    head, _, states = controlled_head()
    choices = [[0], [1], [0, 0]]
    drafter = MedusaDrafter(head, choices)
    assert rows_drafter(drafter) is drafter
    assert drafter.hidden_layers == (LAYER,) and drafter.choices == choices and drafter.max_nodes == 64
    drafter.use_compile("graphs")  # (nothing of its own to compile)
    with pytest.raises(ValueError, match="hidden_size"):
        drafter.check_target(H + 1, V, LAYER)
    drafter.start([torch.tensor([1])] * 3, [{LAYER: states[:1]}] * 3, [1, 2, 3])
    assert drafter.last_hidden.shape == (3, H)
    drafter.start([torch.tensor([1])], [{LAYER: states[1:]}], [4])  # a new batch: the old rows gone
    assert drafter.last_hidden.shape == (1, H) and one(drafter, 4).tokens.shape == (1, 4)
