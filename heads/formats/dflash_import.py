"""Import DFlash drafters: the z-lab / SGLang layout (the inverse of `dflash_export`) and speculators'
"dflash" layout (what `speculators convert` writes and vLLM serves).

z-lab / SGLang (e.g. z-lab/Qwen3-8B-DFlash-b16): a Qwen3 config.json with architectures
["DFlashDraftModel"], num_hidden_layers = draft layers, block_size (top level or in dflash_config;
SGLang's default 16), dflash_config.mask_token_id, dflash_config.target_layer_ids (0-based layer OUTPUT
ids: HF hidden-state index - 1), num_target_layers. Without target_layer_ids SGLang spreads one target
layer per draft layer over the target (`default_target_layer_ids`), which needs the target's depth.
speculators: speculators_model_type "dflash", transformer_layer_config (num_hidden_layers = draft
layers), aux_hidden_state_layer_ids (= HF hidden-state indices), mask_token_id, block_size (default 8),
draft_vocab_size, sample_from_anchor, speculators_config.verifier.
Both: tensors layers.{i}.* of a Qwen3 layer (per-head q/k norms: both engines run that layer whatever
model_type says), fc (no bias) over len(layers) * H, hidden_norm, norm; the embedding and lm_head are the
target's (copies a checkpoint ships are dropped). Refused instead of imported approximately: a draft
layer other than full attention (sliding or causal: SGLang runs those causal), no mask token id, a
reduced draft vocabulary, sample_from_anchor, and the DFlash variants SGLang knows by dflash_config
fields spechead does not run (convolutions, selector, output multiplier, soft-capping, attention sinks).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import Tensor
from transformers import PretrainedConfig, PreTrainedTokenizerBase

from spechead.heads.dflash import DFlashConfig, DFlashHead
from spechead.heads.errors import HeadError
from spechead.heads.formats.build import fill_head
from spechead.heads.formats.dflash_export import MASK_EMBEDDING_FILE, SGLANG_MASK_TOKEN
from spechead.heads.formats.eagle3_import import speculators_layer, speculators_target
from spechead.heads.formats.llama import check_fused_layers, layer_config_of, target_fields

WEIGHT_NAMES = ("model.safetensors", "pytorch_model.bin", "*.safetensors")
# Copies of the target's modules (or training-only tensors) some converters ship: the target's own are used.
_DROPPED = ("embed_tokens.weight", "lm_head.weight", "verifier_norm.weight", "verifier_lm_head.weight")
# config / dflash_config fields of DFlash variants spechead's head does not run -> the value meaning "off".
_VARIANTS: dict[str, Any] = {
    "conv_kernel_size": 0,
    "conv_group_size": 0,
    "selector_rank": 0,
    "selector_top_k": 0,
    "output_multiplier": 1,
    "final_logit_softcapping": 0,
    "projector_type": None,
    "attention_sink_bias": False,
    "attention_value_scale": None,
    "has_embed_tokens": False,
    "has_lm_head": False,
    "sample_from_anchor": False,
}
_WINDOW = ("layer_types", "use_sliding_window", "sliding_window", "max_window_layers")
# z-lab config keys that describe the drafter, not its decoder layer.
_NOT_LAYER = ("dflash_config", "block_size", "num_target_layers", "auto_map")


def import_dflash(
    directory: Path,
    config: dict[str, Any],
    tensors: dict[str, Tensor],
    target_config: PretrainedConfig | None = None,
    **load: Any,
) -> DFlashHead:
    """A DFlashHead from the z-lab / SGLang DFLASH layout (architectures ["DFlashDraftModel"])."""
    where = f"DFlash head {directory}"
    fields = {**config, **(config.get("dflash_config") or {})}  # dflash_config wins, as in SGLang
    ids = fields.get("target_layer_ids")
    layers = None if ids is None else [int(i) + 1 for i in ids]  # layer output i = HF index i + 1
    layer = {k: v for k, v in config.items() if k not in _NOT_LAYER}
    drafter = {"block_size": fields.get("block_size") or 16, "mask_token_id": fields.get("mask_token_id")}
    known = {"target_num_layers": fields.get("num_target_layers") or 0}
    if (directory / MASK_EMBEDDING_FILE).is_file():  # vLLM's: a learned mask embedding for that id
        drafter["mask_embedding"] = _mask_embedding(directory, drafter["mask_token_id"], where)
    return _dflash_head(where, fields, layer, tensors, layers, drafter, known, target_config, load)


def _mask_embedding(directory: Path, mask_token_id: Any, where: str) -> Tensor:
    """The learned mask embedding [H] of `directory`/mask_embedding.pt (a tensor, or {"mask_token_id",
    "embedding"} whose id must be the config's, as vLLM requires)."""
    state = torch.load(directory / MASK_EMBEDDING_FILE, map_location="cpu", weights_only=True)
    if isinstance(state, dict):
        if state.get("mask_token_id", mask_token_id) != mask_token_id:
            raise HeadError(
                f"{where}: {MASK_EMBEDDING_FILE} is for mask_token_id {state.get('mask_token_id')}, "
                f"config.json names {mask_token_id}"
            )
        state = state.get("embedding")
    if not isinstance(state, Tensor):
        raise HeadError(f"{where}: {MASK_EMBEDDING_FILE} holds no embedding tensor")
    return state.reshape(-1)


def with_sglang_mask_token_id(
    config: dict[str, Any], tokenizer: PreTrainedTokenizerBase | None
) -> dict[str, Any]:
    """A z-lab config that names no mask token id, given the one SGLang's DFLASH embeds the masks with: the id
    of dflash_config.mask_token (default "<|MASK|>") in the target's tokenizer, else the id SGLang gives that
    token by adding it (len(tokenizer): an embedding row past the tokenizer's tokens, which the head's
    vocabulary check then requires). Unchanged when it names one or there is no tokenizer."""
    section = config.get("dflash_config") or {}
    if tokenizer is None or {**config, **section}.get("mask_token_id") is not None:
        return config
    token = section.get("mask_token") or config.get("mask_token") or SGLANG_MASK_TOKEN
    found = tokenizer.get_vocab().get(token, len(tokenizer))
    return {**config, "dflash_config": {**section, "mask_token_id": found}}


def import_speculators_dflash(
    directory: Path,
    config: dict[str, Any],
    tensors: dict[str, Tensor],
    target_config: PretrainedConfig | None = None,
    **load: Any,
) -> DFlashHead:
    """A DFlashHead from speculators' DFlash layout (speculators_model_type "dflash")."""
    where = f"speculators DFlash head {directory}"
    # vLLM also reads the attention-window fields at the top level of a speculators DFlash config
    layer = {**speculators_layer(where, config), **{k: config[k] for k in _WINDOW if k in config}}
    draft_vocab, vocab = config.get("draft_vocab_size"), layer.get("vocab_size")
    if draft_vocab not in (None, vocab):
        raise HeadError(
            f"{where} drafts over a reduced vocabulary ({draft_vocab} of {vocab} tokens, its own lm_head); "
            "spechead's DFlash head drafts over the target's through the target's lm_head: not supported"
        )
    drafter = {"block_size": config.get("block_size") or 8, "mask_token_id": config.get("mask_token_id")}
    layers = config.get("aux_hidden_state_layer_ids")
    known = speculators_target(config)
    return _dflash_head(where, config, layer, tensors, layers, drafter, known, target_config, load)


def default_target_layer_ids(depth: int, draft_layers: int) -> list[int]:
    """SGLang's DFlash context layers when a config names none, as 0-based layer OUTPUT ids: one per draft
    layer, spread evenly from layer 1 to layer depth - 3 (the middle layer for a single draft layer)."""
    if draft_layers == 1:
        return [depth // 2]
    if depth < 4:
        raise HeadError(f"DFlash's default target layers need a target with >= 4 layers, got {depth}")
    return [round(1 + i * (depth - 4) / (draft_layers - 1)) for i in range(draft_layers)]


def _dflash_head(
    where: str,
    fields: dict[str, Any],
    layer: dict[str, Any],
    tensors: dict[str, Tensor],
    layers: list[int] | None,
    drafter: dict[str, Any],
    known: dict[str, Any],
    target_config: PretrainedConfig | None,
    load: dict[str, Any],
) -> DFlashHead:
    """Shared DFlash conversion once a layout's fields are found: `fields` (variant flags), `layer` (the
    decoder layers' config), `layers` (HF indices or None), `drafter` (block_size, mask_token_id)."""
    off = [k for k, neutral in _VARIANTS.items() if fields.get(k) not in (None, neutral)]
    if off:
        raise HeadError(f"{where} is a DFlash variant ({', '.join(off)}) spechead's DFlash head does not run")
    num_layers = layer.get("num_hidden_layers")
    if isinstance(num_layers, bool) or not isinstance(num_layers, int) or num_layers < 1:
        raise HeadError(
            f"{where}: config.json needs num_hidden_layers (draft layers >= 1), got {num_layers!r}"
        )
    kinds = sorted({str(t) for t in (layer.get("layer_types") or [])[:num_layers]} - {"full_attention"})
    if kinds:
        raise HeadError(
            f"{where} has {kinds} draft layers (causal or windowed attention in SGLang); spechead's DFlash "
            "layers attend to the whole context and block: not supported"
        )
    tensors = {k: v for k, v in tensors.items() if k not in _DROPPED}
    if "fc.weight" not in tensors:
        raise HeadError(f"{where} has no fc.weight: it is not a DFlash drafter")
    hidden, width = (int(n) for n in tensors["fc.weight"].shape)
    vocab = layer.get("vocab_size") or (
        target_config and target_config.get_text_config(decoder=True).vocab_size
    )
    if isinstance(vocab, bool) or not isinstance(vocab, int) or vocab < 1:
        raise HeadError(f"{where}: config.json has no vocab_size: load it with target_config=target.config")
    mask = drafter["mask_token_id"]
    if isinstance(mask, bool) or not isinstance(mask, int) or not 0 <= mask < vocab:
        raise HeadError(
            f"{where}: config.json names no mask_token_id below the vocabulary size {vocab} (got {mask!r}): "
            "add the id of the token its masked block positions embed (z-lab: dflash_config.mask_token_id), or "
            "load it with the target's tokenizer (SpeculativeGenerator.from_pretrained(target, head), "
            "load_head(path, target_tokenizer=...)) to take SGLang's <|MASK|> id from it"
        )
    learned = drafter.get("mask_embedding")  # vLLM's: substituted for the id's embedding, so the head's own
    if learned is not None:
        tensors["mask_embedding"] = learned
    found = {**known, **target_fields(target_config, hidden, vocab, where)}
    depth = found.get("target_num_layers") or 0
    if known.get("target_num_layers") not in (None, 0, depth):
        raise HeadError(
            f"{where} was made for a {known['target_num_layers']}-layer target, the target has {depth} layers"
        )
    if layers is None:
        if not depth:
            raise HeadError(
                f"{where} does not name its target layers (SGLang's default needs the target's depth): load "
                "it with load_head(path, target_config=target.config) or through "
                "SpeculativeGenerator.from_pretrained(target, head)"
            )
        layers = [i + 1 for i in default_target_layer_ids(depth, num_layers)]
    check_fused_layers(where, list(layers), depth)
    if width != len(layers) * hidden:
        raise HeadError(
            f"{where}: fc reads {width} features but its {len(layers)} target layers give "
            f"{len(layers) * hidden}: not supported"
        )
    config = DFlashConfig(
        hidden_size=hidden,
        vocab_size=vocab,
        layer_config=layer_config_of({**layer, "model_type": "qwen3"}, where, num_layers),
        target_layers=list(layers),
        num_layers=num_layers,
        block_size=int(drafter["block_size"]),
        mask_token_id=-1 if learned is not None else mask,
        **found,
    )
    return fill_head(DFlashHead(config), tensors, where, **load)
