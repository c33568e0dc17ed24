"""P-EAGLE head (arXiv 2602.01469): an EAGLE-3 head that drafts a block of K tokens in ONE forward.

The head is EAGLE-3's (fc fusion of low/mid/high target states, a decoder layer reading
concat(norm(embed), norm(hidden)) and `num_layers - 1` plain ones after it, norm + lm_head over a draft
vocabulary) plus two learned vectors:
`mask_hidden`, the shared hidden state that stands in for the target features future positions do not
have, and `mask_embedding`, the embedding of the token they do not know yet.

Alignment (EAGLE-3's): the real position t reads (fused_t, x_{t+1}) and predicts x_{t+2}. After an
anchor position a, future position j (1 <= j < K, rotary position a + j) reads (mask_hidden,
mask_embedding) and predicts x_{a+2+j}. So one forward at the last committed position drafts
x_{a+2} .. x_{a+1+K}, K tokens.

Attention (`parallel_allowed`): a real position sees the real positions up to itself (causal); future
position j of anchor a sees the real positions <= a and the future positions 1..j of the SAME anchor.
At decoding time that is a plain causal forward over [new real positions, K - 1 future positions];
in training the future positions of many anchors share one sequence, and this mask keeps every
anchor's block blind to the others and to the real tokens after its anchor.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import cast

import torch
from torch import Tensor, nn
from transformers import Cache, DynamicCache
from transformers.cache_utils import DynamicLayer

from spechead.heads.base import HeadConfig, register_head
from spechead.heads.decoder_layer import additive_mask, causal_mask4d
from spechead.heads.eagle3 import Eagle3Config, Eagle3Head, default_eagle3_layers
from spechead.heads.errors import HeadError
from spechead.heads.families import Family, Work, register_family

MASK_ID = -1  # the id `embed` maps to the learned mask embedding (never a real token id)


@dataclass(kw_only=True)
class PEagleConfig(Eagle3Config):
    """P-EAGLE head: EAGLE-3's fields plus the block size K (tokens drafted per forward, >= 2).

    `ttt_steps` (inherited) is unused: P-EAGLE has no training-time-test unroll.
    """

    family = "peagle"

    block_size: int = 8

    def __post_init__(self) -> None:
        super().__post_init__()
        if isinstance(self.block_size, bool) or not isinstance(self.block_size, int) or self.block_size < 2:
            raise HeadError(
                f"head.block_size must be an int >= 2 (tokens drafted in one forward), got {self.block_size!r}"
            )


def parallel_allowed(key_ok: Tensor, anchors: Tensor, block_size: int) -> Tensor:
    """Which keys each query sees in a parallel forward: -> allowed (B, N, N) bool, N = T + A * (K - 1).

    key_ok (B, T): real tokens; anchors (A,) long positions in 0..T-1; block_size K. Entries 0..T-1
    are the real positions; entry T + i * (K - 1) + (j - 1) is future position j of anchor i. A real
    query at t sees real keys s <= t; a future query (i, j) sees real keys s <= anchors[i] and the
    future keys (i, 1..j). Every query sees itself (a padded query never gets an all-blocked row).
    """
    batch, seq = key_ok.shape
    device = key_ok.device
    depth = block_size - 1
    count = anchors.numel() * depth
    # Per entry: its anchor (real: the position itself), its depth (real: 0), its anchor index (real: -1).
    anchor_of = torch.cat([torch.arange(seq, device=device), anchors.to(device).repeat_interleave(depth)])
    depth_of = torch.cat(
        [
            torch.zeros(seq, dtype=torch.long, device=device),
            torch.arange(1, block_size, device=device).repeat(anchors.numel()),
        ]
    )
    group = torch.cat(
        [
            torch.full((seq,), -1, device=device),
            torch.arange(anchors.numel(), device=device).repeat_interleave(depth),
        ]
    )
    q_anchor, k_anchor = anchor_of[:, None], anchor_of[None, :]  # (N, 1), (1, N)
    real_key = (depth_of == 0)[None, :]  # (1, N)
    sees_real = real_key & (k_anchor <= q_anchor)  # causal prefix up to the query's anchor
    same_block = (group[:, None] == group[None, :]) & (group[None, :] >= 0)
    sees_block = same_block & (depth_of[None, :] <= depth_of[:, None])  # (N, N)
    key_real = torch.cat([key_ok.bool(), key_ok.new_ones(batch, count, dtype=torch.bool)], dim=1)  # (B, N)
    allowed = (sees_real | sees_block)[None] & key_real[:, None, :]  # (B, N, N)
    return allowed | torch.eye(seq + count, dtype=torch.bool, device=device)[None]


@register_head
class PEagleHead(Eagle3Head):
    """Eagle3Head + mask_hidden (H,) and mask_embedding (H,): K draft tokens per forward."""

    config_class = PEagleConfig
    family = "peagle"
    config: PEagleConfig

    def __init__(self, config: PEagleConfig) -> None:
        super().__init__(config)
        hidden = config.hidden_size
        # Small random vectors (as embeddings start): zero would make every future position's input identical
        # to a zero feature, which the norms then divide by ~eps.
        self.mask_hidden = nn.Parameter(torch.randn(hidden) * 0.02)
        self.mask_embedding = nn.Parameter(torch.randn(hidden) * 0.02)

    @property
    def block_size(self) -> int:
        """K: tokens drafted per forward."""
        return self.config.block_size

    def embed(self, ids: Tensor) -> Tensor:
        """Token ids (B, T) -> embeddings (B, T, H): the head's own or the frozen target's (`DraftHead.embed`),
        the learned mask embedding at MASK_ID."""
        is_mask = (ids == MASK_ID)[..., None]  # (B, T, 1)
        tokens = super().embed(ids.clamp(min=0))  # (B, T, H)
        return torch.where(is_mask, self.mask_embedding.to(tokens.dtype), tokens)

    def future_inputs(self, batch: int, count: int) -> tuple[Tensor, Tensor]:
        """Inputs of `count` future positions per row: hidden (B, count, H) and ids (B, count) of MASK_ID."""
        hidden = self.mask_hidden.to(self.fc.weight.dtype).expand(batch, count, -1)
        ids = torch.full((batch, count), MASK_ID, dtype=torch.long, device=hidden.device)
        return hidden, ids

    def parallel_forward(
        self, fused: Tensor, input_ids: Tensor, anchors: Tensor, attention_mask: Tensor | None = None
    ) -> tuple[Tensor, Tensor]:
        """ONE forward over the real positions and K - 1 future positions per anchor.

        fused (B, T, H): fused target states; input_ids (B, T); anchors (A,) long positions;
        attention_mask (B, T) (1 = real token). Returns real (B, T, H) (position t predicts x_{t+2})
        and future (B, A, K - 1, H) (future j - 1 of anchor a predicts x_{a+2+j}).
        """
        batch, seq, _ = fused.shape
        depth = self.block_size - 1
        anchors = anchors.to(fused.device).long()
        next_ids = torch.cat([input_ids[:, 1:], torch.zeros_like(input_ids[:, :1])], dim=1)  # (B, T): x_{t+1}
        key_ok = (
            torch.ones_like(input_ids, dtype=torch.bool) if attention_mask is None else attention_mask.bool()
        )
        future_hidden, future_ids = self.future_inputs(batch, anchors.numel() * depth)
        hidden = torch.cat([fused.to(future_hidden.dtype), future_hidden], dim=1)  # (B, N, H)
        ids = torch.cat([next_ids, future_ids], dim=1)  # (B, N)
        offsets = torch.arange(1, depth + 1, device=fused.device)
        positions = torch.cat(
            [torch.arange(seq, device=fused.device), (anchors[:, None] + offsets).flatten()]
        )
        mask4d = additive_mask(
            parallel_allowed(key_ok, anchors, self.block_size), hidden.dtype
        )  # (B, 1, N, N)
        out = self.step(hidden, ids, mask4d, positions.expand(batch, -1))  # (B, N, H)
        return out[:, :seq], out[:, seq:].reshape(batch, anchors.numel(), depth, -1)

    def real_forward(
        self, fused: Tensor, input_ids: Tensor, attention_mask: Tensor | None = None
    ) -> tuple[Tensor, list[tuple[Tensor, Tensor]]]:
        """The real positions alone (causal): -> out (B, T, H) and every decoder layer's keys/values, each
        (B, kv_heads, T, head_dim), for `block_forward` (training splits the anchors into partitions)."""
        next_ids = torch.cat([input_ids[:, 1:], torch.zeros_like(input_ids[:, :1])], dim=1)  # (B, T): x_{t+1}
        cache = DynamicCache()
        out = self.step(fused, next_ids, causal_mask4d(fused, attention_mask), None, cache)
        layers = [cast(DynamicLayer, layer) for layer in cache.layers]  # full attention: keys/values are set
        return out, [(cast(Tensor, layer.keys), cast(Tensor, layer.values)) for layer in layers]

    def block_forward(
        self, real_kv: list[tuple[Tensor, Tensor]], key_ok: Tensor, anchors: Tensor, depth: int | None = None
    ) -> Tensor:
        """The first `depth` (default K - 1) future positions of `anchors` (A,) over the real keys/values of
        `real_forward`: -> (B, A, depth, H), equal to `parallel_forward`'s future outputs for those anchors
        (future position j sees positions 1..j of its block only, so a shorter block changes none of them).

        key_ok (B, T): real tokens (1). Gradients reach the real pass through real_kv.
        """
        batch, seq = key_ok.shape
        depth = self.block_size - 1 if depth is None else depth
        anchors = anchors.to(key_ok.device).long()
        hidden, ids = self.future_inputs(batch, anchors.numel() * depth)
        allowed = parallel_allowed(key_ok, anchors, depth + 1)[:, seq:]  # (B, A * depth, T + A * depth)
        offsets = torch.arange(1, depth + 1, device=key_ok.device)
        positions = (anchors[:, None] + offsets).flatten().expand(batch, -1)  # (B, A * depth)
        cache = DynamicCache()
        for i, (keys, values) in enumerate(real_kv):  # layer i's real keys/values (B, kv, T, D)
            cache.update(keys, values, i)
        out = self.step(hidden, ids, additive_mask(allowed, hidden.dtype), positions, cache)
        return out.reshape(batch, anchors.numel(), depth, -1)

    def parallel_logits(
        self, fused: Tensor, input_ids: Tensor, anchors: Tensor, attention_mask: Tensor | None = None
    ) -> Tensor:
        """Draft-vocab logits (B, A, K, Vd) of the K drafts of each anchor (slot 0: the real position)."""
        real, future = self.parallel_forward(fused, input_ids, anchors, attention_mask)
        first = real[:, anchors.to(real.device).long()]  # (B, A, H)
        return self.logits(torch.cat([first[:, :, None], future], dim=2))

    def draft_block(self, hidden: Tensor, next_ids: Tensor, past_key_values: Cache | None = None) -> Tensor:
        """Decoding: new real positions + the block, causal after the cache -> (B, K, H) block outputs.

        hidden (B, n, H): fused target states of the n new committed positions, next_ids (B, n) their
        next tokens; the last one is the anchor. K/V of all n + K - 1 entries are appended to the cache
        (the caller drops the last K - 1 before the next pass).
        """
        batch, new = next_ids.shape
        future_hidden, future_ids = self.future_inputs(batch, self.block_size - 1)
        out = self.step(
            torch.cat([hidden.to(future_hidden.dtype), future_hidden], dim=1),
            torch.cat([next_ids, future_ids], dim=1),
            past_key_values=past_key_values,
        )
        return out[:, new - 1 :]


def _peagle_work(config: HeadConfig) -> Work:
    """Memory plan, unpartitioned: K logit sets over the draft vocabulary and K positions through num_layers
    layers per trained position (each is the anchor of K - 1 future ones), one mask over all T * K of them;
    the objective's partitions lower it (its `work`)."""
    cfg = cast(PEagleConfig, config)
    k = int(cfg.block_size)
    return Work(k, int(cfg.draft_vocab_size), k * int(cfg.num_layers), float(k * k))


register_family(
    Family(
        name="peagle",
        head="peagle",
        summary="P-EAGLE head (EAGLE-3 drafting a block of K tokens in one forward)",
        tags=("peagle", "eagle3"),
        recipe="spechead.training.objectives.peagle:RECIPE",
        work=_peagle_work,
        exports={"speculators": "spechead.heads.formats.peagle_export:export_peagle_speculators"},
        default_layers=default_eagle3_layers,
        drafter="spechead.inference.drafters.peagle:PEagleDrafter",
        tree_option="choices",  # a static tree of rank paths over the block's slots (default: the chain)
        default_tree={"choices": None},
        accuracy="spechead.inference.tuning.accuracy:measure_peagle_accuracy",
        assumed_accuracy="spechead.inference.tuning.accuracy:assumed_peagle_accuracy",
        calibrate_assumed=False,
        drafts_per_depth=False,  # one forward drafts every depth
    )
)
