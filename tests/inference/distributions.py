"""Shared by the sampling (losslessness) tests: the target's exact distribution over short continuations
and the total variation of a generator's sampled continuations from it."""

from __future__ import annotations

from collections import Counter

import torch

from spechead.inference.generator import SpeculativeGenerator
from spechead.inference.sampling import SamplingParams, target_probs

ROWS = 100  # seeds decoded at once (generate_batch rows)
ALONE = 100  # seeds also decoded alone, each checked equal to its batch row


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
    gen: SpeculativeGenerator,
    prompt: list[int],
    params: SamplingParams,
    trials: int,
    length: int = 2,
    rows: int = ROWS,
) -> float:
    """TV between the first `length` sampled tokens (seeds 0..trials-1) and the target's exact law.

    The seeds decode as rows of generate_batch, `rows` at a time (row b draws what generate(seed=b) draws:
    the one engine, each row its own generator): the target's passes (and a Drafter's) serve every
    row at once, several times faster than one generate per seed. The first ALONE seeds also decode alone
    (batch 1): each must equal its row, so a rule broken at batch 1 only still fails here. rows=1: one
    generate per seed (a drafter whose rule holds for a batch of one only)."""
    exact = exact_distribution(gen.target, prompt, params, length)
    kw = {"max_new_tokens": length, "temperature": params.temperature, "top_k": params.top_k,
          "top_p": params.top_p}  # fmt: skip
    sampled: list[tuple[int, ...]] = []
    for start in range(0, trials, rows):
        seeds = list(range(start, min(trials, start + rows)))
        if rows == 1:
            out = [gen.generate(input_ids=prompt, seed=seeds[0], **kw)]
        else:
            out = gen.generate_batch(input_ids=[prompt] * len(seeds), seed=seeds, tree_for_batch=False, **kw)
        sampled += [tuple(r.token_ids) for r in out]
    for seed in range(min(ALONE, trials) if rows > 1 else 0):
        alone = tuple(gen.generate(input_ids=prompt, seed=seed, **kw).token_ids)
        assert alone == sampled[seed], f"seed {seed}: batch 1 drew {alone}, its batch row {sampled[seed]}"
    counts = Counter(sampled)
    assert set(counts) <= set(exact), "sampled a sequence the target cannot produce"
    return 0.5 * sum(abs(counts.get(k, 0) / trials - exact.get(k, 0.0)) for k in set(exact) | set(counts))
