"""Hybrid targets: models with layers that keep recurrent state (Mamba / SSM, linear attention, short
convolutions) next to or instead of attention (Qwen3-Next, Falcon-H1, Jamba, NemotronH, Bamba, Zamba,
Granite-4 hybrids, MiniMax, LFM2, ...).

Tree verification relies on every layer being attention: a tree's nodes are keys behind a mask and the
rejected ones are simply dropped from a KV cache. A recurrent layer folds every token it sees into one
state, so a tree pass (siblings run in one sequence) corrupts it and rejected drafts cannot be cropped
out: speculative decoding there would silently differ from the target's own decoding. `recurrent_layers`
is the ONE detector (inference refuses such targets; training uses it too); it reads only the config.
"""

from __future__ import annotations

# layer kinds that hold only attention or feed-forward blocks (layer_types / layers_block_type values)
ATTENTION_KINDS = frozenset(
    {"full_attention", "sliding_attention", "chunked_attention", "attention", "mlp", "moe", "dummy"}
)
# model types whose layers are all recurrent or hybrid without saying so in a per-layer field
RECURRENT_MODELS = frozenset({"mamba", "mamba2", "falcon_mamba", "falcon_h1", "rwkv", "xlstm", "lfm2_moe"})
# NemotronH's hybrid_override_pattern: M = Mamba-2, * = attention, - = MLP, E = MoE
_PATTERN_KINDS = {"M": "mamba"}


def recurrent_layers(config) -> list[str]:
    """The kinds of the model's layers that keep recurrent state, sorted ([] for an attention-only model).

    Reads `layer_types` (Qwen3-Next "linear_attention", Falcon-H1 "hybrid", LFM2 "conv"),
    `layers_block_type` (Jamba "mamba", NemotronH), NemotronH's `hybrid_override_pattern` and the model
    type for all-recurrent models (Mamba, RWKV, Falcon-H1); a composite config's text config counts."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    kinds: set[str] = set()
    for field in ("layer_types", "layers_block_type", "block_types"):
        values = getattr(text, field, None)
        if isinstance(values, (list, tuple)):
            kinds.update(str(v) for v in values if str(v) not in ATTENTION_KINDS)
    pattern = getattr(text, "hybrid_override_pattern", None)
    if isinstance(pattern, str):
        kinds.update(_PATTERN_KINDS[c] for c in pattern if c in _PATTERN_KINDS)
    model_type = getattr(text, "model_type", "")
    if not kinds and model_type in RECURRENT_MODELS:
        kinds.add(model_type)
    return sorted(kinds)


def check_attention_only(
    config, what: str, fix: str = "decode it with transformers' generate, or use an attention-only target"
) -> None:
    """ValueError (one line, naming the architecture and `fix`) when `config`'s model has recurrent-state
    layers, which `what` (e.g. "speculative decoding") cannot handle."""
    kinds = recurrent_layers(config)
    if kinds:
        text = config.get_text_config() if hasattr(config, "get_text_config") else config
        arch = (getattr(config, "architectures", None) or [getattr(text, "model_type", "this model")])[0]
        raise ValueError(
            f"{arch} is a hybrid model ({', '.join(kinds)} layers keep a recurrent state that token-tree "
            f"verification cannot roll back): {what} is not supported for it; {fix}"
        )


def refuse_flash(config, what: str, fix: str) -> None:
    """ValueError when `config`'s attention (flash) takes no arbitrary 4D (tree) masks, which `what` needs."""
    impl = getattr(config, "_attn_implementation", None) or ""
    if "flash" in impl:
        raise ValueError(
            f"{what} needs arbitrary 4D masks; attn_implementation {impl!r} cannot take them ({fix})"
        )
