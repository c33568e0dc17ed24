"""inference/tuning/skip_search.py's arithmetic: the expected speedup of a chain (its draft cost included) and
the chain length best_chain picks."""

from __future__ import annotations

import pytest
import torch

from spechead.inference.tuning.skip_search import Costs, best_chain


def test_speedup_is_tau_steps_over_verify_plus_draft():
    costs = Costs(step=1.0, verify={2: 0.5}, draft={(3, 2): 0.5})
    assert costs.speedup(2.0, 2, 3) == pytest.approx(2.0)  # 2 tokens a pass of 0.5 + 0.5 s, 1 s a token
    assert costs.speedup(3.0, 2, 3) == pytest.approx(3.0)


def test_best_chain_takes_the_chain_length_of_the_highest_speedup_with_its_tau():
    matches = [torch.tensor([1, 1, 1, 0, 1, 1, 1, 0], dtype=torch.bool)]  # 9 tokens
    # k = 1: passes [2, 2, 2, 2] -> tau 2; k = 3: [4, 4] -> tau 4
    costs = Costs(
        step=1.0, verify={1: 1.0, 3: 1.2}, draft={(3, 1): 0.1, (3, 3): 0.3, (1, 1): 0.0, (1, 3): 9.0}
    )
    got = best_chain((0,), matches, costs, num_layers=4)  # 3 layers kept: k = 3 (4 / 1.5 against 2 / 1.1)
    assert (got.skip, got.num_draft, got.tau, got.speedup) == ((0,), 3, 4.0, pytest.approx(4.0 / 1.5))
    # one layer kept: k = 3's draft costs 9 s, k = 1 wins (2 / 1.0), with its own tau
    fast = best_chain((0, 1, 2), matches, costs, num_layers=4)
    assert (fast.num_draft, fast.tau, fast.speedup) == (1, 2.0, pytest.approx(2.0))
