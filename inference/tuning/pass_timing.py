"""Decode with a few candidate trees to pick the one this device is fastest with.

calibrate.py's part-by-part timing ranks trees well but misjudges a whole pass (its parts evict each
other from the caches; the engine's work between them is untimed), so its best few are decoded here.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from spechead.inference.drafters.base import Drafter
from spechead.inference.drafters.per_row import RowDrafter
from spechead.inference.generator import SpeculativeGenerator
from spechead.inference.tuning.calibrate import EAGER, TimedAs
from spechead.inference.tuning.tree_search import covers, expected_accept_length

if TYPE_CHECKING:
    from transformers import PreTrainedModel

Choices = list[list[int]]
# A tree tuned with the head stays unless another is expected this much faster: near-ties trade places with
# this stage's noise (a wider margin keeps trees that decode slower).
IN_SITU_KEEP_MARGIN = 0.02


def pass_ms_by_drafter(
    target: PreTrainedModel,
    drafters: list[Drafter | RowDrafter | None],
    prompt: torch.Tensor,
    new_tokens: int = 32,
    rounds: int = 3,
    batch: int = 1,
    timed_as: TimedAs = EAGER,
) -> list[float]:
    """ms per decoding pass of each drafter (None: plain), `batch` greedy rows of `prompt` [T] through
    generate_batch with no stop before `new_tokens`: the minimum over `rounds` round-robin runs (one-time
    work, a compiled part's capture included, and noise only add); the target and the drafters (in place)
    compiled as `timed_as` says."""
    gen = SpeculativeGenerator(target, None, compile=timed_as.target, draft_compile=False)
    gen.eos = set()  # a fixed number of tokens for every drafter
    if timed_as.draft:
        for drafter in drafters:
            if drafter is not None:
                drafter.use_compile(timed_as.draft)
    times: list[list[float]] = [[] for _ in drafters]
    for _ in range(rounds):
        for i, drafter in enumerate(drafters):
            gen.drafter = drafter  # (the same engine at every batch size; compiled runners kept by gen)
            rows = [prompt] * batch  # (the batch's times: every row decodes the same prompt alike)
            out = gen.generate_batch(input_ids=rows, max_new_tokens=new_tokens, tree_for_batch=False)
            done = out[0].stats
            times[i].append(1e3 * (done.wall_time - done.prefill_time) / max(done.target_passes, 1))
    return [min(t) for t in times]


def self_written_prompt(target: PreTrainedModel, length: int = 64, seed: int = 0) -> torch.Tensor:
    """A prompt [length] the target wrote itself (greedy after a few random tokens): realistic accepts."""
    vocab = target.get_output_embeddings().weight.shape[0]
    start = torch.randint(0, vocab, (min(8, length),), generator=torch.Generator().manual_seed(seed))
    if length <= start.numel():
        return start
    gen = SpeculativeGenerator(target, None)
    gen.eos = set()
    written = gen.generate(input_ids=start, max_new_tokens=length - start.numel()).token_ids
    return torch.cat([start, torch.tensor(written, dtype=torch.long)])


def decoded_choice(
    target: PreTrainedModel,
    drafter: Drafter | RowDrafter,
    accuracy: torch.Tensor,
    costs: dict,
    keep: Choices | None = None,
    keep_margin: float = IN_SITU_KEEP_MARGIN,
    new_tokens: int = 32,
    batch: int = 1,
    timed_as: TimedAs = EAGER,
) -> tuple[Choices, dict]:
    """Of `costs["ranked"]` (popped: calibrate.py) and `keep` (a tree tuned for this kind of device), the
    tree with the best expected speedup (expected accept length x plain pass / its pass) when decoding
    `batch` rows here, or `keep` unless another is expected more than `keep_margin` faster. Returns it and
    `costs` with model_speedup (the costs' own best), in_situ (what was decoded and measured),
    expected_speedup (the chosen tree's, decoded) and, with `keep`, kept_saved_tree."""
    candidates = [c for c in costs.pop("ranked") if c != keep]
    if keep is not None and covers(accuracy, keep):
        candidates.insert(0, keep)
    if not candidates:
        raise ValueError("decoded_choice needs at least one candidate tree")
    # prompt + new tokens within the target's context (a short-context target gets a shorter run)
    context = getattr(target.config.get_text_config(), "max_position_embeddings", None) or 1 << 30
    length = min(64, context // 2)
    prompt, new_tokens = self_written_prompt(target, length), max(1, min(new_tokens, context - length))
    drafters: list[Drafter | RowDrafter | None] = [None, *(drafter.with_tree(c) for c in candidates)]
    plain, *passes = pass_ms_by_drafter(target, drafters, prompt, new_tokens, batch=batch, timed_as=timed_as)
    speedups = [float(expected_accept_length(accuracy, c)) * plain / ms for c, ms in zip(candidates, passes)]
    best = max(range(len(speedups)), key=lambda i: speedups[i])  # (ties: the earlier candidate)
    info: dict = {
        "candidates": candidates,
        "plain_pass_ms": plain,
        "pass_ms": passes,
        "expected_speedups": speedups,
    }
    if keep in candidates:  # (then candidates[0])
        kept = speedups[0] * (1 + keep_margin) >= speedups[best]
        info["kept_saved_tree"] = costs["kept_saved_tree"] = kept
        best = 0 if kept else best
    info["expected_speedup"] = speedups[best]
    costs.update(model_speedup=costs["expected_speedup"], in_situ=info, expected_speedup=speedups[best])
    return candidates[best], costs
