"""Grad modes for calls made on every pass: `no_grad` (a head's step), `inference_mode` (decoding's entry points).

Entering `torch.no_grad()` as a decorator costs about eight Python calls (the context is cloned, built,
entered and left: ~1.7 us a call on a 2-core CPU, against ~0.2 us for this one when gradients are off).
A decoding pass made about ten such calls (each head step, propose, accept, the target's verify), always
inside a loop that already runs without gradients; this decorator checks the grad mode (one C call) and
enters the context only when gradients are on.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import ParamSpec, TypeVar

import torch

P = ParamSpec("P")
R = TypeVar("R")


def no_grad(fn: Callable[P, R]) -> Callable[P, R]:
    """fn run under torch.no_grad() (directly when grad mode is already off). Not for generators:
    their body runs later, outside this check (torch.no_grad() handles those)."""

    @functools.wraps(fn)
    def call(*args: P.args, **kwargs: P.kwargs) -> R:
        if not torch.is_grad_enabled():
            return fn(*args, **kwargs)
        with torch.no_grad():
            return fn(*args, **kwargs)

    return call


def inference_mode(fn: Callable[P, R]) -> Callable[P, R]:
    """fn run under torch.inference_mode() (directly when it is already on): no autograd bookkeeping and
    no version counters on any op, ~10% of a decoding pass on a 2-core CPU. For decoding's entry points
    only: tensors made in the mode cannot be updated in place outside it, nor saved for backward."""

    @functools.wraps(fn)
    def call(*args: P.args, **kwargs: P.kwargs) -> R:
        if torch.is_inference_mode_enabled():
            return fn(*args, **kwargs)
        with torch.inference_mode():
            return fn(*args, **kwargs)

    return call


def version(t: torch.Tensor) -> int:
    """t's in-place version counter, -1 for an inference tensor (made in inference mode: it has none)."""
    return -1 if t.is_inference() else t._version
