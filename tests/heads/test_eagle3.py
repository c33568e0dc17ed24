"""Eagle3Head: config, published parameter names, draft vocab, and the training-time test (TTT)
reproducing step-by-step chain drafting exactly (what inference will do with a tree)."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoConfig, DynamicCache

from spechead.heads import HeadError, load_head
from spechead.heads.decoder_layer import additive_mask, causal_allowed, layer_config_from
from spechead.heads.eagle3 import (
    Eagle3Config,
    Eagle3Head,
    default_eagle3_layers,
)
from spechead.heads.peagle import PEagleConfig, PEagleHead
from spechead.heads.unroll import ttt_allowed, ttt_forward, ttt_valid

H, V, L, VD = 32, 48, 8, 20


@pytest.fixture(scope="module")
def target(tiny_llama):
    return tiny_llama(V, layers=L, hidden=H).requires_grad_(False)


def make_head(target, **kw) -> Eagle3Head:
    torch.manual_seed(1)
    head = Eagle3Head(Eagle3Config.from_target(target.config, **{"draft_vocab_size": VD, **kw})).eval()
    head.attach_target_modules(lm_head=target.lm_head, embed_tokens=target.get_input_embeddings())
    return head


def test_config_defaults_and_errors(target) -> None:
    cfg = Eagle3Config.from_target(target.config, draft_vocab_size=VD)
    assert cfg.target_layers == default_eagle3_layers(L) == [2, 4, 5]
    assert cfg.ttt_steps == 7 and Eagle3Config.from_dict(cfg.to_dict()) == cfg
    assert Eagle3Config.from_target(target.config).draft_vocab_size == V
    with pytest.raises(HeadError, match="head.draft_vocab_size"):
        Eagle3Config.from_target(target.config, draft_vocab_size=V + 1)
    with pytest.raises(HeadError, match="exactly 3"):
        Eagle3Config.from_target(target.config, target_layers=[1, 2])
    with pytest.raises(HeadError, match=">= 4 layers"):
        Eagle3Config.from_target(target.config, target_num_layers=3)


def test_parameter_names_match_published_eagle3_heads(target) -> None:
    head = make_head(target)
    names = set(head.state_dict())
    proj = {f"midlayer.self_attn.{p}_proj.weight" for p in "qkvo"}
    mlp = {f"midlayer.mlp.{p}_proj.weight" for p in ("gate", "up", "down")}
    norms = {f"midlayer.{n}.weight" for n in ("input_layernorm", "hidden_norm", "post_attention_layernorm")}
    assert names == proj | mlp | norms | {"fc.weight", "norm.weight", "lm_head.weight", "d2t", "t2d"}
    assert head.midlayer.self_attn.q_proj.in_features == 2 * H and head.fc.in_features == 3 * H
    assert head.lm_head.out_features == VD and head.d2t.dtype == torch.long and head.t2d.dtype == torch.bool


def test_fc_reads_the_states_low_mid_high(target) -> None:
    """fuse: fc's input columns are [low | mid | high] in target_layers order, the layout of published
    heads and of what serving engines feed them: columns 0..H-1 multiply the lowest layer's state."""
    head = make_head(target)
    with torch.no_grad():
        head.fc.weight.zero_()
        head.fc.weight[:, :H] = torch.eye(H)  # the low block alone, as the identity
        head.fc.weight[:, 2 * H :] = 2 * torch.eye(H)  # twice the high block
    low, mid, high = (torch.randn(1, 3, H) for _ in range(3))
    torch.testing.assert_close(head.fuse([low, mid, high]), low + 2 * high)


def test_shapes_and_bf16_cast(target) -> None:
    head = make_head(target)
    hs = [torch.randn(2, 5, H) for _ in range(3)]
    fused = head.fuse(hs)
    out = head.step(fused, torch.randint(0, V, (2, 5)))
    assert fused.shape == out.shape == (2, 5, H) and head.logits(out).shape == (2, 5, VD)
    head.to(torch.bfloat16)
    assert head.d2t.dtype == torch.long and head.t2d.dtype == torch.bool
    assert head.rotary.module.inv_freq.dtype == torch.float32
    assert head.step(head.fuse(hs), torch.randint(0, V, (2, 5))).dtype == torch.bfloat16


def test_other_llama_like_architectures_build_and_others_are_refused() -> None:
    common = dict(
        vocab_size=40, hidden_size=32, intermediate_size=48, num_hidden_layers=4, num_attention_heads=4
    )
    qwen2 = AutoConfig.for_model("qwen2", num_key_value_heads=2, **common)
    head = Eagle3Head(Eagle3Config.from_target(qwen2, draft_layer="target", draft_vocab_size=10))
    assert (
        head.midlayer.self_attn.q_proj.in_features == 64 and head.midlayer.self_attn.q_proj.bias is not None
    )
    gemma2 = AutoConfig.for_model("gemma2", num_key_value_heads=2, head_dim=8, **common)
    with pytest.raises(HeadError, match="Llama-like"):
        Eagle3Head(Eagle3Config.from_target(gemma2, draft_layer="target", draft_vocab_size=10))
    assert layer_config_from(gemma2)["model_type"] == "gemma2"
    # The default draft layer is a Llama layer sized from the target (Gemma-2: gelu, head_dim 8, 2 KV heads).
    llama = Eagle3Head(Eagle3Config.from_target(gemma2, draft_vocab_size=10))
    assert type(llama.midlayer).__name__ == "LlamaDecoderLayer"
    attn = llama.midlayer.self_attn
    assert (attn.q_proj.in_features, attn.q_proj.out_features, attn.k_proj.out_features) == (64, 32, 16)
    assert llama.config.layer_config["hidden_act"] == "gelu_pytorch_tanh"


def test_ttt_allowed_pattern() -> None:
    allowed = ttt_allowed(torch.ones(1, 4, dtype=torch.bool), 2)[0].int()  # (4, 12)
    # Step 2 at t=3: step-0 keys s <= 1, step-1 key at s = 2, step-2 key at s = 3.
    assert allowed[3].tolist() == [1, 1, 0, 0] + [0, 0, 1, 0] + [0, 0, 0, 1]
    assert allowed[2].tolist() == [1, 0, 0, 0] + [0, 1, 0, 0] + [0, 0, 1, 0]
    assert (allowed.sum(-1) >= 1).all()  # no empty row, even at t < step
    padded = ttt_allowed(torch.tensor([[False, True, True, True]]), 0)[0].int()
    assert padded[3].tolist() == [0, 1, 1, 1]


def test_ttt_valid() -> None:
    mask = torch.tensor([[1, 1, 1, 1, 1, 1], [0, 0, 1, 1, 1, 0]])
    assert ttt_valid(mask, 0).int().tolist() == [[1, 1, 1, 1, 1, 0], [0, 0, 1, 1, 0, 0]]
    assert ttt_valid(mask, 2).int().tolist() == [[0, 0, 1, 1, 1, 0], [0, 0, 0, 0, 0, 0]]
    assert ttt_valid(mask, 1).int().tolist() == [[0, 1, 1, 1, 1, 0], [0, 0, 0, 1, 0, 0]]


def chain_as_inference(head, fused, ids, key_ok, t: int, j: int) -> torch.Tensor:
    """o^j_t the way decoding computes it: a causal pass over positions 0..t-j into a fresh cache,
    then j single-token steps, each feeding the previous output with the next true token."""
    batch, root = fused.shape[0], t - j
    cache = DynamicCache()
    mask = additive_mask(causal_allowed(key_ok[:, : root + 1]), torch.float32)
    positions = torch.arange(root + 1).expand(batch, -1)
    hidden = head.step(fused[:, : root + 1], ids[:, 1 : root + 2], mask, positions, cache)[:, -1:]
    for i in range(1, j + 1):
        keys = torch.cat([key_ok[:, : root + 1], torch.ones(batch, i, dtype=torch.bool)], 1)[:, None, :]
        position = torch.full((batch, 1), root + i)
        next_id = ids[:, root + i + 1 : root + i + 2]
        hidden = head.step(hidden, next_id, additive_mask(keys, torch.float32), position, cache)
    return hidden[:, 0]  # (B, H)


@pytest.mark.parametrize("impl", ["sdpa", "eager"])
def test_ttt_output_equals_step_by_step_chain_drafting(target, impl) -> None:
    head = make_head(target, attn_implementation=impl)
    torch.manual_seed(3)
    batch, seq, steps = 2, 10, 4
    fused = torch.randn(batch, seq, H)
    ids = torch.randint(0, V, (batch, seq))
    attention_mask = torch.ones(batch, seq, dtype=torch.long)
    attention_mask[1, :2] = 0  # left padding in row 1
    with torch.no_grad():
        outs = ttt_forward(head, fused, ids, attention_mask, steps)
        assert len(outs) == steps and all(o.shape == (batch, seq, H) for o in outs)
        checked = 0
        for j in range(steps):
            valid = ttt_valid(attention_mask, j)
            for t in (j, j + 2, seq - 2):
                expected = chain_as_inference(head, fused, ids, attention_mask.bool(), t, j)
                rows = valid[:, t]
                torch.testing.assert_close(outs[j][rows, t], expected[rows], atol=1e-5, rtol=1e-5)
                checked += int(rows.sum())
        assert checked >= 2 * steps * 2
        # Not trivially equal: step j >= 1 differs from step 0 at the same position.
        assert not torch.allclose(outs[1][:, 5], outs[0][:, 5], atol=1e-3)


def test_ttt_gradients_reach_every_head_parameter(target) -> None:
    head = make_head(target).train()
    states = [torch.randn(1, 6, H) for _ in range(3)]
    outs = ttt_forward(head, head.fuse(states), torch.randint(0, V, (1, 6)), None, 3)
    (head.logits(outs[-1]) ** 2).sum().backward()
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in head.parameters())


def test_draft_vocab_maps_and_survives_save_load(target, tmp_path) -> None:
    head = make_head(target)
    chosen = torch.tensor(sorted({0, 3, 5, *range(10, 27)}))  # VD target ids, ascending
    t2d = torch.zeros(V, dtype=torch.bool)
    t2d[chosen] = True
    head.set_draft_vocab(chosen - torch.arange(VD), t2d)
    draft = torch.arange(VD)
    assert torch.equal(head.draft_to_target(draft), chosen)
    assert torch.equal(head.target_to_draft(chosen), draft)
    assert head.target_to_draft(torch.tensor([1, 47])).tolist() == [-1, -1]
    with pytest.raises(HeadError, match="disagree"):
        head.set_draft_vocab(torch.zeros(VD, dtype=torch.long), t2d)
    with pytest.raises(HeadError, match="head.draft_vocab_size"):
        head.set_draft_vocab(torch.zeros(VD + 1, dtype=torch.long), t2d)
    head.init_lm_head_from_target_(target.lm_head.weight)
    assert torch.equal(head.lm_head.weight, target.lm_head.weight[chosen])
    head.save_pretrained(tmp_path)
    loaded = load_head(tmp_path)
    assert isinstance(loaded, Eagle3Head)
    assert torch.equal(loaded.d2t, head.d2t) and torch.equal(loaded.t2d, head.t2d)


@pytest.mark.parametrize("family", ["eagle3", "peagle"])
def test_own_embedding_is_read_trained_and_saved(target, tmp_path, family) -> None:
    """own_embedding: the head embeds with its own table (V, H), never the attached target's; gradients
    reach it; init_embedding_from_target_ starts it from the target's; save / load keeps it."""
    cls, config = (Eagle3Head, Eagle3Config) if family == "eagle3" else (PEagleHead, PEagleConfig)
    torch.manual_seed(1)
    head = cls(config.from_target(target.config, draft_vocab_size=VD, own_embedding=True))
    head.attach_target_modules(lm_head=target.lm_head, embed_tokens=target.get_input_embeddings())
    assert head.embed_tokens.weight.shape == (V, H) and "embed_tokens.weight" in head.state_dict()
    assert "embed_tokens.weight" not in make_head(target).state_dict()  # off by default
    ids = torch.randint(0, V, (2, 5))
    assert torch.equal(head.embed(ids), head.embed_tokens(ids))
    assert not torch.allclose(head.embed(ids), target.get_input_embeddings()(ids), atol=1e-2)
    outs = ttt_forward(
        head, head.fuse([torch.randn(1, 6, H) for _ in range(3)]), torch.randint(0, V, (1, 6)), None, 2
    )
    (head.logits(outs[-1]) ** 2).sum().backward()
    assert head.embed_tokens.weight.grad is not None and head.embed_tokens.weight.grad.abs().sum() > 0
    head.init_embedding_from_target_(target.get_input_embeddings().weight)
    assert torch.equal(head.embed_tokens.weight, target.get_input_embeddings().weight)
    with torch.no_grad():
        head.embed_tokens.weight.add_(torch.randn(V, H))  # trained away from the target's
    head.save_pretrained(tmp_path)
    loaded = load_head(tmp_path)
    assert type(loaded) is cls and loaded.config.own_embedding
    assert torch.equal(loaded.embed_tokens.weight, head.embed_tokens.weight)
    with pytest.raises(HeadError, match="nothing to initialise"):
        make_head(target).init_embedding_from_target_(target.get_input_embeddings().weight)
