"""A head's top-k accuracy by depth on the target's own greedy continuations (each family's registered
`accuracy`), and the tables assumed when none was measured (`assumed_accuracy`).

accuracy[d, r] = share of anchors c whose depth-(d + 1) draft's r-th candidate is token c + 2 + d (the
draft continuing 0..c from the root token c + 1). The sequences [T] must be the target's OWN greedy
continuations, so token c + 2 + d is exactly what a depth-(d + 1) node must equal. Only anchors
c >= starts[i] - 1 count (prompt tokens are never references), pooled over all sequences. A family gives
its drafts' logits [A, D, V] for a chunk of anchors; tokens outside a draft vocab are misses.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from functools import partial
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from spechead.heads.dflash import DFlashHead
from spechead.heads.eagle import EagleHead
from spechead.heads.eagle3 import Eagle3Head
from spechead.heads.grad import inference_mode
from spechead.heads.medusa import MedusaHead
from spechead.heads.peagle import PEagleHead
from spechead.heads.unroll import ttt_forward
from spechead.inference.target.runner import TargetRunner

if TYPE_CHECKING:
    from transformers import PreTrainedModel

# logits rows [A * D, V] computed at a time (a DFlash forward's mask is [A * bs, T + A * bs])
LOGIT_ROWS = 4096
# (sequence [T], its target states {layer: [T, H]}) -> (anchors [A] -> the drafts' logits [A, D, V])
Drafts = Callable[[Tensor, dict[int, Tensor]], Callable[[Tensor], Tensor]]
DraftsFor = Callable[[Any, int | None], tuple[int, Drafts]]  # (head, depth asked) -> (D, its drafts)


@inference_mode
def topk_accuracy(
    model: PreTrainedModel,
    head: Any,
    sequences: list[Tensor],
    depth: int | None = None,
    topk: int = 4,
    starts: Sequence[int] | None = None,
    *,
    drafts_for: DraftsFor,
) -> Tensor:
    """accuracy [D, topk] of the drafts `drafts_for(head, depth)` -> (D, drafts) gives per sequence (see the
    module doc), each sequence once through the target's prefill. A family registers it with its own
    `drafts_for` bound (`measure_medusa_accuracy`, ...)."""
    depth, drafts = drafts_for(head, depth)
    if topk < 1 or depth < 1:
        raise ValueError(f"topk and depth must be >= 1, got topk={topk}, depth={depth}")
    starts = [0] * len(sequences) if starts is None else list(starts)
    if len(starts) != len(sequences):
        raise ValueError(f"got {len(starts)} starts for {len(sequences)} sequences")
    device = next(head.parameters()).device
    to_draft = getattr(head, "target_to_draft", lambda ids: ids)  # -1 outside a draft vocab: never a hit
    per_call = max(LOGIT_ROWS // depth, 1)
    hits = torch.zeros(depth, topk, dtype=torch.long)
    counts = torch.zeros(depth, dtype=torch.long)
    runner = TargetRunner(model, tuple(head.config.target_layers))
    for seq, start in zip(sequences, starts):
        seq = seq.reshape(-1).long().cpu()  # [T]
        first, end = max(start - 1, 0), len(seq) - 2  # anchors c in [first, end) have token c + 2
        if end <= first:
            continue
        logits_of = drafts(seq, runner.prefill([seq])[1][0])
        refs = to_draft(seq.to(device)).cpu()  # [T] head-vocab ids
        for lo in range(first, end, per_call):
            anchors = torch.arange(lo, min(lo + per_call, end))  # [A]
            cand = logits_of(anchors).topk(topk, dim=-1).indices.cpu()  # [A, D, topk]
            for d in range(depth):
                n = min(len(anchors), end - d - lo)  # the first n anchors have token c + 2 + d
                if n > 0:
                    hits[d] += (cand[:n, d] == refs[lo + 2 + d : lo + 2 + d + n, None]).sum(0)
                    counts[d] += n
    if int(counts.min()) == 0:
        missing = [d + 1 for d in range(depth) if counts[d] == 0]
        raise ValueError(
            f"sequences too short: depth(s) {missing} have no generated reference token; generate more "
            "tokens (or lower --depth)"
        )
    return hits.double().div(counts[:, None]).float()


def _medusa(head: MedusaHead, depth: int | None) -> tuple[int, Drafts]:
    """Head k at position c guesses token c + 2 + k (`depth` unread: num_heads depths)."""
    layer, dtype = head.config.target_layers[0], next(head.parameters()).dtype

    def drafts(seq: Tensor, hidden: dict[int, Tensor]) -> Callable[[Tensor], Tensor]:
        state = hidden[layer].to(dtype)  # [T, H]
        return lambda a: torch.stack(
            [head.head_logits(k, state[None, a])[0] for k in range(head.num_heads)], 1
        )

    return head.num_heads, drafts


def _eagle(head: EagleHead | Eagle3Head, depth: int | None) -> tuple[int, Drafts]:
    """The head unrolled `depth` steps over all positions at once (ttt_forward: a depth-d node's
    attention when decoding): step j at position c + j continues 0..c and guesses token c + 2 + j."""
    weight, layers, steps = head.fc.weight, head.config.target_layers, int(depth or 0)

    def drafts(seq: Tensor, hidden: dict[int, Tensor]) -> Callable[[Tensor], Tensor]:
        fused = head.features([hidden[layer].to(weight.device, weight.dtype)[None] for layer in layers])
        outputs = ttt_forward(head, fused, seq[None].to(weight.device), None, steps)  # D x [1, T, H]
        out = torch.stack(outputs, 2)[0]  # [T, D, H]
        ahead = torch.arange(steps)  # (positions past T have no token: clamped, never counted)
        return lambda a: head.logits(out[(a[:, None] + ahead).clamp(max=len(seq) - 1), ahead])

    return steps, drafts


def _peagle(head: PEagleHead, depth: int | None) -> tuple[int, Drafts]:
    """Block slot d of anchor c guesses token c + 2 + d, in one forward (`depth` unread: K slots)."""
    weight, layers = head.fc.weight, head.config.target_layers

    def drafts(seq: Tensor, hidden: dict[int, Tensor]) -> Callable[[Tensor], Tensor]:
        fused = head.fuse([hidden[layer].to(weight.device, weight.dtype)[None] for layer in layers])
        return lambda a: head.parallel_logits(fused, seq[None].to(weight.device), a)[0]  # [A, K, Vd]

    return head.block_size, drafts


def _dflash(head: DFlashHead, depth: int | None) -> tuple[int, Drafts]:
    """Block position d + 1 after 0..c (root c + 1) guesses token c + 2 + d, in one forward (`depth`
    unread: block_size - 1 drafts)."""
    device, layers = head.fc.weight.device, head.config.target_layers

    def drafts(seq: Tensor, hidden: dict[int, Tensor]) -> Callable[[Tensor], Tensor]:
        context = head.fuse([hidden[layer].to(device)[None] for layer in layers])  # [1, T, H]
        ids = seq[None].to(device)  # [1, T]
        return lambda a: head.logits(head.predict_blocks(context, ids, a[None].to(device))[0][:, 1:])

    return head.config.block_size - 1, drafts


measure_medusa_accuracy = partial(topk_accuracy, drafts_for=_medusa)
measure_eagle_accuracy = partial(topk_accuracy, drafts_for=_eagle)
measure_peagle_accuracy = partial(topk_accuracy, drafts_for=_peagle)
measure_dflash_accuracy = partial(topk_accuracy, drafts_for=_dflash)


def _typical(ranks: list[float], decay: float, depth_of: Callable[[Any], int]) -> Callable[[Any], Tensor]:
    """A family's `assumed_accuracy`: head -> a typical trained head's table [D, len(ranks)], `ranks` at
    depth 1 times `decay` a depth (D = depth_of(head)), for a head without HEAD/tree.json."""
    first = torch.tensor(ranks, dtype=torch.float64)
    return lambda head: torch.stack([first * decay**d for d in range(depth_of(head))])


assumed_medusa_accuracy = _typical([0.60, 0.10, 0.05, 0.03], 0.75, lambda head: head.num_heads)
# any EAGLE head, 7 deep: sizes its tree on a CPU (an EAGLE-2 60-node tree costs several decode steps there)
assumed_eagle_accuracy = _typical([0.70, 0.08, 0.03, 0.02], 0.97, lambda head: 7)
# parallel slots lose more per depth than EAGLE's steps
assumed_peagle_accuracy = _typical([0.70, 0.08, 0.03, 0.02], 0.85, lambda head: head.block_size)
assumed_dflash_accuracy = _typical([0.80, 0.06, 0.02, 0.01], 0.93, lambda head: head.config.block_size - 1)
