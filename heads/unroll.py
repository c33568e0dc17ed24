"""Training-time test (TTT): unroll a feature-level head on its own outputs, tree-node attention.

Works for any head with `step(hidden, next_ids, attention_mask4d, position_ids, past_key_values)`
and an `fc` layer (EAGLE-1 and EAGLE-3). Step 0 at position t reads (target state_t, x_{t+1});
step j >= 1 reads (its own step j-1 output at t-1, x_{t+1}). The query of step j at t attends to
step-0 keys at positions <= t-j and to the key of step i (1 <= i <= j) at t-j+i only: exactly the
ancestors a depth-j tree node has at inference, so training sees what decoding will.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import Tensor
from transformers import DynamicCache

from spechead.heads.decoder_layer import additive_mask

if TYPE_CHECKING:
    from spechead.heads.eagle import EagleHead
    from spechead.heads.eagle3 import Eagle3Head


def ttt_allowed(key_ok: Tensor, step: int) -> Tensor:
    """Which keys the queries of TTT step `step` see: key_ok (B, T) -> allowed (B, T, T * (step + 1)).

    Keys are laid out as step-0 keys at positions 0..T-1, then step 1's, ... then step `step`'s
    (the order the cache accumulated them). The query of step j at position t sees step-0 keys at
    s <= t - j (real tokens only) and the step-i key (1 <= i <= j) at s = t - j + i only: the chain
    of ancestors of a depth-j tree node whose root context ends at t - j.
    """
    batch, seq = key_ok.shape
    t = torch.arange(seq, device=key_ok.device)
    s = torch.arange(seq, device=key_ok.device)
    root = (s[None, :] <= t[:, None] - step)[None] & key_ok.bool()[:, None, :]  # (B, T, T)
    chain = [(s[None, :] == t[:, None] - step + i)[None].expand(batch, seq, seq) for i in range(1, step + 1)]
    return torch.cat([root, *chain], dim=-1)


def ttt_forward(
    head: EagleHead | Eagle3Head,
    fused: Tensor,
    input_ids: Tensor,
    attention_mask: Tensor | None,
    steps: int,
    position_ids: Tensor | None = None,
) -> list[Tensor]:
    """Unroll the head `steps` times; entry j is o^j (B, T, H). Logits of o^j_t predict x_{t+2}.

    fused (B, T, H): fused target states; input_ids, attention_mask (B, T) (1 = real token).
    Step 0 at t reads (fused_t, x_{t+1}); step j >= 1 at t reads (o^{j-1}_{t-1}, x_{t+1}). All steps
    append K/V to one DynamicCache and attend through `ttt_allowed`, with rotary position
    position_ids[t] (default t). Use `ttt_valid` to mask positions without a complete chain.
    """
    batch, seq, _ = fused.shape
    next_ids = torch.cat([input_ids[:, 1:], torch.zeros_like(input_ids[:, :1])], dim=1)  # (B, T): x_{t+1}
    key_ok = torch.ones_like(input_ids, dtype=torch.bool) if attention_mask is None else attention_mask.bool()
    if position_ids is None:  # every step keeps position t (a depth-j node at t has rotary position t)
        position_ids = torch.arange(seq, device=fused.device).expand(batch, seq)
    dtype = head.fc.weight.dtype
    cache = DynamicCache()
    outputs: list[Tensor] = []
    hidden = fused
    for j in range(steps):
        if j:  # position t reads its own previous-step output at t - 1
            prev = outputs[-1]
            hidden = torch.cat([torch.zeros_like(prev[:, :1]), prev[:, :-1]], dim=1)
        mask4d = additive_mask(ttt_allowed(key_ok, j), dtype)  # (B, 1, T, T * (j + 1))
        outputs.append(head.step(hidden, next_ids, mask4d, position_ids, cache))
    return outputs


def ttt_valid(attention_mask: Tensor, step: int) -> Tensor:
    """(B, T) bool: positions t whose step-`step` output has a complete chain of real inputs.

    Needs t >= step and tokens t - step .. t + 1 all real (so t + 1 < T). The caller still ANDs in
    its loss mask for token x_{t+2} (the target's logits at position t + 1).
    """
    mask = attention_mask.bool().long()
    batch, seq = mask.shape
    width = step + 2  # positions t - step .. t + 1
    padded = torch.cat([mask.new_zeros(batch, 1), mask.cumsum(dim=1)], dim=1)  # (B, T + 1)
    end = torch.arange(seq, device=mask.device) + 2  # exclusive end index t + 2 into padded
    start = end - width
    ok = (end <= seq) & (start >= 0)
    total = padded[:, end.clamp(max=seq)] - padded[:, start.clamp(min=0)]
    return ok[None, :] & (total == width)
