"""Tree search: best_choices is the optimal prefix-closed tree; measured accuracies match by hand."""

from __future__ import annotations

import itertools
import math

import pytest
import torch

from spechead.heads import MedusaConfig, MedusaHead
from spechead.inference.tree import tree_from_choices
from spechead.inference.tuning.accuracy import measure_eagle_accuracy, measure_medusa_accuracy
from spechead.inference.tuning.tree_search import (
    best_choices,
    expected_accept_length,
    interpolate_cost,
    ranked_choices_for_cost,
)

# exact binary fractions: products are exact, so ties are real ties
TABLE = torch.tensor([[0.5, 0.25], [0.5, 0.125]])  # [depth 2, k 2]


def all_paths(depth: int, width: int) -> list[tuple[int, ...]]:
    return [p for d in range(1, depth + 1) for p in itertools.product(range(width), repeat=d)]


def brute_force_best(accuracy: torch.Tensor, n: int) -> float:
    """Largest expected accept length over every prefix-closed tree of n nodes."""
    paths = all_paths(*accuracy.shape)
    best = -1.0
    for subset in itertools.combinations(paths, n):
        chosen = set(subset)
        if all(p[:-1] in chosen for p in subset if len(p) > 1):
            best = max(best, expected_accept_length(accuracy, [list(p) for p in subset]))
    return best


@pytest.mark.parametrize(
    "n, expected",
    [
        (0, []),
        (1, [[0]]),
        (2, [[0], [1]]),  # [1] and [0, 0] tie at 0.25: the shorter wins
        (3, [[0], [1], [0, 0]]),
        (4, [[0], [1], [0, 0], [1, 0]]),
        (5, [[0], [1], [0, 0], [0, 1], [1, 0]]),  # [0, 1] = 0.0625 beats [1, 1] = 0.03125
    ],
)
def test_best_choices_known_optimum(n, expected):
    assert best_choices(TABLE, n) == expected


def test_expected_accept_length_by_hand():
    assert expected_accept_length(TABLE, []) == 1.0
    assert expected_accept_length(TABLE, [[0], [1], [0, 0], [1, 0]]) == 1 + 0.5 + 0.25 + 0.25 + 0.125
    with pytest.raises(ValueError, match="at least"):
        expected_accept_length(TABLE, [[0], [0, 0], [0, 0, 0]])  # deeper than the table
    with pytest.raises(ValueError, match="at least"):
        expected_accept_length(TABLE, [[2]])  # rank beyond k
    with pytest.raises(ValueError, match="parent"):
        expected_accept_length(TABLE, [[0, 0]])  # not prefix-closed


def test_lexicographic_ties_and_full_tree():
    flat = torch.full((2, 2), 0.5)
    assert best_choices(flat, 4) == [[0], [1], [0, 0], [0, 1]]
    assert best_choices(flat, 100) == [[0], [1], [0, 0], [0, 1], [1, 0], [1, 1]]  # capped: all 6 paths


@pytest.mark.parametrize("seed", range(6))
def test_best_choices_is_optimal_prefix_closed_and_sorted(seed):
    g = torch.Generator().manual_seed(seed)
    acc = torch.rand(3, 2, generator=g).sort(dim=1, descending=seed % 2 == 0).values  # [3, 2]
    for n in range(1, 9):
        choices = best_choices(acc, n)
        assert len(choices) == n and len({tuple(c) for c in choices}) == n
        assert all(c[:-1] in choices for c in choices if len(c) > 1)  # closed under prefixes
        assert choices == sorted(choices, key=lambda c: (len(c), c))
        tree_from_choices(choices)
        assert math.isclose(expected_accept_length(acc, choices), brute_force_best(acc, n), rel_tol=1e-12)


def test_best_choices_rejects_bad_tables():
    for bad in (
        torch.tensor([0.5]),
        torch.tensor([[1.5]]),
        torch.tensor([[float("nan")]]),
        torch.zeros(0, 2),
    ):
        with pytest.raises(ValueError):
            best_choices(bad, 3)
    with pytest.raises(ValueError):
        best_choices(TABLE, -1)


@pytest.fixture(scope="module")
def model_and_head(tiny_llama):
    model = tiny_llama(64, layers=2, hidden=32, seed=5)
    cfg = model.config
    head = MedusaHead(MedusaConfig(hidden_size=32, vocab_size=64, num_heads=3, target_num_layers=2))
    head.init_from_lm_head_(model.lm_head.weight)  # zero ResBlocks: every head = the target's lm_head
    head.attach_target_modules(lm_head=model.lm_head, embed_tokens=model.get_input_embeddings())
    assert head.config.target_layers == [cfg.num_hidden_layers]  # the final normed state
    return model.eval(), head.eval()


def planted(model, prefix: list[int], length: int, lag: int, rank_at) -> torch.Tensor:
    """Extend `prefix` to `length` tokens so token t+lag is the target's rank_at(t)-th candidate at t."""
    ids = list(prefix)
    with torch.no_grad():
        while len(ids) < length:
            t = len(ids) - lag
            logits = model(torch.tensor([ids[: t + 1]])).logits[0, -1]  # [V]: the target at position t
            ids.append(int(logits.topk(4).indices[rank_at(t)]))
    return torch.tensor(ids)


def test_measure_medusa_accuracy_by_hand(model_and_head):
    model, head = model_and_head
    # head 1 (lm_head on position t's state, reference t+3) finds token t+3 as its 3rd candidate everywhere
    seqs = [planted(model, p, n, lag=3, rank_at=lambda t: 2) for p, n in (([7, 1, 30], 9), ([5, 5, 60], 14))]
    acc = measure_medusa_accuracy(model, head, seqs, topk=4)
    assert acc.shape == (3, 4) and ((acc >= 0) & (acc <= 1)).all()
    assert acc[1].tolist() == [0.0, 0.0, 1.0, 0.0]
    # every entry against a plain forward of the target
    hits, total = torch.zeros(3, 4), torch.zeros(3, 1)
    for seq in seqs:
        with torch.no_grad():
            cand = model(seq[None]).logits[0].topk(4).indices  # [T, 4]
        for k in range(3):
            for t in range(len(seq) - 2 - k):
                hits[k] += (cand[t] == seq[t + 2 + k]).float()
                total[k] += 1
    assert total.flatten().tolist() == [7 + 12, 6 + 11, 5 + 10]
    torch.testing.assert_close(acc, hits / total)


def test_measure_counts_generated_positions_only(model_and_head):
    """Prompt tokens (index < start) never serve as references: position t counts iff t >= start - 1."""
    model, head = model_and_head
    start, length = 6, 16
    # head 0 (reference t+2): rank 0 inside the prompt, rank 1 in the generated part
    seq = planted(model, [11, 4], length, lag=2, rank_at=lambda t: 0 if t + 2 < start else 1)
    acc = measure_medusa_accuracy(model, head, [seq], topk=2, starts=[start])
    assert acc[0].tolist() == [0.0, 1.0]  # positions 5..13, references 7..15: all rank 1
    everything = measure_medusa_accuracy(model, head, [seq], topk=2)  # positions 0..13
    assert everything[0].tolist() == pytest.approx([4 / 14, 10 / 14])
    with pytest.raises(ValueError, match="too short"):
        measure_medusa_accuracy(model, head, [seq], topk=2, starts=[length - 2])  # heads 1, 2: no position
    with pytest.raises(ValueError, match="starts"):
        measure_medusa_accuracy(model, head, [seq], topk=2, starts=[1, 2])


def test_interpolated_cost_and_best_tree_for_cost():
    from spechead.inference.tuning.tree_search import interpolate_cost, ranked_choices_for_cost

    costs = {1: 4.0, 2: 5.0, 4: 6.0, 8: 8.0}
    assert interpolate_cost(costs, 3) == pytest.approx(5.5)
    assert interpolate_cost(costs, 12) == pytest.approx(10.0)  # the last slope, extrapolated
    uneven = {1: 1.0, 3: 3.0, 4: 10.0}  # each segment its own slope: the right one is read
    assert [interpolate_cost(uneven, n) for n in (1, 2, 4, 5)] == pytest.approx([1.0, 2.0, 10.0, 17.0])
    assert interpolate_cost({4: 3.0}, 9) == 3.0  # one measured size: its cost for every size
    accuracy = torch.tensor([[0.9, 0.05], [0.8, 0.05], [0.7, 0.05]])
    choices, speedup = ranked_choices_for_cost(accuracy, costs, step_ms=4.0)[0]
    # Cheap verification: the long greedy spine pays, the 0.05 siblings never do.
    assert choices == [[0], [0, 0], [0, 0, 0]]
    assert speedup == pytest.approx((1 + 0.9 + 0.72 + 0.504) * 4.0 / interpolate_cost(costs, 4))
    # Expensive verification: drafting nothing extra is not allowed, the smallest tree wins.
    choices, _ = ranked_choices_for_cost(accuracy, {1: 4.0, 2: 40.0}, step_ms=4.0)[0]
    assert choices == [[0]]


def test_cost_per_draft_depth_favours_shallow_trees():
    """An EAGLE head runs once per depth: a dear draft step makes the best tree shallower."""
    accuracy = torch.tensor([[0.9, 0.05], [0.9, 0.05], [0.9, 0.05], [0.9, 0.05]])
    costs = {1: 10.0, 2: 10.0, 64: 10.0}
    deep, _ = ranked_choices_for_cost(accuracy, costs, step_ms=10.0, draft_ms_per_depth=0.1)[0]
    shallow, speedup = ranked_choices_for_cost(accuracy, costs, step_ms=10.0, draft_ms_per_depth=20.0)[0]
    assert max(map(len, deep)) == 4 and max(map(len, shallow)) == 1
    assert speedup == pytest.approx(expected_accept_length(accuracy, shallow) * 10.0 / (10.0 + 20.0))


def test_per_pass_cost_counts_in_every_tree():
    """pass_ms (commit + accept step) is paid by every pass: the expected speedup divides by it too."""
    accuracy = torch.tensor([[0.9, 0.05], [0.8, 0.05], [0.7, 0.05]])
    costs = {1: 4.0, 2: 5.0, 4: 6.0, 8: 8.0}
    choices, speedup = ranked_choices_for_cost(accuracy, costs, step_ms=4.0, pass_ms=2.0)[0]
    cost = interpolate_cost(costs, len(choices) + 1) + 2.0
    assert speedup == pytest.approx(expected_accept_length(accuracy, choices) * 4.0 / cost)


def test_measure_counts_the_last_prompt_position(model_and_head):
    """Position start - 1 (the prompt's last token) guesses a generated token: it counts."""
    model, head = model_and_head
    start, length = 6, 16
    # head 0 (reference t+2): rank 0 at position start - 1 only, rank 1 at the later positions
    seq = planted(model, [11, 4], length, lag=2, rank_at=lambda t: 0 if t < start else 1)
    acc = measure_medusa_accuracy(model, head, [seq], topk=2, starts=[start])
    assert acc[0].tolist() == pytest.approx([1 / 9, 8 / 9])  # positions 5..13


@pytest.mark.parametrize("kind", ["eagle", "eagle3"])
def test_measure_eagle_accuracy_by_hand(tiny_llama, kind):
    """accuracy[d, r] of an EAGLE or EAGLE-3 head: depth 1 at position t is the committed step on (f_t, x_{t+1});
    depth 2 at t is the step on (depth-1 output at t - 1, x_{t+1}) after the committed pairs 0..t - 1,
    at position t. Both guess x_{t+2}, and t counts when t - (d - 1) >= start - 1 and t + 2 < T."""
    from transformers import DynamicCache

    from spechead.heads.eagle import EagleConfig, EagleHead
    from spechead.heads.eagle3 import Eagle3Config, Eagle3Head
    from spechead.inference.target.runner import TargetRunner

    model = tiny_llama(64, layers=4, hidden=32, seed=5)
    torch.manual_seed(1)
    if kind == "eagle":
        head = EagleHead(EagleConfig.from_target(model.config))
    else:  # (its input features: the three layers fused)
        head = Eagle3Head(Eagle3Config.from_target(model.config, target_layers=[1, 2, 3]))
    for p in head.parameters():  # sharp logits: no near-ties
        p.data.mul_(3.0)
    head.attach_target_modules(lm_head=model.lm_head, embed_tokens=model.get_input_embeddings())
    head = head.eval().requires_grad_(False)

    def step_logits(ids: torch.Tensor, t: int, depth: int) -> torch.Tensor:
        """Head logits [V] at position t, depth 1 or 2, run as decoding runs them."""
        hidden = TargetRunner(model, head.config.target_layers).prefill([ids])[1][0]  # {l: [T, H]}
        feats = head.features([hidden[layer][None] for layer in head.config.target_layers])  # [1, T, H]
        with torch.no_grad():
            if depth == 1:
                out = head.step(feats[:, : t + 1], ids[None, 1 : t + 2])[:, -1:]
            else:
                cache = DynamicCache()
                parent = head.step(feats[:, :t], ids[None, 1 : t + 1], past_key_values=cache)[:, -1:]
                out = head.step(parent, ids[None, t + 1 : t + 2], past_key_values=cache)
            return head.logits(out)[0, -1]

    # token t + 2 is the depth-1 step's rank-2 candidate at every t (the depth-2 row is left to chance)
    ids = torch.tensor([7, 1, 30])
    while len(ids) < 14:
        ids = torch.cat([ids, step_logits(ids, len(ids) - 2, 1).topk(4).indices[2:3]])
    start, topk = 5, 4
    acc = measure_eagle_accuracy(model, head, [ids], depth=2, topk=topk, starts=[start])
    assert acc[0].tolist() == [0.0, 0.0, 1.0, 0.0]
    for depth in (1, 2):
        positions = range(start - 1 + depth - 1, len(ids) - 2)
        hits = torch.zeros(topk)
        for t in positions:
            hits += (step_logits(ids, t, depth).topk(topk).indices == ids[t + 2]).float()
        torch.testing.assert_close(acc[depth - 1], hits / len(positions))
