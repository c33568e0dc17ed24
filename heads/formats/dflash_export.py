"""Export a DFlashHead in the layout SGLang's DFLASH loads (`--speculative-algorithm DFLASH
--speculative-draft-model-path out`), the z-lab DFlash checkpoint layout.

SGLang does not run here (GPU build); the layout follows its loader as published in sgl-project/sglang:
`python/sglang/srt/models/dflash.py` (DFlashDraftModel, the EntryClass: layers.{i}.* of a Qwen3-style
layer whose attention ALWAYS applies per-head q_norm / k_norm, silu MLP without biases, fc (no bias) over
len(target_layer_ids) * H, hidden_norm, norm; no embedding nor lm_head: the target's are used) and
`python/sglang/srt/speculative/dflash_utils.py` (parse_dflash_draft_config: num_hidden_layers = draft
layers, block_size top-level or in dflash_config, dflash_config.target_layer_ids = 0-based target layer
OUTPUT ids, dflash_config.mask_token_id >= 0, num_target_layers; layer_types absent or full_attention
= non-causal attention). Published z-lab / SpecForge configs (architectures ["DFlashDraftModel"],
model_type "qwen3", block_size top-level, dflash_config {mask_token_id, target_layer_ids}) match.
speculators 0.9.0 converts this layout (`speculators.convert.dflash.DFlashConverter`, which its
`from_pretrained(path, verifier=...)` runs), which the tests use as a real-library check of tensor names
and shapes and of the numbers: its DFlashDraftModel drafts our blocks' logits (fp32, 1e-5).

vLLM's `dflash` method loads the same layout (vllm-project/vllm `model_executor/models/qwen3_dflash.py`,
DFlashQwen3ForCausalLM, registered for "DFlashDraftModel"), and also a learned mask embedding: a
`mask_embedding.pt` beside the weights (a tensor, or {"mask_token_id", "embedding"} whose id must be
dflash_config.mask_token_id) replaces the embedding of every input position holding that id.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any, cast

import torch
from torch import nn

from spechead.heads.dflash import DFlashHead
from spechead.heads.errors import HeadError
from spechead.heads.formats.build import export_dtype
from spechead.heads.formats.eagle3_export import fused_layer_inputs, write_export
from spechead.heads.formats.llama import llama_layer_fields

ARCHITECTURE = "DFlashDraftModel"
SGLANG_MASK_TOKEN = "<|MASK|>"  # what SGLang's DFLASH embeds the masks as when a config names no id
MASK_EMBEDDING_FILE = "mask_embedding.pt"  # vLLM's DFlash: a learned mask embedding beside the weights
_ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")
# Tokens a tokenizer reserves and a model never reads: Llama 3's <|reserved_special_token_N|> (GPT-OSS's
# <|reserved_N|>), Gemma's <mask> and <unusedN>, Phi-4's <|dummy_N|>, Mistral's [control_N].
_RESERVED = re.compile(r"<\|reserved_|<mask>$|<unused\d+>$|<\|dummy_\d+\|>$|\[control_\d+\]$")


def sglang_mask_token_id(vocab: Mapping[str, int], tokenizer_len: int, embedding_rows: int) -> int:
    """A target token id SGLang's DFLASH can embed the masks with (the export names it), else -1: "<|MASK|>"'s
    id in the tokenizer's vocabulary; else the id SGLang gives it by adding it (tokenizer_len, the first
    embedding row past the tokenizer's tokens, when there is one: Qwen, GPT-OSS); else the lowest reserved
    token (Llama 3's <|reserved_special_token_N|>, Gemma's <mask> / <unusedN>, Phi-4's <|dummy_N|>,
    Mistral's [control_N]), a token the target never reads."""
    token_id = vocab.get(SGLANG_MASK_TOKEN, tokenizer_len)
    if 0 <= token_id < embedding_rows:
        return token_id
    reserved = [i for token, i in vocab.items() if _RESERVED.match(token) and 0 <= i < embedding_rows]
    return min(reserved, default=-1)


def export_dflash_sglang(
    head: DFlashHead,
    out: Path,
    *,
    dtype: torch.dtype | None = None,
    mask_token_id: int | None = None,
    **_: Any,
) -> Path:
    """Write `out`/config.json + model.safetensors in SGLang's DFLASH layout (HeadError if it cannot hold
    the head: a learned mask embedding, a layer without per-head q/k norms, MLP biases; or if
    `mask_token_id` is not the head's own)."""
    cfg = head.config
    if cfg.mask_token_id >= 0 and mask_token_id not in (None, cfg.mask_token_id):
        raise HeadError(
            f"the head embeds its masks as token {cfg.mask_token_id}: drop --mask-token-id {mask_token_id}"
        )
    if cfg.mask_token_id < 0:
        raise HeadError(
            "the head learned its own mask embedding (mask_token_id -1), which SGLang's DFLASH cannot load "
            "(it embeds masks as a target token): export it with --format vllm --mask-token-id ID (vLLM reads "
            "the embedding from mask_embedding.pt), or train with head.mask_token_id=<id> of a token the target "
            "never reads (auto found none: no <|MASK|>, no spare embedding row, no reserved special token)"
        )
    return write_export(out, zlab_config(head, cfg.mask_token_id, dtype), head.state_dict(), dtype)


def export_dflash_vllm(
    head: DFlashHead,
    out: Path,
    *,
    dtype: torch.dtype | None = None,
    mask_token_id: int | None = None,
    **_: Any,
) -> Path:
    """Write the layout vLLM's `dflash` method loads: SGLang's (z-lab's), plus, for a head that learned its
    mask embedding, `mask_embedding.pt` ({"mask_token_id", "embedding" [H]}), which vLLM substitutes for
    the embedding of `mask_token_id` (the id it feeds the masked block positions as; one the target never
    produces, or a draft rooted at it reads the mask). HeadError without that id for such a head."""
    cfg = head.config
    if cfg.mask_token_id >= 0:  # the same files as SGLang's
        return export_dflash_sglang(head, out, dtype=dtype, mask_token_id=mask_token_id)
    if mask_token_id is None or not 0 <= mask_token_id < cfg.vocab_size:
        raise HeadError(
            "the head learned its own mask embedding: vLLM feeds masked positions as a token id and substitutes "
            f"the embedding for it: pass --mask-token-id ID (0..{cfg.vocab_size - 1}, a token the target never "
            f"produces) or auto, got {mask_token_id}"
        )
    tensors = {k: v for k, v in head.state_dict().items() if k != "mask_embedding"}
    write_export(out, zlab_config(head, mask_token_id, dtype), tensors, dtype)
    embedding = head.mask_embedding.detach().to("cpu", dtype or head.mask_embedding.dtype).clone()  # [H]
    torch.save({"mask_token_id": mask_token_id, "embedding": embedding}, out / MASK_EMBEDDING_FILE)
    return out


def zlab_config(head: DFlashHead, mask_token_id: int, dtype: torch.dtype | None) -> dict[str, Any]:
    """The z-lab DFlash config.json of `head`, its masks embedded as `mask_token_id`."""
    cfg = head.config
    return {
        "architectures": [ARCHITECTURE],
        **dflash_layer_fields(head),
        "num_hidden_layers": cfg.num_layers,
        "vocab_size": cfg.vocab_size,
        "block_size": cfg.block_size,
        "num_target_layers": cfg.target_num_layers or None,
        "dflash_config": {
            "mask_token_id": mask_token_id,
            # SGLang's ids are layer OUTPUTS (0-based); spechead's HF index i is the output of layer i - 1
            "target_layer_ids": [
                i - 1 for i in fused_layer_inputs(list(cfg.target_layers), cfg.target_num_layers)
            ],
            "block_size": cfg.block_size,
        },
        "layer_types": ["full_attention"] * cfg.num_layers,  # non-causal block attention, no window
        "use_sliding_window": False,
        "sliding_window": None,
        "dtype": export_dtype(head, dtype),
        "torch_dtype": export_dtype(head, dtype),
    }


def dflash_layer_fields(head: DFlashHead) -> dict[str, Any]:
    """Qwen3 config fields of the drafter layers; HeadError unless SGLang's DFLASH layer runs them exactly."""
    layer = llama_layer_fields(head.config.layer_config)
    if layer.pop("mlp_bias"):
        raise HeadError(
            "the head's MLP has biases, which SGLang's DFLASH layer lacks: train without mlp_bias"
        )
    if layer["hidden_act"] != "silu":
        raise HeadError(
            f"SGLang's DFLASH layer runs silu only, the head's layer uses {layer['hidden_act']!r}"
        )
    attention = {name for name, _ in cast(nn.Module, cast(Any, head.layers[0]).self_attn).named_children()}
    if not {"q_norm", "k_norm"} <= attention:
        raise HeadError(
            "SGLang's DFLASH layer always applies per-head q/k norms, which the head's "
            f"{head.config.layer_config.get('model_type')} layer lacks: train with head.draft_layer=qwen3 (the "
            "default)"
        )
    if not set(_ATTENTION) <= attention:
        raise HeadError(f"the head's attention {sorted(attention)} is not q/k/v/o projections")
    return {**layer, "model_type": "qwen3", "num_hidden_layers": head.config.num_layers}
