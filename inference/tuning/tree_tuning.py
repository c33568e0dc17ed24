"""Tune a head's static tree (HEAD/tree.json: what loading calibrates from) for this device on prompts of
the kind it will serve. Measured, nothing assumed: the target answers every prompt greedily; the head's
top-k accuracy is measured on those answers; trees are ranked by the costs timed here and the best few
decoded, as loading does; the chosen one's real tau scales the table (`fit_accuracy`) and the trees are
ranked again. Used by scripts/build_tree.py and at the end of a training run.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from transformers import PreTrainedModel

from spechead.heads import DraftHead
from spechead.heads.families import family_of
from spechead.inference.draft_weights import as_drafted
from spechead.inference.drafter_specs import drafter_for_head
from spechead.inference.evaluation.measure import Prompt, PromptSetRun, greedy_answers
from spechead.inference.tuning.calibrate import best_for_costs, calibrated_choices, fit_accuracy
from spechead.inference.tuning.pass_timing import decoded_choice
from spechead.inference.tuning.tree_search import expected_accept_length


def measure_accuracy(target: PreTrainedModel, head: DraftHead, answers: PromptSetRun, depth: int, topk: int):
    """The head's top-k accuracy [depth, topk] on the target's answers (Medusa: num_heads depths)."""
    measure = family_of(head.config).load("accuracy")
    sequences = [torch.tensor([*p, *o]) for p, o in zip(answers.prompt_ids, answers.outputs, strict=True)]
    starts = [len(p) for p in answers.prompt_ids]  # (each turn's first answer token in its sequence [T])
    return measure(target, head, sequences, depth=depth, topk=topk, starts=starts)


@torch.inference_mode()
def tune_tree(
    target: PreTrainedModel,
    tokenizer,
    head: DraftHead,
    prompts: Sequence[Prompt],
    *,
    max_new_tokens: int = 96,
    depth: int = 6,
    topk: int = 8,
    max_nodes: int = 64,
) -> dict:
    """tree.json fields for `head` (target modules attached): the tree with the best expected speedup on
    the target's device for the accuracy [depth, topk] measured on `prompts`, the costs and its tau."""
    was_training = head.training
    head.eval()
    # costs and decoding with the head as loading will draft with it (on a CPU a Medusa head in int8)
    trained, head = head, as_drafted(head, next(target.parameters()).device)
    try:
        answers = greedy_answers(target, tokenizer, None, prompts, max_new_tokens)
        accuracy = measure_accuracy(target, trained, answers, depth, topk)  # [depth, topk] (as trained)
        drafter = drafter_for_head(head)
        _, costs = calibrated_choices(target, drafter, accuracy.double(), max_nodes)
        choices, costs = decoded_choice(target, drafter, accuracy.double(), costs)
        tuned = greedy_answers(target, tokenizer, drafter.with_tree(choices), prompts, max_new_tokens)
        # the raw table over-promises deep trees: choose again from the table scaled to the real tau
        fitted = fit_accuracy(accuracy.double(), choices, tuned.total.tau)
        best_for_costs(fitted, costs, max_nodes)  # costs["ranked"] again, for the fitted table
        refined, costs = decoded_choice(target, drafter, fitted, costs, keep=choices)
        if refined != choices:
            tuned = greedy_answers(target, tokenizer, drafter.with_tree(refined), prompts, max_new_tokens)
            choices = refined
    finally:
        trained.train(was_training)
    return {
        "choices": choices,
        "expected_accept_length": float(expected_accept_length(accuracy, choices)),
        "measured_tau": round(tuned.total.tau, 4),
        "expected_speedup": round(float(costs["expected_speedup"]), 4),  # decoded here (pass_timing.py)
        "family": head.config.family,
        "device": str(next(target.parameters()).device),
        "costs_ms": {
            k: costs[k] for k in ("step_ms", "pass_ms", "draft_ms", "draft_ms_per_depth") if k in costs
        },
        "measured_on": {
            "prompts": len(prompts),
            "turns": len(answers.outputs),
            "max_new_tokens": max_new_tokens,
            "generated_tokens": answers.total.new_tokens,
            "topk": topk,
        },
        "accuracy": [[round(x, 6) for x in row] for row in accuracy.tolist()],
    }
