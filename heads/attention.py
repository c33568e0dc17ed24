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

`grouped_attention` is the same attention as two batched matrix products and a softmax, each key head with
its group of query heads as rows. The EAGLE drafting step can use it for its few queries (heads/fused.py,
attention="matmul"), and "spechead_matmul" (`matmul_attention`) uses it for a target's tree passes. Both
are A/Bs for CUDA, where sdpa's kernel tiles the queries and a few of them leave most of the GPU idle. Neither
is a default: neither has been timed on a GPU yet (`bench_gpu.py --draft-attention / --verify-attention`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from transformers import MODEL_FOR_CAUSAL_LM_MAPPING, AttentionInterface, PretrainedConfig
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

NAME = "spechead_sdpa"
MATMUL_NAME = "spechead_matmul"  # `matmul_attention`: an A/B on CUDA (bench_gpu.py --verify-attention)
# the most queries `grouped_attention` serves (a tree's nodes, a draft depth's frontier, an accept step);
# longer inputs (a prefill, a prompt's pairs) keep sdpa
FEW_QUERIES = 64
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


def grouped_attention(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, scale: float) -> Tensor:
    """softmax(q k^T scale + mask) v as two batched matrix products, each key head with its group of
    query heads stacked as rows: q (B, nh, T, D), k / v (B, kv, S, D), mask additive (B, 1, T, S) or
    boolean (True: attend) or None -> (B, nh, T, D). Scores, scale and softmax in fp32 (`_scores`).

    Why: on an H200 a compiled depth-7 FP8 draft spent 0.148 ms in six cuDNN sdpa calls, 25 us each for
    eight queries (bench_gpu_topk, 2026-11-28): the kernel tiles queries, so eight of them over a long
    cache leave most of the GPU idle. Here two matrix products and a softmax run instead: on this CPU's
    inductor 2 GEMMs and about 5 generated kernels a step in place of the sdpa call
    (scripts/count_draft_kernels.py); their cost on a GPU is not measured yet (`bench_gpu.py
    --draft-attention matmul`)."""
    batch, heads, length, dim = q.shape
    kv = k.shape[1]
    rows = q.reshape(batch, kv, heads // kv * length, dim)  # (B, kv, g*T, D): query head h = kv g
    scores = _scores(rows, k).view(batch, kv, heads // kv, length, -1) * scale  # (B, kv, g, T, S) fp32
    if mask is not None and mask.dtype == torch.bool:
        scores = scores.masked_fill(~mask[:, :, None], float("-inf"))
    elif mask is not None:
        scores = scores + mask[:, :, None]  # (B, 1, 1, T, S)
    probs = scores.softmax(-1).to(v.dtype).view(batch, kv, heads // kv * length, -1)
    return torch.matmul(probs, v).view(batch, heads, length, dim)


def _scores(rows: Tensor, k: Tensor) -> Tensor:
    """rows k^T in fp32: rows (B, kv, R, D), k (B, kv, S, D) -> (B, kv, R, S). sdpa's kernels keep the
    scores in fp32; a bf16 product would round them (0.4% of a score: 0.1 of a logit at 25). On CUDA
    half and bf16 inputs go through one GEMM with an fp32 output (`bmm`'s out_dtype); elsewhere the inputs
    are cast (a no-op in fp32)."""
    if rows.device.type == "cuda" and rows.dtype in (torch.float16, torch.bfloat16):
        out = torch.bmm(rows.flatten(0, 1), k.flatten(0, 1).transpose(1, 2), out_dtype=torch.float32)
        return out.view(*rows.shape[:-1], k.shape[-2])
    return torch.matmul(rows.float(), k.float().transpose(-1, -2))


def matmul_attention(
    module: nn.Module, query: Tensor, key: Tensor, value: Tensor, attention_mask: Tensor | None, **kwargs
) -> tuple[Tensor, None]:
    """`tree_sdpa`, except that a pass of 2 to FEW_QUERIES queries under a (B, 1, T, S) mask (a tree
    verification) runs `grouped_attention`: no key/value heads repeated, no sdpa kernel that tiles
    queries. On an H200 (2026-11-28, bench_gpu.py) verify(64) of the 8B shape spent 0.68 ms in 32 cuDNN
    sdpa calls and 0.21 ms in 64 kernels that prepared them. Registered as "spechead_matmul"; an A/B,
    not a default: not yet timed on a GPU."""
    if (
        attention_mask is None
        or attention_mask.dim() != 4
        or attention_mask.shape[1] != 1
        or not 1 < query.shape[2] <= FEW_QUERIES
        or module.training
        or kwargs.get("dropout")
        or any(kwargs.get(name) is not None for name in ("position_bias", "softcap"))
    ):
        return tree_sdpa(module, query, key, value, attention_mask, **kwargs)
    scaling = kwargs.get("scaling")
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    out = grouped_attention(query, key, value, attention_mask, scale)  # [B, nh, T, D]
    return out.transpose(1, 2).contiguous(), None


def runs_sdpa(config: PretrainedConfig) -> bool:
    """Whether the causal LM that transformers builds for `config` can run sdpa attention (and so
    "spechead_sdpa"). Gemma-2's soft-capped attention cannot: transformers refuses sdpa for it at load.
    A config transformers does not map (remote code) counts as able: its own loading decides."""
    cls = MODEL_FOR_CAUSAL_LM_MAPPING.get(type(config), None)
    return cls is None or bool(getattr(cls, "_supports_sdpa", True))


AttentionInterface.register(NAME, tree_sdpa)
AttentionMaskInterface.register(NAME, sdpa_mask)  # its masks: sdpa's
AttentionInterface.register(MATMUL_NAME, matmul_attention)
AttentionMaskInterface.register(MATMUL_NAME, sdpa_mask)
