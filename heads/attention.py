"""`tree_sdpa`: transformers' sdpa attention, with grouped-query attention inside the kernel for tree
passes on a CPU. Registered with transformers' `AttentionInterface` (and its mask interface) as
"spechead_sdpa": the attention `SpeculativeGenerator.from_pretrained` loads a target with by default,
and the demo's training target (`configs/model/demo.yaml`; its decode evals verify trees too).

A tree verification runs N > 1 queries under a 4D mask. For exactly that case transformers' sdpa
integration repeats every layer's key/value heads (`repeat_kv`: a copy of the layer's whole cache view,
every pass), because on CUDA sdpa with `enable_gqa` and a mask falls back to its math kernel. On a CPU the
flash kernel takes the mask and the grouped heads together, so there the copy is pure cost. This function
is transformers' `sdpa_attention_forward` everywhere else (a GPU, no mask, one query: the plain step, the
prefill), so a target loaded with it decodes and generates as with "sdpa".
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from transformers import MODEL_FOR_CAUSAL_LM_MAPPING, AttentionInterface, PretrainedConfig
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

NAME = "spechead_sdpa"
# sdpa's `enable_gqa` (torch >= 2.5)
_GQA = tuple(int(x) for x in torch.__version__.split(".")[:2]) >= (2, 5)


def tree_sdpa(
    module: nn.Module,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attention_mask: Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs,
) -> tuple[Tensor, None]:
    """query [B, nh, T, D], key / value [B, kv, S, D], an additive or bool mask [B, 1, T, S] -> the
    attention output [B, T, nh, D] and no weights, as transformers' sdpa attention."""
    groups = getattr(module, "num_key_value_groups", 1)
    if (
        not _GQA
        or query.device.type != "cpu"
        or attention_mask is None
        or groups <= 1
        or query.shape[2] == 1  # (transformers packs one query's heads: no copy either)
        or dropout
        or kwargs.get("position_bias") is not None
        or kwargs.get("softcap") is not None
    ):
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
        )
    out = F.scaled_dot_product_attention(
        query, key, value, attn_mask=attention_mask, scale=scaling, enable_gqa=True
    )  # [B, nh, T, D]
    return out.transpose(1, 2).contiguous(), None


def runs_sdpa(config: PretrainedConfig) -> bool:
    """Whether the causal LM that transformers builds for `config` can run sdpa attention (and so
    "spechead_sdpa"). Gemma-2's soft-capped attention cannot: transformers refuses sdpa for it at load.
    A config transformers does not map (remote code) counts as able: its own loading decides."""
    cls = MODEL_FOR_CAUSAL_LM_MAPPING.get(type(config), None)
    return cls is None or bool(getattr(cls, "_supports_sdpa", True))


AttentionInterface.register(NAME, tree_sdpa)
AttentionMaskInterface.register(NAME, sdpa_mask)  # its masks: sdpa's
