"""Medusa top-k counts, accuracy and simulated chain tau on hand-built tensors."""

from __future__ import annotations

import pytest
import torch

from spechead.training.metrics import (
    answer_roots,
    best_score,
    chain_counts,
    chain_summary,
    counts_to_accuracy,
    medusa_chains,
    medusa_topk_counts,
    simulated_chain_tau,
    walked_counts,
)
from spechead.training.objectives.medusa import medusa_counts

V = 6
INPUT_IDS = torch.tensor([[0, 1, 2, 3, 4, 5]])
LOSS_MASK = torch.tensor([[0, 1, 1, 1, 1, 0]])  # last token is padding


def ranked_logits(num_heads: int, rank: dict[tuple[int, int], int]) -> list[torch.Tensor]:
    """Head k at position t ranks its target input_ids[t+2+k] at rank[(k, t)] (0 = top-1, default)."""
    logits = []
    for k in range(num_heads):
        x = torch.zeros(1, 6, V)
        for t in range(6):
            j = t + 2 + k
            target = int(INPUT_IDS[0, j]) if j < 6 else 0
            order = [v for v in range(V) if v != target]
            order.insert(rank.get((k, t), 0), target)
            x[0, t, order] = torch.arange(V, 0, -1, dtype=torch.float)  # order[0] scores highest
        logits.append(x)
    return logits


def test_topk_counts_follow_alignment_and_mask() -> None:
    # Valid targets: head0 t=0,1,2 (targets at 2,3,4); head1 t=0,1; head2 t=0; head3 none
    # (t+2+k = 5 is padding).
    logits = ranked_logits(4, {(0, 1): 1, (0, 2): 5, (1, 0): 4, (2, 0): 2})
    correct, total = medusa_topk_counts(logits, INPUT_IDS, LOSS_MASK, topk=(1, 2, 5))
    assert total.tolist() == [3.0, 2.0, 1.0, 0.0]
    assert correct.tolist() == [[1, 2, 2], [1, 1, 2], [0, 0, 1], [0, 0, 0]]
    assert correct.dtype == total.dtype == torch.float32


def test_counts_sum_across_batches_and_topk_larger_than_vocab() -> None:
    logits = ranked_logits(2, {(0, 0): 5})
    c1, t1 = medusa_topk_counts(logits, INPUT_IDS, LOSS_MASK, topk=(1, 10))
    c2, t2 = medusa_topk_counts(logits, INPUT_IDS, LOSS_MASK, topk=(1, 10))
    acc = counts_to_accuracy(c1 + c2, t1 + t2)
    torch.testing.assert_close(acc, torch.tensor([[2 / 3, 1.0], [1.0, 1.0]]))


def test_counts_to_accuracy_reads_zero_for_empty_heads() -> None:
    acc = counts_to_accuracy(torch.tensor([[2.0, 3.0], [0.0, 0.0]]), torch.tensor([4.0, 0.0]))
    assert acc.tolist() == [[0.5, 0.75], [0.0, 0.0]]


def test_simulated_chain_tau_hand_computed() -> None:
    correct = torch.tensor(
        [  # positions:  n0    n1     n2     n3
        [True, True, False, True],  # head 0
        [True, False, True, True],  # head 1
        [True, True, True, False],  # head 2
        ]
    )  # fmt: skip
    # 1 + leading run: n0 -> 4, n1 -> 2, n2 -> 1, n3 -> 3
    assert simulated_chain_tau(correct) == pytest.approx(2.5)
    assert simulated_chain_tau(torch.zeros(3, 0, dtype=torch.bool)) == 0.0


def chains(leading: list[list[int]], depth: int) -> torch.Tensor:
    """correct (depth, B, T) whose chain at [b, t] has leading[b][t] right drafts, then a miss."""
    correct = torch.zeros(depth, len(leading), len(leading[0]), dtype=torch.bool)
    for b, row in enumerate(leading):
        for t, a in enumerate(row):
            correct[:a, b, t] = True
            if a + 1 < depth:
                correct[a + 1 :, b, t] = True  # right again after the miss: must not count
    return correct


def test_walked_counts_follow_the_passes_decoding_makes() -> None:
    # row 0, one answer over t = 0..7: t=0 accepts 3 -> t=4 accepts 0 -> t=5 accepts 2 -> t=8: the end
    # row 1, two answers (t = 0..2 and 5..7): t=0 accepts 1 -> t=2 accepts 2 (cut by the answer's end)
    #   -> t=5, the next answer's first anchor, accepts 0 -> t=6 accepts 1 -> t=8
    leading = [[3, 0, 1, 0, 0, 2, 0, 0], [1, 3, 2, 3, 3, 0, 1, 0]]
    stand = torch.tensor([[1] * 8, [1, 1, 1, 0, 0, 1, 1, 1]]).bool()
    counts = walked_counts(chains(leading, 4), stand)
    assert counts["walk_passes"].item() == 3 + 4
    assert counts["walk_tokens"].item() == (4 + 1 + 3) + (2 + 3 + 1 + 2)
    every = chain_counts(chains(leading, 4)[:, stand])  # every anchor, as `tau` counts them
    summary = chain_summary({**every, **counts})
    assert summary["tau_walked"] == pytest.approx(16 / 7) and summary["tau"] == pytest.approx(27 / 14)
    assert "tau_walked" not in chain_summary(every)


def test_answer_roots_mark_anchors_whose_next_token_is_trained() -> None:
    batch = {"loss_mask": torch.tensor([[0, 0, 1, 1, 0, 1]])}
    assert answer_roots(batch).tolist() == [[False, True, True, False, True, False]]


def test_top1_correct_counts_positions_whose_next_token_is_a_target() -> None:
    # Positions t with loss_mask[t+1] = 1: t = 0..3. Head k is right where t+2+k is a valid target
    # and its top-1 matches: head0 t=0,2 (t=1 ranked 1, t=3 -> padding); head1 t=0,1; head2 t=0.
    logits = ranked_logits(3, {(0, 1): 1})
    right, anchor = medusa_chains(logits, INPUT_IDS, LOSS_MASK)  # (K, B, T), (B, T)
    correct = right[:, anchor]  # (K, N)
    assert correct.tolist() == [
        [True, False, True, False],
        [True, True, False, False],
        [True, False, False, False],
    ]
    # tau per position: 4, 1, 2, 1
    assert simulated_chain_tau(correct) == pytest.approx(2.0)


def test_medusa_counts_score_chains_against_the_targets_next_greedy_token() -> None:
    """With target logits, the token accepted at t+1 is the target's argmax at t: a target whose
    greedy tokens are the data's gives the data's tau; one that never agrees gives tau 1."""
    logits = ranked_logits(3, {(0, 1): 1})  # right on the data except head 0 at t=1 (tau 2.0 above)
    batch = {"input_ids": INPUT_IDS, "loss_mask": LOSS_MASK}
    agrees = torch.zeros(1, 6, V)
    agrees[0, torch.arange(5), INPUT_IDS[0, 1:]] = 1.0  # argmax at t = input_ids[t+1]
    counts = medusa_counts(logits, batch, [1], agrees)
    assert float(counts["tau_sum"] / counts["positions"]) == pytest.approx(2.0)
    # decoding's walk: the pass at t=0 accepts all 3 heads, the next would start at t=4, past the answer
    assert (counts["walk_tokens"].item(), counts["walk_passes"].item()) == (4.0, 1.0)
    disagrees = torch.zeros(1, 6, V)
    disagrees[0, :, 1] = 1.0  # always token 1, which no head ever predicts
    counts = medusa_counts(logits, batch, [1], disagrees)
    assert float(counts["tau_sum"] / counts["positions"]) == pytest.approx(1.0)
    assert (counts["walk_tokens"].item(), counts["walk_passes"].item()) == (4.0, 4.0)  # one token a pass


def test_best_head_is_picked_by_the_tau_decoding_sees() -> None:
    assert best_score({"tau": 5.4, "tau_walked": 3.1}) == ("tau_walked", 3.1)
    assert best_score({"tau": 2.5}) == ("tau", 2.5)  # a family without the walk
    assert best_score({}) is None  # no validation split
