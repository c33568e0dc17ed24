"""EAGLE / EAGLE-3 rows, eager: one head forward per depth over every row's frontier, for any B.

The head's cache is a `RowCache` [B, kv, S_max, D] holding row b's C_b committed entries at slots
[0, C_b) (drafter.py's convention); a propose writes its speculative entries after them (scratch: the next
commit overwrites them). Row b's tree is its batch-1 tree (ties: stable sorts), up to float rounding.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from spechead.heads.grad import inference_mode
from spechead.inference.devices import host_to_device
from spechead.inference.drafters.base import BatchDraft, head_states, padded_prompts
from spechead.inference.drafters.eagle.sampled_children import SampledChildren
from spechead.inference.drafters.topk import topk_rows
from spechead.inference.positions import PositionIds
from spechead.inference.sampling import SamplingParams
from spechead.inference.target.cache import RowCache
from spechead.inference.target.prefill import length_groups
from spechead.inference.tree import mask_after

if TYPE_CHECKING:
    from spechead.inference.drafters.eagle.drafter import EagleDrafter


class EagleRows:
    """B rows of an `EagleDrafter` (whose head, tree settings and static plan they share)."""

    cache: RowCache  # the head's (made by `start`)
    feature: Tensor  # [B, H] output of each row's last committed pair (made by `start`)

    def __init__(self, drafter: EagleDrafter) -> None:
        self.drafter = drafter
        self.head = drafter.head
        self.device = self.head.fc.weight.device
        self.dtype = self.head.fc.weight.dtype
        self.committed = torch.zeros(0, dtype=torch.long)  # [B] C_b on the head's device
        self.lengths: list[int] = []  # C_b on the host
        self.longest = 0  # max_b C_b (host int)
        self._ids = PositionIds()  # 0..n-1 as [1, n] views of one kept arange
        # the additive mask's values (attend, blocked) as 0-d tensors: `torch.where` then makes the mask
        # in the head's dtype in one op
        self._attend = torch.zeros((), dtype=self.dtype, device=self.device)
        self._blocked = torch.full((), torch.finfo(self.dtype).min, dtype=self.dtype, device=self.device)

    # ---- the drafter's calls ------------------------------------------------------------------------------

    @inference_mode
    def start(
        self, prompts: Sequence[Tensor], hidden: Sequence[dict[int, Tensor]], roots: Sequence[int]
    ) -> None:
        """Commit every row's prompt pairs (f_t, x_{t+1}), x_T = root: rows of similar prompt lengths in one
        causal head pass each (`length_groups`: short rows do not pay for the longest one)."""
        lengths = [p.numel() for p in prompts]
        groups = length_groups(lengths)
        if len(groups) == 1:
            self._start_rows(prompts, hidden, roots)
            return
        self._new_cache(len(prompts), max(lengths))
        for i, group in enumerate(groups):
            part = EagleRows(self.drafter)
            part._start_rows(
                [prompts[b] for b in group], [hidden[b] for b in group], [roots[b] for b in group]
            )
            rows = host_to_device(torch.tensor(group), self.device)  # [G] its rows here
            t = part.longest  # its committed slots [G, kv, T, D]
            self.cache.write_rows(
                rows, ((x.keys[:, :, :t], x.values[:, :, :t]) for x in part.cache.row_layers)
            )
            if i == 0:
                self.feature = part.feature.new_empty(len(prompts), part.feature.shape[-1])  # [B, H]
            self.feature[rows] = part.feature
        self.committed = host_to_device(torch.tensor(lengths), self.device)
        self.lengths, self.longest = lengths, max(lengths)

    def _new_cache(self, batch: int, longest: int) -> None:
        """An empty head cache for `batch` rows whose prompts are at most `longest` tokens."""
        size = max(256, -(-(longest + 128 + self.drafter._spec_room) // 256) * 256)
        self.cache = RowCache(self.head.config.num_layers, batch, size)  # a layer for each of the head's
        self.committed = torch.zeros(batch, dtype=torch.long, device=self.device)
        self.lengths, self.longest = [0] * batch, 0

    def _start_rows(
        self, prompts: Sequence[Tensor], hidden: Sequence[dict[int, Tensor]], roots: Sequence[int]
    ) -> None:
        """`start` in one causal head pass over every row, padded to the longest prompt."""
        tokens, states = padded_prompts(prompts, hidden, self.drafter.hidden_layers)
        self._new_cache(len(prompts), tokens.shape[1])
        self.accept(tokens, [p.numel() for p in prompts], states, roots)

    @inference_mode
    def propose(
        self,
        roots: Sequence[int],
        sampling: Sequence[SamplingParams],
        generators: Sequence[torch.Generator | None],
    ) -> BatchDraft:
        """Every row's tree of the head's top-k children (greedy / rule A), or of children drawn from it
        (rule C: see `EagleDrafter`)."""
        self._ensure_room(0)
        roots_t = host_to_device(torch.tensor(list(roots), dtype=torch.long), self.device)  # [B] (no wait)
        drafter = self.drafter
        drafter._map_ids(self.device)
        drawn = None  # children drawn from the head (rule C): a static tree, a batch of one, sampling
        if drafter._static is not None and drafter.rule != "deterministic" and len(roots) == 1:
            if not sampling[0].is_greedy:
                drawn = SampledChildren(drafter.head_logits, sampling[0], generators[0], drafter._vocab_out)
        # [B, N] each, left on the head's device: on a GPU the verify is queued behind the draft (no wait)
        tokens, parents = self._grow(self.feature, roots_t, drawn)
        if drawn is None:
            return BatchDraft(tokens, parents, [tokens.shape[1]] * tokens.shape[0])
        q = drawn.q_rows(drafter._static_plan(), drafter._d2t)  # [N, V]
        return BatchDraft(tokens, parents, [tokens.shape[1]], "without_replacement", q[None])

    @inference_mode
    def keep(self, rows: Sequence[int]) -> None:
        idx = host_to_device(torch.tensor(list(rows), dtype=torch.long), self.device)  # (no wait)
        self.committed, self.feature = self.committed[idx], self.feature[idx]
        self.lengths = [self.lengths[b] for b in rows]
        self.longest = max(self.lengths)
        self.cache.keep_rows(rows, self.longest)  # (their committed entries: the rest is scratch)

    # ---- committed cache ---------------------------------------------------------------------------

    def rewind(self, length: int) -> None:
        """Every row back to `length` committed entries (calibration times the same accept again)."""
        self.committed = torch.full_like(self.committed, length)
        self.lengths, self.longest = [length] * len(self.lengths), length

    def _ensure_room(self, extra: int) -> None:
        """Grow the head cache (to twice its size at least) to fit max_b C_b + extra + a whole draft."""
        self.cache.grow(self.longest + extra + self.drafter._spec_room)

    @inference_mode
    def accept(self, tokens: Tensor, lengths: Sequence[int], hidden: dict[int, Tensor], next_roots) -> None:
        """Step the head on row b's first lengths[b] pairs of tokens [B, K] / states {l: [B, K, H]} at
        positions C_b.. (causal within the block); padded queries write scratch slots after them."""
        batch, k = tokens.shape
        dev, lengths = self.device, list(lengths)
        # x_{t+1} of each pair, the row's next root after its last one, padded: one tensor from host lists
        # (a concatenation and an index_put of device tensors cost more on a CPU)
        nexts = [
            [*row[1:n], root] + [0] * (k - n) for row, n, root in zip(tokens.tolist(), lengths, next_roots)
        ]
        packed = host_to_device(torch.tensor([[n - 1 for n in lengths], lengths]), dev)  # [2, B]
        self._ensure_room(k)
        # [B, K] where the pairs go, their positions too
        slots = self.committed[:, None] + self._ids(0, k, dev)
        view = self.longest + k  # S
        seen = self._ids(0, view, dev)[:, None] <= slots[:, :, None]  # [B, K, S] causal after C_b
        mask = torch.where(seen, self._attend, self._blocked)[:, None]  # [B, 1, K, S]
        ids = host_to_device(torch.tensor(nexts), dev)  # [B, K]
        features = self.head.features(self._states(hidden))  # [B, K, H] (EAGLE-3: fused)
        out = self._run(features, ids, (mask, slots, slots, view))  # [B, K, H]
        self.feature = out[self._ids(0, batch, dev)[0], packed[0]]  # [B, H] each row's last real pair
        self.committed = self.committed + packed[1]
        self.lengths = [c + n for c, n in zip(self.lengths, lengths)]
        self.longest = max(self.lengths)

    def _states(self, hidden: dict[int, Tensor]) -> list[Tensor]:
        return head_states(self.head, hidden, self.drafter.hidden_layers)  # [B, K, H] each

    def _inputs(self, own: Tensor, offsets: Tensor, spec: int = 0) -> tuple[Tensor, Tensor, Tensor, int]:
        """`_run`'s inputs for q queries: query i of row b writes slot C_b + spec + i at position C_b +
        offsets[i] and sees slots < C_b and those of [C_b, C_b + spec + q) that own [B, q, spec + q] names.
        Mask [B, 1, q, S], positions [B, q], written slots [B, q] and S (the longest C_b + spec + q, or a
        fixed-shape cache's S_max after its device lengths)."""
        cache = self.cache
        if cache.static_shapes:
            assert cache.lengths_t is not None  # GraphRows.start made it
            c, view = cache.lengths_t, cache.max_length  # [B], S
        else:
            c, view = self.committed, self.longest + own.shape[-1]
        mask, block = mask_after(c, own, view, self.dtype)  # block [B, spec + q]
        return mask, c[:, None] + offsets[None, :], block[:, spec:], view

    def _run(
        self, features: Tensor, ids: Tensor, inputs: tuple[Tensor, Tensor, Tensor, int], spec: int = 0
    ) -> Tensor:
        """The head on features [B, q, H] and tokens [B, q] with `_inputs`' mask, positions, slots and S."""
        mask, positions, slots, view = inputs
        cache = self.cache
        if cache.static_shapes:
            cache.write_offset = spec
        else:
            cache.write_slots, cache.view_length = slots, view
        return self.drafter.head_step(features, ids, mask, positions, cache)

    # ---- tree growth -------------------------------------------------------------------------------

    def _top(self, features: Tensor, k: int, scores: bool = True) -> tuple[Tensor, Tensor]:
        """Features [B, q, H] -> the k best children: log-probs [B, q, k] (raw logits when not
        `scores`: a static tree needs only the ranks), head-vocab ids [B, q, k]."""
        logits = self.drafter.head_logits(features).float()  # [B, q, Vd]
        values, ids = topk_rows(logits, k, self.drafter.topk_chunk)
        return (values - torch.logsumexp(logits, dim=-1, keepdim=True) if scores else values), ids

    def _grow(
        self, feature: Tensor, roots: Tensor, drawn: SampledChildren | None = None
    ) -> tuple[Tensor, Tensor]:
        """Every row's tree from its feature [B, H] and root [B]: tokens, parents [B, N]."""
        if self.drafter._static is not None:
            return self._grow_static(feature, roots, drawn)
        return self._grow_dynamic(feature, roots)[:2]  # (the scores are unread)

    def _grow_dynamic(self, feature: Tensor, roots: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """`_grow`'s EAGLE-2 tree (`EagleDrafter`), one head call a depth over [B, k]: tokens, parents and
        the kept nodes' cumulative log-probs (float64, root 0) [B, N]."""
        k, dev, batch = self.drafter.top_k, self.device, roots.shape[0]
        rows = torch.arange(batch, device=dev)[:, None]  # [B, 1]
        values, ids = self._top(feature[:, None], k)  # [B, 1, k]
        to_target = self.drafter._to_target
        tokens = [roots[:, None], to_target(ids[:, 0])]  # by depth: [B, 1], [B, k], ...
        parents = [
            torch.full((batch, 1), -1, device=dev),
            torch.zeros(batch, k, dtype=torch.long, device=dev),
        ]
        scores = [torch.zeros(batch, 1, dtype=torch.float64, device=dev), values[:, 0].double()]
        count = 1 + k
        frontier = torch.arange(1, 1 + k, device=dev).expand(batch, k)  # [B, k] node ids to expand next
        front_feat = feature[:, None].expand(batch, k, -1)  # [B, k, H]
        front_tok, front_score = tokens[1], scores[1]  # [B, k]
        anc = torch.zeros(batch, k, 0, dtype=torch.bool, device=dev)  # [B, k, S] speculative ancestors
        eye = torch.eye(k, dtype=torch.bool, device=dev)
        for d in range(2, self.drafter.depth + 1):
            spec = anc.shape[-1]
            own = torch.cat([anc, eye.expand(batch, k, k)], dim=2)  # [B, k, S + k]
            offsets = torch.full((k,), d - 2, device=dev)  # position C_b + (d - 1) - 1
            out = self._run(front_feat, front_tok, self._inputs(own, offsets, spec), spec)  # [B, k, H]
            values, ids = self._top(out, k)  # [B, k, k]
            new_score = (front_score[:, :, None] + values.double()).reshape(batch, -1)  # [B, k * k]
            new_tok = to_target(ids).reshape(batch, -1)
            tokens.append(new_tok)
            parents.append(frontier.repeat_interleave(k, dim=1))
            scores.append(new_score)
            if d < self.drafter.depth:  # next frontier per row: best k new nodes (ties: lower id), id order
                pick = torch.sort(-new_score, dim=1, stable=True).indices[:, :k].sort(dim=1).values  # [B, k]
                row = pick // k  # [B, k] which expanded node each hangs from
                anc = torch.cat([anc[rows, row], eye[row]], dim=2)  # [B, k, S + k]
                frontier, front_feat = count + pick, out[rows, row]
                front_tok, front_score = new_tok.gather(1, pick), new_score.gather(1, pick)
            count += k * k
        all_tokens, all_parents, all_scores = (
            torch.cat(x, dim=1) for x in (tokens, parents, scores)
        )  # [B, M]
        budget = min(self.drafter.total_tokens - 1, count - 1)
        keep = torch.sort(-all_scores[:, 1:], dim=1, stable=True).indices[:, :budget].sort(dim=1).values + 1
        keep = torch.cat([keep.new_zeros(batch, 1), keep], dim=1)  # [B, N] ascending, root first
        index = torch.full((batch, count), -1, dtype=torch.long, device=dev)
        index.scatter_(1, keep, torch.arange(keep.shape[1], device=dev).expand(batch, -1))
        kept_parents = all_parents.gather(1, keep)  # [B, N]
        kept_parents = torch.where(kept_parents >= 0, index.gather(1, kept_parents.clamp(min=0)), -1)
        return all_tokens.gather(1, keep), kept_parents, all_scores.gather(1, keep)

    def _grow_static(
        self, feature: Tensor, roots: Tensor, drawn: SampledChildren | None = None
    ) -> tuple[Tensor, Tensor]:
        """`_grow`'s static tree, one head call a depth over [B, E]: a node's rank-r child is the head's
        r-th best token there, or its r-th draw (`drawn`, B = 1)."""
        plan = self.drafter._static_plan()
        batch, n = roots.shape[0], plan.order.numel()
        tokens = roots[:, None].repeat(1, n)  # [B, N]
        out = feature.new_empty(batch, n, feature.shape[-1])  # [B, N, H]
        out[:, 0] = feature
        # every speculative query's inputs at once (the plan's stacked masks and offsets), each depth's as
        # views of them: on a CPU each op costs (a mask a depth was about ten)
        q = plan.spec_offsets.numel()
        every = self._inputs(plan.spec_allowed.expand(batch, q, q), plan.spec_offsets) if q else None
        spec = 0
        for step in plan.steps:
            if step["run"] is not None:  # the parents to expand at depth d - 1 >= 1 run on the head
                assert every is not None  # (a depth that runs: the plan has speculative queries)
                run, (mask, positions, slots, view) = step["run"], every  # run [E]
                at = slice(spec, spec + run.numel())
                inputs = (mask[:, :, at], positions[:, at], slots[:, at], view)
                out[:, run] = self._run(out[:, step["run_parent"]], tokens[:, run], inputs, spec)
                spec += run.numel()
            expand = out[:, step["expand"]]  # [B, E, H]
            if drawn is None:
                ids = self._top(expand, step["need"], scores=False)[1]  # [B, E, need] the head's best
            else:
                ids = drawn.top(expand, step["need"])  # [1, E, need] drawn (rule C)
            tokens[:, step["nodes"]] = self.drafter._to_target(ids.reshape(batch, -1)[:, step["pick"]])
        return tokens[:, plan.order], plan.parents.expand(batch, -1)  # emitted depth-first (see the plan)
