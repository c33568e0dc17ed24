"""heads.grad: no_grad and inference_mode run the call in their mode whatever the caller's, which is restored."""

from __future__ import annotations

import torch

from spechead.heads.grad import inference_mode, no_grad, version


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


def test_inference_mode_runs_in_the_mode_and_restores_the_callers() -> None:
    """inference_mode: the call runs in inference mode (its tensors are inference tensors: no version
    counters, no autograd) whatever the caller's mode, which holds again after the call."""
    weight = torch.ones(3, requires_grad=True)
    seen = []

    @inference_mode
    def scaled(x: torch.Tensor) -> torch.Tensor:
        seen.append((torch.is_inference_mode_enabled(), torch.is_grad_enabled()))
        return weight * x

    for outer in (True, False):
        with torch.set_grad_enabled(outer):
            out = scaled(torch.ones(3))
            assert torch.is_grad_enabled() is outer and not torch.is_inference_mode_enabled()
        assert out.is_inference() and not out.requires_grad and version(out) == -1
    with torch.inference_mode():
        assert scaled(torch.ones(3)).is_inference()
    assert seen == [(True, False)] * 3
    assert scaled.__name__ == "scaled"
    assert version(torch.ones(2).add_(1)) == 1  # a normal tensor's counter
