"""Shared by the sampling (losslessness) tests: the target's exact distribution over short continuations
and the total variation of a generator's sampled continuations from it."""

from __future__ import annotations

import torch

from spechead.inference.generator import SpeculativeGenerator
from spechead.inference.sampling import SamplingParams, target_probs


def exact_distribution(
    model, prompt: list[int], params: SamplingParams, length: int = 2
) -> dict[tuple[int, ...], float]:
    """P(x1..x_length | prompt) under the target with the sampling transform, computed exactly."""
    dist = {(): 1.0}
    with torch.no_grad():
        for _ in range(length):
            grown = {}
            for prefix, prob in dist.items():
                p = target_probs(model(torch.tensor([prompt + list(prefix)])).logits[0, -1], params)
                for x in p.nonzero().flatten().tolist():
                    grown[(*prefix, x)] = prob * float(p[x])
            dist = grown
    return dist


def sampling_tv(
    gen: SpeculativeGenerator, prompt: list[int], params: SamplingParams, trials: int, length: int = 2
) -> float:
    """TV between the first `length` sampled tokens (seeds 0..trials-1) and the target's exact law."""
    exact = exact_distribution(gen.target, prompt, params, length)
    counts: dict[tuple[int, ...], int] = {}
    for seed in range(trials):
        out = gen.generate(
            input_ids=prompt, max_new_tokens=length, temperature=params.temperature, top_k=params.top_k,
            top_p=params.top_p, seed=seed,
        )  # fmt: skip
        counts[tuple(out.token_ids)] = counts.get(tuple(out.token_ids), 0) + 1
    assert set(counts) <= set(exact), "sampled a sequence the target cannot produce"
    return 0.5 * sum(abs(counts.get(k, 0) / trials - exact.get(k, 0.0)) for k in set(exact) | set(counts))
