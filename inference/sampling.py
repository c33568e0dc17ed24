"""Sampling parameters and the target distribution they define.

`target_probs` is THE distribution that lossless speculative sampling reproduces: plain sampling and
tree verification must both use it (temperature, then top-k, then top-p, renormalised, fp32).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

_NUMPY_FLOATS = (torch.float32, torch.float64, torch.float16)  # (numpy has no bfloat16)
NUCLEUS_GUESSES = (64, 1024)  # the top-k sizes `nucleus` reads before it sorts a whole row


@dataclass
class SamplingParams:
    """temperature 0 = greedy; top_k 0 = off; top_p 1.0 = off; seed None = nondeterministic."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None

    def __post_init__(self) -> None:
        if not self.temperature >= 0:  # also rejects NaN
            raise ValueError(f"temperature must be >= 0 (0 = greedy), got {self.temperature}")
        if not isinstance(self.top_k, int) or isinstance(self.top_k, bool) or self.top_k < 0:
            raise ValueError(f"top_k must be an int >= 0 (0 = off), got {self.top_k!r}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")

    @property
    def is_greedy(self) -> bool:
        """True when temperature == 0 (argmax decoding)."""
        return self.temperature == 0.0


def make_generator(seed: int | None, device: torch.device | str = "cpu") -> torch.Generator | None:
    """A torch.Generator on `device` seeded with `seed`, or None when seed is None."""
    return None if seed is None else torch.Generator(device=device).manual_seed(seed)


def target_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Target distribution probs [..., V] (fp32) from logits [..., V]: greedy, one-hot at the argmax (ties:
    lowest id), so the sampling rules reduce to greedy verification; else logits / temperature, top-k
    (ties at the k-th kept), top-p (`nucleus`), renormalised. On a CPU through numpy (`host_probs`)."""
    if logits.is_cpu and not logits.requires_grad and not params.is_greedy:  # (bf16 too, as fp32)
        return torch.from_numpy(host_probs(logits.float().numpy(), params))
    return torch_probs(logits, params)


def torch_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """`target_probs` [..., V] in torch ops, on any device (a GPU's path; all rows at once)."""
    x = logits.float()
    if params.is_greedy:
        return torch.zeros_like(x).scatter_(-1, x.argmax(-1, keepdim=True), 1.0)
    x = x / params.temperature
    if 0 < params.top_k < x.shape[-1]:
        kth = torch.topk(x, params.top_k, dim=-1).values[..., -1:]  # [..., 1]
        x = x.masked_fill(x < kth, float("-inf"))
    probs = torch.softmax(x, dim=-1)
    if params.top_p < 1.0:
        probs = probs * nucleus(probs, params.top_p)
        probs = probs / probs.sum(-1, keepdim=True)
    return probs


def host_probs(logits: np.ndarray, params: SamplingParams) -> np.ndarray:
    """`target_probs` of logits [..., V] (fp32, temperature > 0) through numpy, row by row: on a CPU its
    calls cost a fraction of torch's."""
    out = np.empty_like(logits)  # [..., V]
    if logits.ndim == 1:  # (an acceptance walk's row: no views to make)
        return _host_row(logits, params, out)
    vocab = logits.shape[-1]
    for x, row in zip(logits.reshape(-1, vocab), out.reshape(-1, vocab)):  # [V] each (row: a view of out)
        _host_row(x, params, row)
    return out


def _host_row(x: np.ndarray, params: SamplingParams, out: np.ndarray) -> np.ndarray:
    """One row of `host_probs`: logits x [V] -> probs written into out [V]."""
    vocab = x.shape[0]
    if params.temperature != 1.0:  # (x / 1 is x: no pass over the row)
        x = x / np.float32(params.temperature)
    if 0 < params.top_k < vocab:  # ties at the k-th value are kept
        x = np.where(x < np.partition(x, vocab - params.top_k)[vocab - params.top_k], -np.inf, x)
    e = np.exp(x - x.max())  # [V]
    probs = np.divide(e, e.sum(), out=out)
    if params.top_p < 1.0:
        top = probs.argmax()  # (first of tied maxima: the id a stable sort puts first)
        if probs[top] >= params.top_p:  # a peaked row: the nucleus is the argmax alone, and
            probs.fill(0.0)  # renormalised it is exactly 1 (what the general path gives)
            probs[top] = 1.0
        else:
            probs *= host_nucleus(probs, params.top_p)
            probs /= probs.sum()
    return probs


def host_nucleus(probs: np.ndarray, top_p: float) -> np.ndarray:
    """`nucleus`'s keep mask [V] for ONE row probs [V] through numpy, the same guesses made by partitions."""
    vocab = probs.shape[0]
    for k in (*(k for k in NUCLEUS_GUESSES if k < vocab), vocab):
        part = np.partition(probs, vocab - k)[vocab - k :] if k < vocab else probs
        top = np.sort(part)[::-1]  # [k] descending
        mass = np.cumsum(top, dtype=np.float64).astype(np.float32)  # [k] (torch sums in fp64 too)
        kept = max(int(np.count_nonzero(mass - top < top_p)), 1)  # mass before < top_p
        if kept < k or k == vocab:
            break
    edge = top[kept - 1]  # the least kept probability
    keep = probs >= edge  # [V]
    if np.count_nonzero(keep) == kept:  # no tie at the edge left partly out
        return keep
    above = probs > edge  # [V]: all kept, then the lowest ids of the tie
    above[np.flatnonzero(probs == edge)[: kept - np.count_nonzero(above)]] = True
    return above


class TargetRows:
    """`target_probs(logits, params)` [N, V], each row [V] computed when read: a walk reads about tau of
    a tree's N rows, and a row's top-p costs a top-k or a sort over the vocabulary."""

    def __init__(self, logits: torch.Tensor, params: SamplingParams) -> None:
        self.logits, self.params = logits, params  # [N, V]

    @property
    def shape(self) -> torch.Size:
        return self.logits.shape

    @property
    def device(self) -> torch.device:
        return self.logits.device

    def __getitem__(self, node: int) -> torch.Tensor:
        return target_probs(self.logits[node], self.params)  # [V] fp32


def nucleus(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """Top-p's keep mask [..., V] for probs [..., V]: the smallest set of most likely tokens whose mass
    >= top_p (at least the argmax; ties at the edge: lowest ids first, as a stable sort orders them).
    It reads the largest few values (top-k) and sorts a whole row (many times a top-k's cost) only when
    a nucleus may not fit in them; each guess is read to the host once (on a GPU: one wait)."""
    vocab = probs.shape[-1]
    for k in (*(k for k in NUCLEUS_GUESSES if k < vocab), vocab):
        if k < vocab:
            top = torch.topk(probs, k, dim=-1).values  # [..., k] descending
        else:
            top = torch.sort(probs, dim=-1, descending=True).values  # [..., V]
        mass_before = torch.cumsum(top, dim=-1) - top  # [..., k]
        kept = (mass_before < top_p).sum(-1, keepdim=True).clamp(min=1)  # [..., 1] tokens kept
        edge = top.gather(-1, kept - 1)  # [..., 1] the least kept probability
        keep = probs >= edge  # [..., V]
        # every row's nucleus ends inside its top k; no tie at the edge left partly out (one read)
        fits, whole = torch.stack([(kept < k).all(), (keep.sum(-1, keepdim=True) == kept).all()]).tolist()
        if k == vocab or fits:
            break
    if whole:  # (two passes over the vocabulary, not six: they cost at V = 128256)
        return keep
    above = probs > edge  # [..., V]: all kept
    ties = probs == edge  # [..., V]: the first `kept - above` of them kept
    return above | (ties & (torch.cumsum(ties, dim=-1) <= kept - above.sum(-1, keepdim=True)))


def sample(probs: torch.Tensor, generator: torch.Generator | None = None) -> int:
    """Draw one token id from probs [V] (need not be normalised; generator on probs' device) by
    `inverse_cdf` (on a CPU a fraction of torch.multinomial's cost). ValueError: no positive finite mass."""
    drawn = int(inverse_cdf(probs, generator))
    if drawn >= len(probs):
        raise ValueError(
            f"cannot sample from probs without a positive finite mass (total {float(probs.sum())})"
        )
    return drawn


def inverse_cdf(weights: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """One draw from each row of weights [..., V] (>= 0, need not be normalised) as ids [..., 1]: the first
    id whose cumulative mass exceeds u * total, u ~ U[0, 1) (fp64 sums: an id of zero mass is never drawn);
    V for a row without a positive finite mass."""
    cdf = torch.cumsum(weights, dim=-1, dtype=torch.float64)  # [..., V]
    u = torch.rand((*weights.shape[:-1], 1), dtype=torch.float64, device=weights.device, generator=generator)
    return torch.searchsorted(cdf, u.mul_(cdf[..., -1:]), right=True)  # [..., 1]


def argmax_ids(logits: torch.Tensor) -> Any:
    """The argmax over the last dim of logits [..., V] as a host int or (nested) list of ints (first max on
    ties; a NaN counts as the max, as in torch), on a CPU through numpy (a fraction of torch's cost)."""
    if logits.is_cpu and logits.dtype in _NUMPY_FLOATS and not logits.requires_grad:  # (no device object)
        return logits.numpy().argmax(-1).tolist()
    return logits.argmax(-1).tolist()


def pick(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None) -> int:
    """The target's own next token from logits [V]: the argmax (greedy), else a sample of target_probs."""
    if params.is_greedy:
        return int(argmax_ids(logits))
    return sample(target_probs(logits, params), generator)
