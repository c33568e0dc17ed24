"""EAGLE tree growth for an eager batch of one: the head steps, top-k and id mapping a draft is grown from.

`EagleGrowth` is the half of `EagleDrafter` (drafter.py) that grows a batch of one's tree on the head's
device: one head call per depth over the nodes a depth expands (`_step`, masked over the head cache's C
committed entries and the ancestors' speculative slots), the k best children of each (`_top`,
`_top_ids`), head ids mapped to target ids (`_to_target`: EAGLE-3's reduced draft vocab, shared with the
B-row growth of rows.py), and the trees built from them: dynamic (EAGLE-2, dynamic_tree.py) or static,
into kept buffers (static_eager.py). The drafter owns the state (its `__init__` sets every attribute
declared here); tuning/calibrate.py times these steps on the drafter.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from spechead.heads.eagle import EagleHead
from spechead.heads.eagle3 import Eagle3Head
from spechead.inference.drafters.eagle.dynamic_tree import grow_dynamic
from spechead.inference.drafters.eagle.head_masks import HeadMasks
from spechead.inference.drafters.eagle.sampled_children import SampledChildren
from spechead.inference.drafters.eagle.static_eager import (
    StaticOutputs,
    build_static_outputs,
    grow_static_eager,
)
from spechead.inference.drafters.eagle.static_plan import StaticPlan, build_static_plan
from spechead.inference.drafters.topk import Chunk, resolve_chunk, topk_rows
from spechead.inference.positions import PositionIds
from spechead.inference.target.cache import RowCache
from spechead.inference.tree import StaticTree


class EagleGrowth:
    """Tree growth on the head's device, no host round trip inside the depth loop (see the module doc).

    A base of `EagleDrafter` only: the attributes below are the drafter's, set by its `__init__`."""

    head: EagleHead | Eagle3Head
    head_step: Callable[..., Tensor]  # (hidden [1, q, H], ids [1, q], mask, positions, cache) -> [1, q, H]
    head_logits: Callable[[Tensor], Tensor]  # [1, q, H] -> [1, q, Vd]
    topk_chunk: Chunk
    top_k: int
    depth: int
    total_tokens: int
    _weight: Tensor  # the head's device and dtype
    _vocab: int  # Vd
    _static: StaticTree | None
    _cache: RowCache | None
    _committed: int  # C
    _plan: StaticPlan | None
    _outputs: StaticOutputs | None
    _feature: Tensor | None  # [1, H]
    _d2t: Tensor | None  # [Vd]
    _values: list[tuple[Tensor, Tensor]] | None
    _masks: HeadMasks
    _positions: PositionIds

    def _to_target(self, ids: Tensor) -> Tensor:
        """Head-vocab ids (any shape) -> target ids (EAGLE-3 maps its draft vocab with d2t)."""
        # the whole map, made by `propose` before drafting (eager: a compiled draft reads it): one gather
        return self.head.draft_to_target(ids) if self._d2t is None else self._d2t[ids]

    def _map_ids(self, device: torch.device) -> None:
        """Make `_d2t` (EAGLE-3 with a reduced draft vocab; EAGLE-1/2 ids are the target's already)."""
        if self._vocab != self.head.config.vocab_size and (self._d2t is None or self._d2t.device != device):
            self._d2t = self.head.draft_to_target(torch.arange(self._vocab, device=device))  # [Vd]

    def _top(self, features: Tensor, k: int) -> tuple[Tensor, Tensor]:
        """Output features [1, q, H] -> the k best children: log-probs [q, k] and head-vocab ids [q, k].

        top-k of the raw logits minus their logsumexp (= top-k of log_softmax, without writing it)."""
        logits = self.head_logits(features)[0].float()  # [q, Vd]
        values, ids = topk_rows(logits, k, self.topk_chunk)
        return values - torch.logsumexp(logits, dim=-1, keepdim=True), ids

    def _top_ids(
        self, features: Tensor, k: int, out: tuple[Tensor, Tensor] | None = None
    ) -> tuple[Tensor, Tensor]:
        """`_top` without the log-probs (a static tree only needs the ranks), features [1, q, H]: the logits
        [1, q, Vd] (kept for `last_scores`) and the k best head-vocab ids [1, q, k], written into out =
        (values, ids) [1, q, k] when given (kept buffers: no new tensors)."""
        logits = self.head_logits(features)  # [1, q, Vd]
        chunk = resolve_chunk(self.topk_chunk, logits.device.type, logits.shape[-1])
        if out is None:
            return logits, topk_rows(logits, k, chunk)[1]
        if chunk is None and out[0].dtype == logits.dtype:
            torch.topk(logits, k, dim=-1, out=out)
        else:  # long rows (chunked), or logits in another dtype than the buffer's (an autocast head)
            out[1].copy_(topk_rows(logits, k, chunk)[1])
        return logits, out[1]

    def _step(self, features: Tensor, ids: Tensor, allowed_spec: Tensor | None, depth: int) -> Tensor:
        """One head call on q nodes at `depth` >= 1 after the C committed entries: parent features [1, q, H],
        tokens [1, q], allowed_spec [q, S + q] (their ancestors' speculative slots and themselves: bool, or
        already the additive block, 0 = attend; or None when ONE node sees every slot so far: no mask)
        -> output features [1, q, H]."""
        cache, dtype, q = self._cache, self._weight.dtype, ids.shape[1]
        assert cache is not None  # start made it
        c = self._committed
        positions = self._positions(c + depth - 1, 1, ids.device)  # [1, 1]: a depth's nodes sit there
        if allowed_spec is None:  # one node seeing all C + S + 1 entries: the step's causal default,
            # which a single query over an eager cache (its view ends at the write) runs unmasked
            return self.head_step(features, ids, None, positions, cache)  # [1, 1, H]
        key = None if allowed_spec.dtype == torch.bool else ("depth", depth)  # a static plan's block
        width = allowed_spec.shape[1]  # S + q: speculative slots so far + these q
        if allowed_spec.dtype == torch.bool:  # [q, S + q] -> additive
            allowed_spec = torch.zeros(q, width, dtype=dtype, device=ids.device).masked_fill_(
                ~allowed_spec, torch.finfo(dtype).min
            )
        mask = self._masks.after_committed(allowed_spec, c, cache.max_length, key)  # [1, 1, q, C + S + q]
        positions = positions.expand(1, q) if q > 1 else positions  # [1, q]
        return self.head_step(features, ids, mask, positions, cache)  # [1, q, H]

    def _grow_dynamic(self, feature: Tensor, root: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """EAGLE-2 from the root's feature [1, H] and token [1, 1] (dynamic_tree.py): tokens, parents,
        scores [N] (float64)."""
        sizes = (self.top_k, self.depth, self.total_tokens)
        return grow_dynamic(feature, root, sizes, self._step, self._top, self._to_target)

    def _grow_static_eager(self, root: int, drawn: SampledChildren | None) -> tuple[Tensor, Tensor, None]:
        """The static tree drafted eagerly into kept buffers (drafters/static_eager.py): its tokens [N],
        the plan's parents [N] and no scores (each depth's logits and ids stay for `last_scores`).
        Children are the head's top-k, or drawn by `drawn` (which keeps their distributions)."""
        plan, outs = self._static_plan(), self._outputs
        if outs is None:
            mapped = self._vocab != self.head.config.vocab_size  # EAGLE-3's reduced vocab: ids to map
            outs = self._outputs = build_static_outputs(plan, self._weight.dtype, mapped)
        assert self._feature is not None  # propose checked it
        tokens, logits = grow_static_eager(
            plan,
            outs,
            self._feature,
            root,
            self._d2t,
            self._step,
            self._top_ids if drawn is None else drawn.top,
        )
        self._values = [(x, out.ids) for x, out in zip(logits, outs.depths)]
        return tokens, plan.parents, None

    def _static_plan(self) -> StaticPlan:
        """The static tree's per-depth plan (built once, on the head's device; see static_plan.py)."""
        if self._plan is None:
            assert self._static is not None  # only a static tree has a plan
            weight = self._weight
            self._plan = build_static_plan(self._static, weight.device, weight.dtype)
        return self._plan
