"""heads.grad.no_grad: the call runs without gradients whatever the caller's grad mode, which is restored."""

from __future__ import annotations

import torch

from spechead.heads.grad import no_grad


def test_no_grad_runs_without_gradients_and_restores_the_mode() -> None:
    weight = torch.ones(3, requires_grad=True)
    seen = []

    @no_grad
    def scaled(x: torch.Tensor, by: float = 2.0) -> torch.Tensor:
        seen.append(torch.is_grad_enabled())
        return weight * x * by

    for outer in (True, False):
        with torch.set_grad_enabled(outer):
            out = scaled(torch.ones(3), by=3.0)
            assert torch.is_grad_enabled() is outer  # the caller's mode, back after the call
        assert not out.requires_grad and torch.equal(out, torch.full((3,), 3.0))
    assert seen == [False, False]
    assert scaled.__name__ == "scaled"  # (wrapped: its name and docstring kept)
