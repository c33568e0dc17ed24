"""Medusa-1 heads: import the FasterDecoding layout and vLLM's layout, export both.

All three read the target's final normed hidden state; head k = ResBlocks (x + SiLU(W x + b)) then
its own Linear(H, V, bias=False). Tensor names per head k, ResBlock j, n ResBlocks:
- spechead:      heads.{k}.{j}.linear.weight / .bias, heads.{k}.{n}.weight
- FasterDecoding (medusa_lm_head.pt, config medusa_num_heads / medusa_num_layers):
                 {k}.{j}.linear.weight / .bias, {k}.{n}.weight
- vLLM (config model_type "medusa", num_heads, num_hidden_layers, medusa_fc_bias, original_lm_head):
                 blocks.{k}.layers.{j}.weight / .bias, lm_heads.{k}.weight (optional "medusa_heads." prefix)
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any, cast

import torch
from torch import Tensor, nn
from transformers import PretrainedConfig

from spechead.heads.errors import HeadError
from spechead.heads.formats.build import export_dtype, fill_head
from spechead.heads.formats.llama import target_fields
from spechead.heads.formats.weights import write_pickle, write_tensors
from spechead.heads.medusa import MedusaConfig, MedusaHead, ResBlock

WEIGHT_NAMES = (
    "medusa_lm_head.safetensors",
    "medusa_lm_head.pt",
    "model.safetensors",
    "pytorch_model.bin",
    "*.safetensors",
)
_VLLM_BLOCK = re.compile(r"blocks\.(\d+)\.layers\.(\d+)\.(weight|bias)")
_VLLM_LM_HEAD = re.compile(r"lm_heads\.(\d+)\.weight")


def import_medusa(
    directory: Path,
    config: dict[str, Any],
    tensors: dict[str, Tensor],
    target_config: PretrainedConfig | None = None,
    **load: Any,
) -> MedusaHead:
    """A MedusaHead from FasterDecoding's or vLLM's Medusa layout (told apart by tensor names)."""
    where = f"Medusa head {directory}"
    vllm = any(k.removeprefix("medusa_heads.").startswith(("blocks.", "lm_heads.")) for k in tensors)
    num_heads, num_layers = _counts(config, where)
    tensors = _from_vllm(tensors, config, num_heads, num_layers, where) if vllm else _from_medusa(tensors)
    projection = tensors.get(f"heads.0.{num_layers}.weight")
    if projection is None:
        raise HeadError(f"{where} has no projection for head 0 with {num_layers} ResBlocks: check its config")
    vocab, hidden = (int(n) for n in projection.shape)
    head = MedusaHead(
        MedusaConfig(
            hidden_size=hidden,
            vocab_size=vocab,
            num_heads=num_heads,
            num_layers=num_layers,
            init_from_lm_head=False,  # trained weights, nothing to initialise
            **target_fields(target_config, hidden, vocab, where),
        )
    )
    zero = tuple(f"heads.{k}.{j}.linear.bias" for k in range(num_heads) for j in range(num_layers))
    return fill_head(head, tensors, where, zero_biases=zero, **load)


def _counts(config: dict[str, Any], where: str) -> tuple[int, int]:
    heads = config.get("medusa_num_heads", config.get("num_heads"))
    layers = config.get("medusa_num_layers", config.get("num_hidden_layers", 1))
    if not isinstance(heads, int) or not isinstance(layers, int):
        raise HeadError(
            f"{where}: config.json needs integer medusa_num_heads/num_heads and medusa_num_layers"
        )
    return heads, layers


def _from_medusa(tensors: dict[str, Tensor]) -> dict[str, Tensor]:
    """FasterDecoding names (a bare ModuleList state dict, maybe prefixed medusa_head.) -> spechead."""
    return {"heads." + k.removeprefix("medusa_head."): v for k, v in tensors.items()}


def _from_vllm(
    tensors: dict[str, Tensor], config: dict[str, Any], num_heads: int, num_layers: int, where: str
) -> dict[str, Tensor]:
    """vLLM names -> spechead; a shared `original_lm_head` projection is copied into every head."""
    vocab = config.get("vocab_size")
    if config.get("truncated_vocab_size") not in (None, vocab) or "token_map" in tensors:
        raise HeadError(f"{where} predicts a truncated vocabulary (token_map): not supported")
    out: dict[str, Tensor] = {}
    for name, tensor in tensors.items():
        name = name.removeprefix("medusa_heads.")
        if block := _VLLM_BLOCK.fullmatch(name):
            k, j, kind = block.groups()
            out[f"heads.{k}.{j}.linear.{kind}"] = tensor
        elif lm_head := _VLLM_LM_HEAD.fullmatch(name):
            out[f"heads.{lm_head.group(1)}.{num_layers}.weight"] = tensor
        elif name == "lm_head.weight":
            out[f"heads.0.{num_layers}.weight"] = tensor  # original_lm_head stored under vLLM's own name
        else:
            out[name] = tensor  # reported as unexpected by fill_head
    if config.get("original_lm_head"):
        shared = out.get(f"heads.0.{num_layers}.weight")
        if shared is None:
            raise HeadError(f"{where} has original_lm_head=true but no lm_heads.0.weight")
        out.update({f"heads.{k}.{num_layers}.weight": shared for k in range(1, num_heads)})
    return out


def _check_exportable(head: MedusaHead, engine: str) -> None:
    """HeadError unless `engine` runs `head` as it is: own projections, no adapter, the final state."""
    cfg = head.config
    if cfg.share_lm_head:
        raise HeadError(
            f"the head uses the target's lm_head (share_lm_head=true); {engine}'s Medusa needs its own"
        )
    if cfg.lora_adapter:
        raise HeadError(
            f"Medusa-2 heads need their LoRA adapter merged into the target, which {engine} cannot do"
        )
    if cfg.target_layers != ([cfg.target_num_layers] if cfg.target_num_layers else [-1]):
        raise HeadError(
            f"the heads read target layer {cfg.target_layers}; {engine} feeds Medusa the final normed state"
        )


def export_medusa(head: MedusaHead, out: Path, *, dtype: torch.dtype | None = None, **_: Any) -> Path:
    """Write `out`/config.json + model.safetensors in the Medusa layout vLLM's loader reads."""
    _check_exportable(head, "vLLM")
    cfg = head.config
    n = cfg.num_layers
    tensors = {}
    for k, module in enumerate(head.heads):
        seq = cast(nn.Sequential, module)  # n ResBlocks then Linear(H, V)
        for j in range(n):
            block = cast(ResBlock, seq[j])
            tensors[f"blocks.{k}.layers.{j}.weight"] = block.linear.weight
            tensors[f"blocks.{k}.layers.{j}.bias"] = block.linear.bias
        tensors[f"lm_heads.{k}.weight"] = cast(nn.Linear, seq[n]).weight
    config = {
        "architectures": ["MedusaModel"],
        "model_type": "medusa",
        "hidden_size": cfg.hidden_size,
        "vocab_size": cfg.vocab_size,
        "num_heads": cfg.num_heads,
        "num_hidden_layers": n,
        "truncated_vocab_size": cfg.vocab_size,
        "medusa_fc_bias": True,  # spechead ResBlocks have biases; vLLM's default is none
        "original_lm_head": False,
        "base_model_name_or_path": cfg.target_name_or_path or None,
        "torch_dtype": export_dtype(head, dtype),
    }
    out.mkdir(parents=True, exist_ok=True)
    write_tensors(tensors, out / "model.safetensors", dtype)
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return out


def export_fasterdecoding(head: MedusaHead, out: Path, *, dtype: torch.dtype | None = None, **_: Any) -> Path:
    """Write `out`/config.json + medusa_lm_head.pt in FasterDecoding's layout (their `MedusaModel`)."""
    _check_exportable(head, "FasterDecoding")
    cfg = head.config
    if not cfg.target_name_or_path:
        raise HeadError("the layout names the target (base_model_name_or_path): the head records none")
    # their heads are a bare ModuleList: spechead's names without the "heads." prefix
    tensors = {k.removeprefix("heads."): v for k, v in head.state_dict().items()}
    config = {
        "medusa_num_heads": cfg.num_heads,
        "medusa_num_layers": cfg.num_layers,
        "base_model_name_or_path": cfg.target_name_or_path,
        "torch_dtype": export_dtype(head, dtype),
    }
    out.mkdir(parents=True, exist_ok=True)
    write_pickle(tensors, out / "medusa_lm_head.pt", dtype)  # what their loader torch.loads
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return out
