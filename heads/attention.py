"""`tree_sdpa`: transformers' sdpa attention, tuned for the passes speculative decoding runs. Registered
with transformers' `AttentionInterface` (and its mask interface) as "spechead_sdpa": the attention
`SpeculativeGenerator.from_pretrained` loads a target with by default, and the demo's training target
(`configs/model/demo.yaml`; its decode evals verify trees too). Where it departs from transformers' sdpa:

- one query under a mask (a decode step on a preallocated cache), grouped-query attention: the query
  heads are packed as rows of their key head (`_one_query`). transformers packs them too, but not while
  torch.compile traces: compiled, it repeats the layer's whole key/value cache view (`repeat_kv`) every
  step (64 extra kernels a step on the 8B shape compiled: docs/PERFORMANCE.md);
- a tree pass (2 to FEW_QUERIES queries under a (B, 1, T, S) mask) on a GPU (`GROUPED_DEVICES`):
  `grouped_attention`, two batched matrix products and a softmax, each key head with its group of query
  heads as rows. sdpa's kernels tile the queries, so a few of them leave most of the GPU idle, and
  transformers repeats the key/value heads first (sdpa with `enable_gqa` and a mask falls back to its
  math kernel on CUDA). A 64-node verify of the 8B shape costs about 1.05 plain steps this way, 1.15 with sdpa
  (docs/PERFORMANCE.md);
- a tree pass on a CPU: sdpa with `enable_gqa` (its flash kernel takes the mask and the grouped heads
  together, so transformers' copy of the heads is pure cost there).

Everything else (no mask, a prefill, training, dropout) is transformers' `sdpa_attention_forward`, so a
target loaded with it trains and generates as with "sdpa". The EAGLE drafting step uses `grouped_attention`
for its few queries on a GPU too (heads/fused.py, attention="auto"). "spechead_matmul"
(`matmul_attention`) runs `grouped_attention` for tree passes on any device: an A/B on a CPU.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from transformers import MODEL_FOR_CAUSAL_LM_MAPPING, AttentionInterface, PretrainedConfig
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

NAME = "spechead_sdpa"
MATMUL_NAME = "spechead_matmul"  # `matmul_attention`: tree passes as matmuls on any device (an A/B)
# devices where few-query passes (tree passes, draft depths) run `grouped_attention` by default: measured
# faster than sdpa on an H200 (module doc); on a CPU sdpa's flash kernel with enable_gqa is kept (the
# matmuls have not been timed against it there)
GROUPED_DEVICES = ("cuda",)
# devices where sdpa's fast kernels take grouped key/value heads (`enable_gqa`) under a mask; CUDA's fall
# back to the math kernel, so there transformers repeats the heads instead
SDPA_GQA_DEVICES = ("cpu",)
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
    attention output [B, T, nh, D] and no weights, as transformers' sdpa attention (module doc: which
    passes run which kernel)."""
    groups = getattr(module, "num_key_value_groups", 1)
    length = query.shape[2]
    if (
        attention_mask is None
        or dropout
        or kwargs.get("position_bias") is not None
        or kwargs.get("softcap") is not None
    ):
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
        )
    if length == 1 and groups > 1:
        return _one_query(query, key, value, attention_mask, scaling, groups), None
    if query.device.type in GROUPED_DEVICES and _few_queries_under_tree_mask(module, query, attention_mask):
        scale = scaling if scaling is not None else query.shape[-1] ** -0.5
        out = grouped_attention(query, key, value, attention_mask, scale)  # [B, nh, T, D]
        return out.transpose(1, 2).contiguous(), None
    if not _GQA or query.device.type not in SDPA_GQA_DEVICES or groups <= 1:
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
        )
    out = F.scaled_dot_product_attention(
        query, key, value, attn_mask=attention_mask, scale=scaling, enable_gqa=True
    )  # [B, nh, T, D]
    return out.transpose(1, 2).contiguous(), None


def _one_query(
    query: Tensor, key: Tensor, value: Tensor, mask: Tensor, scaling: float | None, groups: int
) -> Tensor:
    """One query's heads packed as rows of their key head: query [B, nh, 1, D], key / value [B, kv, S, D],
    mask [B, 1 or nh, 1, S] -> [B, 1, nh, D]. Query head h = kv_head * groups + j, as `repeat_kv` pairs
    them; no key or value is copied (module doc: transformers copies them while compiling)."""
    batch, heads, _, dim = query.shape
    rows = query.reshape(batch, heads // groups, groups, dim)  # (B, kv, g, D): g "queries" per key head
    if mask.shape[1] != 1:  # a mask per query head: its rows follow the heads
        mask = mask.reshape(mask.shape[0], heads // groups, groups, mask.shape[-1])
    out = F.scaled_dot_product_attention(rows, key, value, attn_mask=mask, scale=scaling)  # (B, kv, g, D)
    return out.reshape(out.shape[0], 1, heads, dim)


def _few_queries_under_tree_mask(module: nn.Module, query: Tensor, mask: Tensor) -> bool:
    """A tree pass `grouped_attention` serves: 2 to FEW_QUERIES queries under one [B, 1, T, S] mask, in
    inference (training and gradients keep sdpa's kernel and its backward)."""
    return (
        mask.dim() == 4
        and mask.shape[1] == 1
        and 1 < query.shape[2] <= FEW_QUERIES
        and not module.training
        and not torch.is_grad_enabled()
    )


def grouped_attention(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, scale: float) -> Tensor:
    """softmax(q k^T scale + mask) v as two batched matrix products, each key head with its group of
    query heads stacked as rows: q (B, nh, T, D), k / v (B, kv, S, D), mask additive (B, 1, T, S) or
    boolean (True: attend) or None -> (B, nh, T, D). Scores, scale and softmax in fp32 (`_scores`).

    Why: sdpa's kernels tile the queries, so eight of them over a long cache leave most of the GPU idle.
    Here two matrix products and a softmax run instead (inductor: 2 GEMMs and about 5 generated kernels a
    step in place of the sdpa call, scripts/count_draft_kernels.py); the draft and verify times it saves on
    an H200: docs/PERFORMANCE.md."""
    batch, heads, length, dim = q.shape
    kv = k.shape[1]
    rows = q.reshape(batch, kv, heads // kv * length, dim)  # (B, kv, g*T, D): query head h = kv g
    scores = _scores(rows, k).view(batch, kv, heads // kv, length, -1) * scale  # (B, kv, g, T, S) fp32
    if mask is not None and mask.dtype == torch.bool:  # the fp32 minimum, not -inf: a row that sees no key
        # (a left-padded query) stays finite, as under an additive mask; -inf gives NaN, and a NaN in a
        # padded position's values poisons every row of the next layer (0 * NaN)
        scores = scores.masked_fill(~mask[:, :, None], torch.finfo(scores.dtype).min)
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
    """`tree_sdpa`, except that a tree pass (2 to FEW_QUERIES queries under a (B, 1, T, S) mask, in
    inference) runs `grouped_attention` on any device, not only on `GROUPED_DEVICES`: an A/B on a CPU.
    Registered as "spechead_matmul"."""
    if (
        attention_mask is None
        or kwargs.get("dropout")
        or any(kwargs.get(name) is not None for name in ("position_bias", "softcap"))
        or not _few_queries_under_tree_mask(module, query, attention_mask)
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
