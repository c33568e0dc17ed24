"""Decode a prompt set and measure it: tau, acceptance by depth, tokens/s, time split (DEFINITIONS).
scripts/benchmark.py and the trainer's decode evaluation share it, so both compute the same numbers.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Protocol

import torch
from tqdm.auto import tqdm
from transformers import PreTrainedModel

from spechead.heads import DraftHead
from spechead.inference.draft_weights import as_drafted
from spechead.inference.drafter_specs import drafter_for_head
from spechead.inference.evaluation.report import plot_acceptance_by_depth, plot_speedup_by_category
from spechead.inference.generator import SpeculativeGenerator
from spechead.inference.loading import calibrated_drafter
from spechead.inference.stats import TAU, GenerationStats


class Prompt(Protocol):
    """An evaluation prompt (e.g. spechead.data.prompt_sets.EvalPrompt): a category and user turns."""

    category: str
    turns: list[str]


@dataclass(frozen=True)
class DecodeSettings:
    """How every prompt is decoded. temperature 0 = greedy; sampling seeds are `seed + turn index`."""

    max_new_tokens: int = 96
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int = 0
    fit_context: bool = False  # answers end at the target's context length (see answer_room)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


@dataclass
class Tally(GenerationStats):
    """GenerationStats summed over generate() calls; `wall` and tokens/s leave the prefill out."""

    def add(self, stats: GenerationStats) -> None:
        for f in fields(GenerationStats):  # (numbers add, accept lengths concatenate)
            setattr(self, f.name, getattr(self, f.name) + getattr(stats, f.name))

    @property
    def wall(self) -> float:
        return self.wall_time - self.prefill_time

    @property
    def tokens_per_s(self) -> float:
        return self.new_tokens / max(self.wall, 1e-9)

    @property
    def draft_ms_per_pass(self) -> float:
        return 1e3 * self.draft_time / max(self.target_passes, 1)


@dataclass
class PromptSetRun:
    """One pass over a prompt set: totals, per-category totals, per turn its generated and prompt ids."""

    total: Tally
    by_category: dict[str, Tally]
    outputs: list[list[int]]
    prompt_ids: list[list[int]] = field(default_factory=list)


def decode_prompts(
    gen: SpeculativeGenerator,
    prompts: Sequence[Prompt],
    settings: DecodeSettings,
    desc: str | None = None,
) -> PromptSetRun:
    """Decode every prompt turn by turn, answers fed back (no chat template: each turn alone); with `desc`,
    a progress bar on a terminal."""
    chat = bool(getattr(gen.tokenizer, "chat_template", None))
    total, prompt_ids = Tally(), []
    outputs: list[list[int]] = []  # (its length: the turns decoded so far)
    by_category: dict[str, Tally] = {}
    for prompt in tqdm(prompts, desc=desc, unit="prompt", leave=False, disable=None if desc else True):
        messages: list[dict[str, str]] = []
        for turn in prompt.turns:
            messages.append({"role": "user", "content": turn})
            ids = gen.prompt_ids(messages, "chat") if chat else gen.prompt_ids(turn)  # [T]
            room = answer_room(gen, len(ids), settings.max_new_tokens) if settings.fit_context else None
            if room == 0:  # the conversation fills the context: its later turns are not decoded
                break
            r = gen.generate(
                input_ids=ids,
                max_new_tokens=settings.max_new_tokens if room is None else room,
                temperature=settings.temperature,
                top_p=settings.top_p,
                top_k=settings.top_k,
                seed=settings.seed + len(outputs),  # (one per turn decoded so far)
            )
            messages.append({"role": "assistant", "content": r.text})
            outputs.append(r.token_ids)
            prompt_ids.append(ids.tolist())
            total.add(r.stats)
            by_category.setdefault(prompt.category, Tally()).add(r.stats)
    return PromptSetRun(total, by_category, outputs, prompt_ids)


def greedy_answers(
    target, tokenizer, drafter, prompts: Sequence[Prompt], max_new_tokens: int
) -> PromptSetRun:
    """Greedy answers to every turn with `drafter` (None: plain), each ending at the target's context."""
    settings = DecodeSettings(max_new_tokens=max_new_tokens, fit_context=True)
    return decode_prompts(SpeculativeGenerator(target, tokenizer, drafter), prompts, settings)


def answer_room(gen: SpeculativeGenerator, prompt_len: int, max_new_tokens: int) -> int:
    """New tokens a turn may take: max_new_tokens, or fewer where the target's context ends (0: it is full),
    the same for plain and drafted decoding (a fair comparison)."""
    context = gen.context
    return max_new_tokens if not context else max(min(max_new_tokens, context - prompt_len), 0)


def acceptance_by_depth(lengths: Sequence[int], depth: int) -> list[float]:
    """P(at least d drafted tokens accepted in a pass), d = 1..depth, from per-pass accept lengths."""
    n = max(len(lengths), 1)
    return [sum(length - 1 >= d for length in lengths) / n for d in range(1, depth + 1)]


def mismatches(outputs: Sequence[list[int]], reference: Sequence[list[int]]) -> int:
    """How many turns' outputs differ from the reference outputs (greedy must match exactly)."""
    return sum(a != b for a, b in zip(outputs, reference, strict=True))


def summarize(runs: Sequence[PromptSetRun], plains: Sequence[PromptSetRun], settings: DecodeSettings) -> dict:
    """Every number for one method against plain runs of the same prompts: speedups per repeat (run i
    against plain run i) as median [min, max], the rest from the last run; only greedy outputs are
    compared with plain decoding's (the tests check sampled ones for losslessness)."""
    res, base = runs[-1].total, plains[-1].total
    speedups = [r.total.tokens_per_s / p.total.tokens_per_s for r, p in zip(runs, plains, strict=True)]
    passes, lengths = max(res.target_passes, 1), res.accept_lengths
    t_step = base.verify_time / max(base.target_passes, 1)
    t_verify, t_draft = res.verify_time / passes, res.draft_time / passes
    return {
        "tau": res.tau,
        "tau_distribution": {str(k): lengths.count(k) for k in sorted(set(lengths))},
        "acceptance_by_depth": acceptance_by_depth(lengths, max(lengths, default=1) - 1),
        "passes_per_token": res.target_passes / max(res.new_tokens, 1),
        "new_tokens": res.new_tokens,
        "tokens_per_s": res.tokens_per_s,
        "speedup": statistics.median(speedups),
        "speedup_min": min(speedups),
        "speedup_max": max(speedups),
        "speedups": speedups,
        "t_step_ms": 1e3 * t_step,
        "t_verify_ms": 1e3 * t_verify,
        "t_draft_ms": 1e3 * t_draft,
        "t_other_ms": 1e3 * max(res.wall / passes - t_verify - t_draft, 0.0),
        "ideal_speedup": res.tau * t_step / max(t_verify + t_draft, 1e-12),
        "greedy_mismatches": mismatches(runs[-1].outputs, plains[-1].outputs) if settings.greedy else None,
        "tau_by_category": {c: t.tau for c, t in runs[-1].by_category.items()},
        "speedup_by_category": {
            c: t.tokens_per_s / plains[-1].by_category[c].tokens_per_s
            for c, t in runs[-1].by_category.items()
        },
    }


DEFINITIONS = {
    "tau": TAU,
    "tau_by_category": "tau pooled over the passes of each category's prompts",
    "tau_distribution": "number of target passes that emitted k tokens, by k",
    "acceptance_by_depth": "P(at least d drafted tokens accepted in a pass), d = 1, 2, ...",
    "passes_per_token": "target passes per emitted token (pooled, 1 / tau up to the prefill token)",
    "speedup": "tokens/s over plain decoding of the same prompts, median of the repeats",
}


@torch.inference_mode()
def decode_eval_hook(
    target: PreTrainedModel, tokenizer, head: DraftHead, prompts: Sequence[Prompt], max_new_tokens: int,
    plot_dir: Path | None, tree: dict | None = None,
) -> tuple[dict[str, float], dict[str, Path]]:  # fmt: skip
    """The trainer's DecodeEval (training/decode_eval.py): (metrics, plots) from one plain and one greedy
    drafted pass over `prompts` with the head in training (target modules attached, mode restored), answers
    ending at the target's context, the head drafting as loading would here (`tree`: tree.json fields or
    None, the family's table); tree_nodes 0: the family's default tree."""
    was_training = head.training
    head.eval()
    try:
        drafting = as_drafted(head, next(target.parameters()).device)
        drafter, calibration, _ = calibrated_drafter(target, drafter_for_head(drafting), tree)
        drafted, plain = (
            greedy_answers(target, tokenizer, d, prompts, max_new_tokens) for d in (drafter, None)
        )
        row = summarize([drafted], [plain], DecodeSettings())  # (greedy: outputs compared)
    finally:
        head.train(was_training)
    metrics = {k: float(row[k]) for k in ("tau", "speedup", "tokens_per_s", "passes_per_token")}
    metrics["tree_nodes"] = float(len(calibration["choices"]) if calibration else 0)
    for d, a in enumerate(row["acceptance_by_depth"][:8], start=1):
        metrics[f"acceptance_depth_{d}"] = a
    metrics["greedy_mismatches"] = float(row["greedy_mismatches"])  # (greedy: always compared)
    plots = {}
    if plot_dir is not None:
        row["drafter"] = head.config.family
        plots["acceptance_by_depth"] = plot_acceptance_by_depth([row], plot_dir / "acceptance_by_depth.png")
        plots["speedup_by_category"] = plot_speedup_by_category([row], plot_dir / "speedup_by_category.png")
    return metrics, plots
