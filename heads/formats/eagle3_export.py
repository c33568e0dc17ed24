"""Export an Eagle3Head for serving: vLLM's `speculators` layout and the SGLang / official layout.

Both engines run ONE Llama decoder layer whose q/k/v read concat(input_layernorm(embed),
hidden_norm(hidden)), then norm + lm_head over the draft vocab (d2t offsets). The fused target layers
are written in each engine's convention (both capture a layer's state BEFORE the final norm):
- speculators / vLLM: eagle_aux_hidden_state_layer_ids = layer INPUT ids (= spechead's HF indices);
- SGLang: eagle_config.eagle_aux_hidden_state_layer_ids = layer OUTPUT ids (= HF index - 1).
speculators: every EAGLE-3.1 flag is written (vLLM reads a missing norm_before_residual as true), the
target's embedding ships as embed_tokens.weight (speculators' own model has no other source that works
under transformers 5; vLLM shares the target's when it is absent), the verifier as a portable id,
`dtype` (transformers 5). A head with its own embedding (`own_embedding`) ships that one instead, with
embed_requires_grad true (vLLM then runs it, not the target's). SGLang always replaces an EAGLE-3 draft's
embedding with the target's, so that layout ships none and refuses heads with their own; it has no
EAGLE-3.1 norms, so heads using them are refused there.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import torch

from spechead.heads.eagle3 import Eagle3Head
from spechead.heads.errors import HeadError
from spechead.heads.formats.build import export_dtype, speculators_layer_names, target_embedding_of
from spechead.heads.formats.llama import llama_layer_fields
from spechead.heads.formats.weights import write_tensors

_PROJ = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj")
_MLP = ("mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")
_NORMS = ("input_layernorm", "hidden_norm", "post_attention_layernorm")
EAGLE31 = ("norm_before_fc", "norm_before_residual", "norm_output")  # the head's EAGLE-3.1 options
_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*(/[\w.-]+)?")  # "name" or "org/name"


def export_speculators(
    head: Eagle3Head,
    out: Path,
    *,
    dtype: torch.dtype | None = None,
    speculative_tokens: int = 3,
    verifier: str | None = None,
    embedding: torch.Tensor | None = None,
    with_embedding: bool = True,
    **_: Any,
) -> Path:
    """Write `out`/config.json + model.safetensors for vLLM (`vllm serve T --speculative-config` model=out).

    verifier: the target's Hub id (default: the head's target); a local path is written as its
    directory's name plus a `verifier_note`. embedding: the target's input embedding [V, H]
    (`weights.target_embedding`; default: the one attached to the head); with_embedding=False leaves
    embed_tokens.weight out (vLLM then shares the target's; speculators' own model cannot). A head with
    its own embedding ships it (embedding is not read; with_embedding=False is refused)."""
    config = speculators_config(head, dtype, speculative_tokens, verifier)
    tensors = speculators_tensors(head)  # (own_embedding: embed_tokens.weight)
    if head.config.own_embedding and not with_embedding:
        raise HeadError(
            "the head has its own trained embedding, which the export must ship (served in place of the "
            "target's): drop --no-embedding"
        )
    if with_embedding and not head.config.own_embedding:
        tensors["embed_tokens.weight"] = target_embedding_of(head, embedding)
    return write_export(out, config, tensors, dtype)


def speculators_tensors(head: Eagle3Head) -> dict[str, torch.Tensor]:
    """The head's state dict with its decoder layers named as speculators names them (layers.{i}.*)."""
    return speculators_layer_names(head.state_dict(), head.config.num_layers, to_speculators=True)


def speculators_config(
    head: Eagle3Head, dtype: torch.dtype | None, speculative_tokens: int, verifier: str | None
) -> dict[str, Any]:
    """config.json of an EAGLE-3 head in the speculators layout (P-EAGLE's export adds its fields)."""
    layer = _llama_layer(head, allow_bias=True)
    cfg = head.config
    name, note = portable_verifier(verifier or cfg.target_name_or_path)
    config = {
        "architectures": ["Eagle3Speculator"],
        "speculators_model_type": "eagle3",
        "transformer_layer_config": {
            **layer,
            "vocab_size": cfg.vocab_size,
            "num_hidden_layers": cfg.num_layers,
        },
        "draft_vocab_size": cfg.draft_vocab_size,
        **{flag: bool(getattr(cfg, flag)) for flag in EAGLE31},
        "embed_requires_grad": bool(cfg.own_embedding),  # true: embed_tokens.weight is the head's own
        "eagle_aux_hidden_state_layer_ids": _layer_inputs(head),
        "speculators_config": {
            "algorithm": "eagle3",
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": speculative_tokens}],
            "default_proposal_method": "greedy",
            "verifier": {
                "name_or_path": name,
                "architectures": [cfg.target_architecture] if cfg.target_architecture else [],
            },
        },
        "dtype": export_dtype(head, dtype),
    }
    if note:
        config["verifier_note"] = note
    return config


def export_sglang(head: Eagle3Head, out: Path, *, dtype: torch.dtype | None = None, **_: Any) -> Path:
    """Write `out` in the official EAGLE-3 layout SGLang loads (`--speculative-draft-model-path out`).

    speculators cannot read this layout itself; its converter (`speculators convert`) keeps the layer
    ids only when given them: pass eagle_aux_hidden_state_layer_ids = these ids + 1."""
    if head.config.own_embedding:
        raise HeadError(
            "the head has its own trained embedding, which SGLang replaces with the target's: export it "
            "with --format speculators (vLLM)"
        )
    if head.config.num_layers > 1:
        raise HeadError(
            f"the head has {head.config.num_layers} decoder layers and SGLang's EAGLE-3 layout holds one: "
            "export it with --format speculators (vLLM)"
        )
    used = [flag for flag in EAGLE31 if getattr(head.config, flag)]
    if used:
        raise HeadError(
            f"the head uses the EAGLE-3.1 options {used}, which SGLang's EAGLE-3 layer does not run: "
            "export it with --format speculators (vLLM)"
        )
    layer = _llama_layer(head, allow_bias=False)  # SGLang's EAGLE-3 layer has no q/k/v or MLP biases
    cfg = head.config
    config = {
        "architectures": ["LlamaForCausalLMEagle3"],
        **layer,
        "vocab_size": cfg.vocab_size,
        "draft_vocab_size": cfg.draft_vocab_size,
        "eagle_config": {
            "eagle_aux_hidden_state_layer_ids": [i - 1 for i in _layer_inputs(head)],
            "use_aux_hidden_state": True,
        },
        # transformers 5 reads dtype; v4 engines and speculators' converter read torch_dtype
        "dtype": export_dtype(head, dtype),
        "torch_dtype": export_dtype(head, dtype),
    }
    return write_export(out, config, head.state_dict(), dtype)


def portable_verifier(name: str | None) -> tuple[str | None, str | None]:
    """(the verifier id to write, a note or None): a Hub id as is; a local path as its directory's name
    with a note saying so (a path would break on another machine)."""
    if not name:
        return None, None
    path = Path(name).expanduser()
    if _HUB_ID.fullmatch(name) and not path.exists():
        return name, None
    base = (path.resolve() if path.exists() else path).name
    note = (
        f"the head was trained on a local target whose directory is named {base!r}: set "
        "speculators_config.verifier.name_or_path to its Hub id or to its path on this machine"
    )
    return base, note


def _layer_inputs(head: Eagle3Head) -> list[int]:
    """The fused target layers as decoder-layer input ids 1..L-1 (HF hidden-state indices)."""
    return fused_layer_inputs(list(head.config.target_layers), head.config.target_num_layers)


def fused_layer_inputs(layers: list[int], depth: int) -> list[int]:
    """`layers` (HF hidden-state indices of a `depth`-layer target, 0 = unknown depth) checked to be what
    serving engines capture: decoder-layer inputs 1..L-1, strictly ascending; HeadError otherwise."""
    if any(i < 0 for i in layers):
        raise HeadError(
            f"target_layers {layers} are relative to a target depth the head does not record: "
            "set target_num_layers in its config.json"
        )
    if any(i < 1 or (depth and i >= depth) for i in layers):
        raise HeadError(
            f"target_layers {layers} include the embeddings (0) or the final normed state (L): serving "
            "engines feed heads the inputs of decoder layers 1..L-1 only"
        )
    if sorted(set(layers)) != list(layers):
        raise HeadError(
            f"target_layers {layers} are not strictly ascending: serving engines capture each layer "
            "once, in layer order, so fc would read its inputs in another order"
        )
    return list(layers)


def _llama_layer(head: Eagle3Head, allow_bias: bool) -> dict[str, Any]:
    """Llama fields of the decoder layers; HeadError unless their tensors are exactly a Llama EAGLE-3
    head's (the midlayer's with its hidden_norm, the extra layers' without)."""
    layer = llama_layer_fields(head.config.layer_config)
    if not allow_bias and (layer["attention_bias"] or layer["mlp_bias"]):
        raise HeadError("the head's layer has attention or MLP biases, which this format's Llama layer lacks")
    expected = {f"{p}.weight" for p in (*_PROJ, *_MLP, *_NORMS)}
    expected |= {f"{p}.bias" for p in _PROJ if layer["attention_bias"]}
    expected |= {f"{p}.bias" for p in _MLP if layer["mlp_bias"]}
    for i, module in enumerate(head.decoder_layers):
        actual = {name for name, _ in module.named_parameters()}
        wanted = expected if i == 0 else expected - {"hidden_norm.weight"}
        if actual != wanted:
            raise HeadError(
                f"the head's decoder layer ({head.config.layer_config.get('model_type')}) is not a Llama layer: "
                f"extra {sorted(actual - wanted)[:4]}, missing {sorted(wanted - actual)[:4]}"
            )
    return layer


def write_export(out: Path, config: dict[str, Any], tensors: dict, dtype: torch.dtype | None) -> Path:
    out.mkdir(parents=True, exist_ok=True)
    write_tensors(tensors, out / "model.safetensors", dtype)
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return out
