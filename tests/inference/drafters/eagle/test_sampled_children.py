"""Children drawn from an EAGLE head (drafters/sampled_children.py): the draws follow q without
replacement, each drafted node's q row is the distribution its children were drawn from, and decoding
with them samples the target's distribution exactly."""

from __future__ import annotations

import pytest
import torch

from spechead.heads.eagle3 import Eagle3Config, Eagle3Head
from spechead.inference.drafters.eagle import EagleDrafter
from spechead.inference.drafters.eagle.sampled_children import (
    SampledChildren,
    draft_probs,
    draw_without_replacement,
)
from spechead.inference.drafters.eagle.static_plan import build_static_plan
from spechead.inference.generator import SpeculativeGenerator
from spechead.inference.sampling import SamplingParams, make_generator
from spechead.inference.tree import tree_from_choices

from ...distributions import exact_distribution, sampling_tv
from ...test_generator import PARAMS, PROMPT, eagle_drafter, setup  # noqa: F401  (setup: the fixture)
from ..one_row import OneRow

Q = torch.tensor([0.5, 0.3, 0.15, 0.05])
ROWS = 40000  # draws made at once (rows of the same q): frequencies within about 0.005


def test_one_draw_follows_q_and_never_an_id_of_no_mass():
    q = torch.tensor([[0.0, 0.25, 0.0, 0.75, 0.0]]).expand(ROWS, 5)
    ids = draw_without_replacement(q, 1, make_generator(0))  # [ROWS, 1]
    freq = torch.bincount(ids[:, 0], minlength=5).double() / ROWS
    assert freq[[0, 2, 4]].sum() == 0
    assert (freq - q[0]).abs().max() < 0.01


def test_k_draws_are_distinct_in_draw_order():
    """The first draw follows q, the second q without the first (renormalised): what rule C assumes."""
    ids = draw_without_replacement(Q.expand(ROWS, 4), 3, make_generator(1))  # [ROWS, 3]
    assert all(len(set(row)) == 3 for row in ids.tolist()[:500])
    first = torch.bincount(ids[:, 0], minlength=4).double() / ROWS
    assert (first - Q).abs().max() < 0.01
    after_0 = ids[ids[:, 0] == 0, 1]  # second draws when the first was id 0
    second = torch.bincount(after_0, minlength=4).double() / len(after_0)
    expected = torch.tensor([0.0, 0.3, 0.15, 0.05]) / 0.5
    assert second[0] == 0 and (second - expected).abs().max() < 0.015


def test_the_same_seed_draws_the_same():
    draws = [draw_without_replacement(Q[None], k, make_generator(7)) for k in (1, 1, 2, 2)]
    assert torch.equal(draws[0], draws[1]) and torch.equal(draws[2], draws[3])


def test_draft_probs_apply_the_temperature_and_keep_every_id():
    q = draft_probs(torch.tensor([[0.0, 1.0, 2.0]]), 0.5)
    assert q.dtype == torch.float32
    torch.testing.assert_close(q[0], torch.softmax(torch.tensor([0.0, 2.0, 4.0]), -1))
    assert draft_probs(torch.tensor([[0.0, 300.0]]), 0.5)[0, 0] > 0  # underflown, floored
    assert draft_probs(torch.tensor([[0.0, 300.0]]), 0.5, floor=False)[0, 0] == 0  # (one draw needs no floor)
    torch.testing.assert_close(
        draft_probs(torch.tensor([[0.0, 1.0]]), 1.0), torch.softmax(torch.tensor([[0.0, 1.0]]), -1)
    )


def test_q_rows_put_each_depth_on_the_nodes_it_expanded():
    """A tree with branches and a head vocab mapped onto the target's: row i of q is the distribution
    node i's children were drawn from (the emitted, depth-first order), leaves are zero."""
    choices = [[0], [1], [0, 0], [0, 1], [1, 0], [0, 0, 0]]
    plan = build_static_plan(tree_from_choices(choices), torch.device("cpu"))
    parents = plan.parents.tolist()
    drawn = SampledChildren(lambda x: x, SamplingParams(temperature=1.0), None, 5)
    rows = {1: torch.tensor([[0.5, 0.5, 0.0]]), 2: torch.tensor([[0.1, 0.2, 0.7], [0.3, 0.3, 0.4]]),
            3: torch.tensor([[0.6, 0.4, 0.0]])}  # fmt: skip
    drawn.q_by_depth = [rows[d][None] for d in (1, 2, 3)]  # [1, E, Vd] each
    d2t = torch.tensor([4, 0, 2])  # head id -> target id
    q = drawn.q_rows(plan, d2t)  # [N, V]
    assert q.shape == (len(parents), 5)
    depth = [0] * len(parents)
    for i in range(1, len(parents)):
        depth[i] = depth[parents[i]] + 1
    expanded = sorted({p for p in parents if p >= 0})
    assert plan.expanded.tolist() == [n for d in range(3) for n in expanded if depth[n] == d]
    for node in range(len(parents)):
        if node not in expanded:
            assert q[node].sum() == 0
            continue
        siblings = [n for n in expanded if depth[n] == depth[node]]
        want = torch.zeros(5).index_add_(0, d2t, rows[depth[node] + 1][siblings.index(node)])
        assert torch.equal(q[node], want), node
    drawn.vocab = 3  # a head over the target's own vocab
    same = drawn.q_rows(plan, None)
    assert torch.equal(same[plan.expanded], torch.cat([rows[d] for d in (1, 2, 3)]))


PEAK = 8.0
CHOICES = {"chain": [[0], [0, 0], [0, 0, 0]], "tree": [[0], [1], [0, 0], [1, 0], [0, 0, 0]]}


@pytest.mark.parametrize("shape", ["chain", "tree"])
def test_drafts_carry_their_draws_and_greedy_keeps_the_top_k(setup, shape):  # noqa: F811
    """Sampling: rule C, q [N, V] over the target's vocab, every child a token of its parent's q row,
    siblings distinct, the first child of the root distributed as q[0]. Greedy: the head's top-k."""
    model, tok = setup
    head = support_head(model, list(range(5, 45)), PEAK)  # 40 ids, peaked: a wrong temperature shows
    drafter = EagleDrafter(head, tree=CHOICES[shape], rule="without_replacement")
    gen = SpeculativeGenerator(model, tok, drafter)
    # start: the drafter holds the prompt, its root the answer's first token
    root = gen.generate(input_ids=PROMPT, max_new_tokens=1).token_ids[0]
    params = SamplingParams(temperature=1.3)
    greedy = OneRow(drafter).propose(root, SamplingParams(), None)
    assert greedy.rule == "deterministic" and greedy.q is None
    firsts = []
    for seed in range(600):
        draft = OneRow(drafter).propose(root, params, make_generator(seed))
        tokens, parents = draft.tree.tokens.tolist(), draft.tree.parents.tolist()
        assert draft.rule == "without_replacement" and draft.q is not None
        assert draft.q.shape == (len(tokens), model.config.vocab_size)
        for node in range(1, len(tokens)):
            assert draft.q[parents[node], tokens[node]] > 0
        kids = [[tokens[c] for c in range(1, len(tokens)) if parents[c] == p] for p in range(len(tokens))]
        assert all(len(set(k)) == len(k) for k in kids)
        firsts.append(tokens[1])
    freq = torch.bincount(torch.tensor(firsts), minlength=model.config.vocab_size).double() / len(firsts)
    rows = draft.q.double() / draft.q.sum(-1, keepdim=True).clamp(min=1e-30)  # [N, V]
    tv = 0.5 * (freq - rows).abs().sum(-1)  # [N]: the root's row must be the draws' law
    noise = 0.5 * (2 * rows[0] * (1 - rows[0]) / (torch.pi * len(firsts))).sqrt().sum()  # E[TV] of 600 draws
    assert tv[0] < 1.5 * noise, (tv.tolist(), float(noise))


def support_head(model, tokens: list[int], peak: float = 1.0) -> Eagle3Head:
    """An EAGLE-3 drafter with a random head whose draft vocab is just `tokens` (the target's support
    here): its draws land where the target has mass, so rule C accepts and rejects both."""
    layers = model.config.num_hidden_layers
    torch.manual_seed(0)
    config = Eagle3Config.from_target(
        model.config, target_layers=[1, layers // 2 + 1, layers], draft_vocab_size=len(tokens)
    )
    head = Eagle3Head(config)
    with torch.no_grad():  # peaked draws (a wrong q, row or order then shows in the sampled law)
        head.lm_head.weight.mul_(peak)
    ids = torch.tensor(sorted(tokens))
    t2d = torch.zeros(model.config.vocab_size, dtype=torch.bool)
    t2d[ids] = True
    head.set_draft_vocab(ids - torch.arange(len(ids)), t2d)
    head.attach_target_modules(
        lm_head=model.get_output_embeddings(), embed_tokens=model.get_input_embeddings()
    )
    return head.eval()


@pytest.mark.parametrize("shape", ["chain", "tree"])
def test_sampling_with_drawn_children_matches_the_target_distribution(setup, shape):  # noqa: F811
    """Three tokens deep (the root's and a child's drawn children verified), drafted over the target's
    support so that draws are accepted and rejected alike: the target's law, exactly."""
    model, tok = setup
    support = sorted({t for seq in exact_distribution(model, PROMPT, PARAMS, length=3) for t in seq})
    drafter = EagleDrafter(
        support_head(model, support, PEAK), tree=CHOICES[shape], rule="without_replacement"
    )
    gen = SpeculativeGenerator(model, tok, drafter)
    # (one generate per seed: children are drawn for a batch of one only, batch rows take the top-k)
    tv = sampling_tv(gen, PROMPT, PARAMS, trials=3000, length=3, rows=1)
    runs = [
        gen.generate(input_ids=PROMPT, max_new_tokens=4, temperature=1.3, top_k=3, seed=s) for s in range(200)
    ]
    first = [r.stats.accept_lengths[0] - 1 for r in runs]  # drafts accepted by the first pass
    assert sum(x > 0 for x in first) > 10 and sum(x == 0 for x in first) > 10  # teeth: both happen
    assert any(x == 2 for x in first)  # a child's child accepted too
    # 27 outcomes, 3000 samples: sampling noise gives TV about 0.04; a biased rule is far above.
    assert tv < 0.09, f"TV {tv:.3f}"
