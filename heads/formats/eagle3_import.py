"""Import EAGLE-3 heads: the official / SGLang / SpecForge layout and vLLM's `speculators` layout.

Official, SGLang, SpecForge: a Llama config.json with architectures ["LlamaForCausalLMEagle3"],
draft_vocab_size, optional target_hidden_size and optional
eagle_config.eagle_aux_hidden_state_layer_ids (0-based layer OUTPUT ids: HF hidden-state index
id + 1); tensors midlayer.*, fc, norm, lm_head, d2t, t2d, sometimes embed_tokens.
speculators: config.json with speculators_model_type "eagle3", transformer_layer_config,
draft_vocab_size, EAGLE-3.1 flags, optional eagle_aux_hidden_state_layer_ids (layer INPUT ids,
= HF hidden-state indices) and speculators_config.verifier; tensors layers.0.* instead of midlayer.*.
Without layer ids the heads read the EAGLE-3 default [2, L//2, L-3], which needs the target's depth.
Several decoder layers (speculators layers.0.., num_hidden_layers) become `num_layers`; the official
layout holds one. Conventions as the engines read them: a missing norm_before_residual is true in a
speculators config (vLLM), false in the official layout; the last layer's id means its output before
the final norm, which spechead's index L (after it) is not, so it is refused when the target's depth is
known; a windowed draft layer (sliding_attention) is refused (spechead's layer attends to the whole context).
A speculators head that trained its embedding (embed_requires_grad true) becomes a head with
`own_embedding`, its embed_tokens.weight loaded (vLLM, too, runs a shipped embedding instead of the
target's); otherwise a shipped embed_tokens.weight is the target's copy and is dropped.
`speculators_eagle3` reads the speculators fields for P-EAGLE's importer too (peagle_import), and
`speculators_layer` / `speculators_target` for the speculators DFlash importer (dflash_import).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import torch
from torch import Tensor
from transformers import PretrainedConfig

from spechead.heads.eagle3 import Eagle3Head, default_eagle3_layers
from spechead.heads.errors import HeadError
from spechead.heads.formats.build import fill_head, speculators_layer_names
from spechead.heads.formats.llama import check_fused_layers, layer_config_of, target_fields

WEIGHT_NAMES = ("model.safetensors", "pytorch_model.bin", "*.safetensors")
# Frozen target copies or training-only tensors some exporters keep; spechead uses the target's own
# (embed_tokens.weight is kept where the head trained it: `own_embedding`).
_DROPPED = ("embed_tokens.weight", "verifier_norm.weight", "verifier_lm_head.weight")
# EAGLE-3.1 options spechead's head runs (Eagle3Config fields of the same names).
_NORM_OPTIONS = ("norm_before_fc", "norm_before_residual", "norm_output")


def import_eagle3(
    directory: Path,
    config: dict[str, Any],
    tensors: dict[str, Tensor],
    target_config: PretrainedConfig | None = None,
    **load: Any,
) -> Eagle3Head:
    """An Eagle3Head from the official / SGLang / SpecForge layout."""
    where = f"EAGLE-3 head {directory}"
    eagle_config = config.get("eagle_config") or {}
    if eagle_config.get("use_aux_hidden_state") is False:
        raise HeadError(f"{where} has use_aux_hidden_state=false (no fused target layers): not supported")
    ids = eagle_config.get("eagle_aux_hidden_state_layer_ids")
    layers = [int(i) + 1 for i in ids] if ids else None  # layer output i = HF hidden-state index i + 1
    options = _norm_options(where, config, residual_default=False)
    return _eagle3_head(where, config, config, tensors, layers, target_config, options, load)


def import_speculators(
    directory: Path,
    config: dict[str, Any],
    tensors: dict[str, Tensor],
    target_config: PretrainedConfig | None = None,
    **load: Any,
) -> Eagle3Head:
    """An Eagle3Head from vLLM's speculators layout (speculators_model_type "eagle3")."""
    where = f"speculators head {directory}"
    kind = config.get("speculators_model_type")
    if kind != "eagle3":
        raise HeadError(
            f"{where} is a speculators {kind!r} model; spechead imports speculators 'eagle3', 'peagle' and "
            "'dflash' heads"
        )
    return speculators_eagle3(where, config, tensors, target_config, load)


def speculators_eagle3(
    where: str,
    config: dict[str, Any],
    tensors: dict[str, Tensor],
    target_config: PretrainedConfig | None,
    load: dict[str, Any],
    *,
    head_class: type[Eagle3Head] = Eagle3Head,
    residual_default: bool = True,
    embed_trained_default: bool = False,
    extra: dict[str, Any] | None = None,
) -> Eagle3Head:
    """An EAGLE-3-like head (`head_class`, config fields `extra` added) from a speculators config.

    residual_default: norm_before_residual when the config omits it (vLLM: true for EAGLE-3, false for
    P-EAGLE); embed_trained_default: embed_requires_grad when omitted (speculators: P-EAGLE trains it)."""
    options = _norm_options(where, config, residual_default)
    options["own_embedding"] = bool(config.get("embed_requires_grad", embed_trained_default))
    if options["own_embedding"] and "embed_tokens.weight" not in tensors:
        raise HeadError(
            f"{where} trained its own embedding (embed_requires_grad=true, or omitted where speculators "
            "defaults it to true) but ships no embed_tokens.weight: save the head with its embedding"
        )
    layer = speculators_layer(where, config)
    ids = config.get("eagle_aux_hidden_state_layer_ids")
    known = {**speculators_target(config), **options, **(extra or {})}
    head_fields = {**layer, "draft_vocab_size": config.get("draft_vocab_size")}
    head_fields["target_hidden_size"] = config.get("target_hidden_size")
    return _eagle3_head(where, head_fields, layer, tensors, ids, target_config, known, load, head_class)


def speculators_layer(where: str, config: dict[str, Any]) -> dict[str, Any]:
    """The transformer_layer_config object of a speculators config (HeadError if absent)."""
    layer = config.get("transformer_layer_config")
    if not isinstance(layer, dict):
        raise HeadError(f"{where}: config.json has no transformer_layer_config object")
    return layer


def speculators_target(config: dict[str, Any]) -> dict[str, str]:
    """target_name_or_path / target_architecture from a speculators config's verifier ("" if unnamed)."""
    verifier = (config.get("speculators_config") or {}).get("verifier") or {}
    return {
        "target_name_or_path": verifier.get("name_or_path") or "",
        "target_architecture": (verifier.get("architectures") or [""])[0],
    }


def _eagle3_head(
    where: str,
    config: dict[str, Any],
    layer: dict[str, Any],
    tensors: dict[str, Tensor],
    layers: list[int] | None,
    target_config: PretrainedConfig | None,
    known: dict[str, Any],
    load: dict[str, Any],
    head_class: type[Eagle3Head] = Eagle3Head,
) -> Eagle3Head:
    """Shared EAGLE-3 conversion once the layout's config fields are found."""
    count = _decoder_layers(where, layer, tensors)
    dropped = set(_DROPPED) - ({"embed_tokens.weight"} if known.get("own_embedding") else set())
    kept = {k: v for k, v in tensors.items() if k not in dropped}
    tensors = speculators_layer_names(kept, count, to_speculators=False)
    for name in ("fc.weight", "lm_head.weight"):
        if name not in tensors:
            raise HeadError(f"{where} has no {name} (tied or missing draft weights are not supported)")
    hidden = int(tensors["fc.weight"].shape[0])
    if config.get("target_hidden_size") not in (None, hidden) or tensors["fc.weight"].shape[1] != 3 * hidden:
        raise HeadError(
            f"{where} fuses target states of another width than its own ({hidden}): not supported"
        )
    d2t, t2d = _draft_vocab(where, tensors, config)
    vocab, draft_vocab = t2d.numel(), d2t.numel()
    if config.get("draft_vocab_size") not in (None, draft_vocab):
        raise HeadError(
            f"{where}: draft_vocab_size {config['draft_vocab_size']} != lm_head rows {draft_vocab}"
        )
    fields = {**known, **target_fields(target_config, hidden, vocab, where)}
    depth = fields.get("target_num_layers", 0)
    if layers:
        check_fused_layers(where, layers, depth)
    head = head_class(
        head_class.config_class(
            hidden_size=hidden,
            vocab_size=vocab,
            draft_vocab_size=draft_vocab,
            layer_config=layer_config_of(layer, where, count),
            target_layers=layers or _default_layers(where, depth),
            num_layers=count,
            **fields,
        )
    )
    fill_head(head, {**tensors, "d2t": d2t, "t2d": t2d}, where, **load)
    head.set_draft_vocab(head.d2t.clone(), head.t2d.clone())  # HeadError unless d2t and t2d agree
    return head


def _decoder_layers(where: str, layer: dict[str, Any], tensors: dict[str, Tensor]) -> int:
    """How many decoder layers the checkpoint holds: speculators' layers.0.. (its config's
    num_hidden_layers, checked against the tensors); the official layout's midlayer is one."""
    declared = int(layer.get("num_hidden_layers") or 1)
    found = {int(m.group(1)) for k in tensors if (m := re.match(r"layers\.(\d+)\.", k))}
    if any(k.startswith("midlayer.") for k in tensors):
        if declared != 1 or found:
            raise HeadError(f"{where} has several decoder layers; the official EAGLE-3 layout holds one")
        return 1
    if found != set(range(declared)):
        raise HeadError(
            f"{where}: config.json says num_hidden_layers {declared} but its tensors hold decoder layers "
            f"{sorted(found)}"
        )
    return declared


def _norm_options(where: str, config: dict[str, Any], residual_default: bool) -> dict[str, bool]:
    """The EAGLE-3.1 Eagle3Config options a layout's config sets (HeadError for those spechead lacks)."""
    if config.get("fc_norm"):
        raise HeadError(
            f"{where} has fc_norm=true (a norm on each fused target state), an EAGLE-3 variant spechead "
            "does not implement"
        )
    options = {flag: bool(config.get(flag, False)) for flag in _NORM_OPTIONS}
    options["norm_before_residual"] = bool(config.get("norm_before_residual", residual_default))
    return options


def _default_layers(where: str, num_layers: int) -> list[int]:
    """The EAGLE-3 default layers of a `num_layers`-deep target (HeadError if the depth is unknown)."""
    if not num_layers:
        raise HeadError(
            f"{where} does not say which target layers it fuses (the EAGLE-3 default [2, L//2, L-3] needs the "
            "target's depth L): load it with load_head(path, target_config=target.config) or through "
            "SpeculativeGenerator.from_pretrained(target, head)"
        )
    return default_eagle3_layers(num_layers)


def _draft_vocab(where: str, tensors: dict[str, Tensor], config: dict[str, Any]) -> tuple[Tensor, Tensor]:
    """(d2t (Vd,) long, t2d (V,) bool), completing whichever of the two a layout leaves out."""
    draft_vocab = int(tensors["lm_head.weight"].shape[0])
    d2t, t2d = tensors.pop("d2t", None), tensors.pop("t2d", None)
    if t2d is not None:
        t2d = t2d.bool()
    if d2t is None and t2d is not None:
        d2t = t2d.nonzero().squeeze(-1) - torch.arange(int(t2d.sum()))
    if d2t is None:
        vocab = config.get("vocab_size")
        if vocab != draft_vocab:
            raise HeadError(
                f"{where} has no d2t/t2d but its draft vocab ({draft_vocab}) != vocab_size ({vocab})"
            )
        d2t = torch.zeros(draft_vocab, dtype=torch.long)
    d2t = d2t.long()
    if t2d is None:
        vocab = int(config.get("vocab_size") or 0)
        targets = torch.arange(d2t.numel()) + d2t
        if not vocab or int(targets.max()) >= vocab:
            raise HeadError(f"{where} has d2t but no t2d and no vocab_size covering its target ids")
        t2d = torch.zeros(vocab, dtype=torch.bool)
        t2d[targets] = True
    return d2t, t2d
