"""EagleHead: config, shapes, causal/padded/cached passes agree, frozen target modules, save/load."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file
from transformers import DynamicCache

from spechead.heads import WEIGHTS_NAME, HeadError, load_head
from spechead.heads.eagle import EagleConfig, EagleHead

H, V, L = 32, 48, 3


@pytest.fixture(scope="module")
def target(tiny_llama):
    return tiny_llama(V, layers=L, hidden=H).requires_grad_(False)  # frozen, as the trainer keeps it


def make_head(target, **kw) -> EagleHead:
    torch.manual_seed(1)
    head = EagleHead(EagleConfig.from_target(target.config, **kw)).eval()
    head.attach_target_modules(lm_head=target.lm_head, embed_tokens=target.get_input_embeddings())
    return head


def inputs(batch: int = 2, seq: int = 7) -> tuple[torch.Tensor, torch.Tensor]:
    torch.manual_seed(2)
    return torch.randn(batch, seq, H), torch.randint(0, V, (batch, seq))


def test_config_from_target(target) -> None:
    cfg = EagleConfig.from_target(target.config)
    assert cfg.target_layers == [L]  # the final normed state, what the target's lm_head sees
    assert (cfg.hidden_size, cfg.vocab_size, cfg.target_num_layers) == (H, V, L)
    assert cfg.target_architecture == "LlamaForCausalLM" and cfg.layer_config["model_type"] == "llama"
    assert EagleConfig.from_dict(cfg.to_dict()) == cfg
    with pytest.raises(HeadError, match="exactly one"):
        EagleConfig.from_target(target.config, target_layers=[1, 2])
    with pytest.raises(HeadError, match="num_layers"):
        EagleConfig.from_target(target.config, num_layers=0)
    with pytest.raises(HeadError, match="layer_config hidden_size"):
        EagleConfig.from_target(target.config, hidden_size=64)


def test_shapes_logits_and_frozen_target_modules(target) -> None:
    head = make_head(target, num_layers=2)
    features, ids = inputs()
    out = head(features, ids)
    assert out.shape == features.shape
    assert head.logits(out).shape == (2, 7, V) and head.logits(out).dtype == torch.float32
    names = {n for n, _ in head.named_parameters()}
    assert all(n.startswith(("fc.", "layers.0.", "layers.1.")) for n in names), names
    assert head.fc.in_features == 2 * H and head.fc.bias is not None
    head.logits(out).sum().backward()
    assert head.fc.weight.grad is not None
    assert target.lm_head.weight.grad is None
    embed = target.get_input_embeddings().requires_grad_(True)  # even an unfrozen embedding gets none
    try:
        head(features, ids).sum().backward()
        assert embed.weight.grad is None
    finally:
        embed.requires_grad_(False)
    bare = EagleHead(head.config)
    with pytest.raises(HeadError, match="no target embed_tokens"):
        bare(features, ids)


def test_causal_padded_and_cached_passes_agree(target) -> None:
    head = make_head(target)
    features, ids = inputs()
    with torch.no_grad():
        full = head(features, ids)
        changed_tail = head(torch.cat([features[:, :4], torch.randn(2, 3, H)], 1), ids)
        assert torch.allclose(full[:, :4], changed_tail[:, :4], atol=1e-6)  # causal
        # Left padding + shifted positions give the same outputs at the real tokens.
        pad_features = torch.cat([torch.randn(2, 2, H), features], 1)
        pad_ids = torch.cat([torch.zeros(2, 2, dtype=torch.long), ids], 1)
        mask = torch.cat([torch.zeros(2, 2), torch.ones(2, 7)], 1)
        positions = (torch.arange(9) - 2).clamp(min=0).expand(2, 9)
        padded = head(pad_features, pad_ids, position_ids=positions, attention_mask=mask)
        torch.testing.assert_close(padded[:, 2:], full, atol=1e-5, rtol=1e-5)
        # Prefix in one pass, then one token at a time through the cache.
        cache = DynamicCache()
        parts = [head(features[:, :4], ids[:, :4], past_key_values=cache)]
        for t in range(4, 7):
            parts.append(head(features[:, t : t + 1], ids[:, t : t + 1], past_key_values=cache))
        assert cache.get_seq_length() == 7
        torch.testing.assert_close(torch.cat(parts, 1), full, atol=1e-5, rtol=1e-5)


def test_save_load_round_trip_holds_only_head_weights(target, tmp_path) -> None:
    head = make_head(target, attn_implementation="eager")
    head.save_pretrained(tmp_path)
    keys = set(load_file(str(tmp_path / WEIGHTS_NAME)))
    assert keys and all(k.startswith(("fc.", "layers.0.")) for k in keys), keys
    assert not any("embed" in k or "lm_head" in k or "inv_freq" in k for k in keys)
    loaded = load_head(tmp_path)
    assert isinstance(loaded, EagleHead) and loaded.config == head.config
    loaded.attach_target_modules(lm_head=target.lm_head, embed_tokens=target.get_input_embeddings())
    features, ids = inputs()
    with torch.no_grad():
        assert torch.equal(loaded(features, ids), head(features, ids))


def test_bf16_cast_keeps_rotary_frequencies_fp32(target) -> None:
    head = make_head(target).to(torch.bfloat16)
    assert head.fc.weight.dtype == torch.bfloat16
    assert head.rotary.module.inv_freq.dtype == torch.float32
    features, ids = inputs()
    assert head(features, ids).dtype == torch.bfloat16


def test_two_layers_keep_their_own_cache_entries(target) -> None:
    """Each decoder layer appends its K/V under its own layer index: a two-layer head decoding token by
    token through the cache computes what one full pass does."""
    head = make_head(target, num_layers=2)
    features, ids = inputs()
    with torch.no_grad():
        full = head(features, ids)
        cache = DynamicCache()
        parts = [head(features[:, :3], ids[:, :3], past_key_values=cache)]
        for t in range(3, 7):
            parts.append(head(features[:, t : t + 1], ids[:, t : t + 1], past_key_values=cache))
    assert len(cache.layers) == 2 and cache.get_seq_length() == 7
    torch.testing.assert_close(torch.cat(parts, 1), full, atol=1e-5, rtol=1e-5)


def test_logits_are_fp32_through_a_bf16_target_lm_head(target) -> None:
    """A bf16 target keeps a bf16 lm_head; the head's logits (loss, sampling) are fp32 all the same."""
    head = make_head(target)
    lm_head = torch.nn.Linear(H, V, bias=False).to(torch.bfloat16)
    head.attach_target_modules(lm_head=lm_head)
    features = torch.randn(1, 3, H)
    logits = head.logits(features)
    assert logits.dtype == torch.float32
    assert torch.equal(logits, lm_head(features.to(torch.bfloat16)).float())
