"""heads/fused.py: the drafting step as a short functional chain equals `head.step` exactly, on every
cache kind drafting uses, for the layer kinds it accepts; other kinds are left to `head.step`."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoConfig, DynamicCache

from spechead.heads.eagle import EagleConfig, EagleHead
from spechead.heads.eagle3 import Eagle3Config, Eagle3Head
from spechead.heads.fused import fused_logits, fused_medusa_logits, fused_step, grouped_attention
from spechead.heads.medusa import MedusaConfig, MedusaHead, ResBlock
from spechead.inference.target.cache import RowCache

V, H = 48, 32
COMMON = dict(vocab_size=V, hidden_size=H, intermediate_size=40, num_hidden_layers=4, num_attention_heads=4)
CONFIGS = {
    "llama": dict(num_key_value_heads=2),  # grouped-query attention
    "mistral": dict(num_key_value_heads=4),
    "qwen2": dict(num_key_value_heads=2),  # q/k/v biases
    "llama-rope3": dict(
        num_key_value_heads=2,
        rope_parameters={
            "rope_type": "llama3",
            "rope_theta": 500.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 16,
        },
    ),  # fmt: skip
    "qwen3-own": dict(num_key_value_heads=2, head_dim=8),  # the target's own layer: per-head q/k norms
}


def make_head(model_type: str, family: str, **kw):
    extra = CONFIGS[model_type]
    cfg = AutoConfig.for_model(model_type.split("-")[0], **COMMON, **extra)
    layer = "target" if model_type.endswith("-own") else "llama"
    torch.manual_seed(0)
    if family == "eagle3":
        head = Eagle3Head(Eagle3Config.from_target(cfg, layer, draft_vocab_size=V, **kw))
    else:
        head = EagleHead(EagleConfig.from_target(cfg, layer, **kw))
    for p in head.parameters():  # away from the identity-like init: every weight matters
        p.data.add_(0.2 * torch.randn_like(p))
    embed = torch.nn.Embedding(V, H)
    head.attach_target_modules(lm_head=torch.nn.Linear(H, V, bias=False), embed_tokens=embed)
    return head.eval()


def cache_of(kind: str, layers: int, batch: int):
    if kind == "dynamic":
        return DynamicCache()
    return RowCache(layers, batch, 96)  # "row": written in a row; "batch": at named slots


def run(step, cache, kind, feats, ids, mask=None, positions=None):
    if kind == "batch":  # writes go to explicit slots, reads over the first view_length slots
        batch, q = ids.shape
        start = 0 if mask is None else mask.shape[-1] - q
        cache.write_slots = (start + torch.arange(q)).expand(batch, q)
        cache.view_length = start + q
        if mask is None:
            mask = torch.zeros(batch, 1, q, q).masked_fill_(~torch.ones(q, q, dtype=torch.bool).tril(), -1e30)
            positions = torch.arange(q).expand(batch, q)
    return step(feats, ids, mask, positions, cache)


@pytest.mark.parametrize("model_type", list(CONFIGS))
@pytest.mark.parametrize("family", ["eagle3", "eagle3-3-layers", "eagle", "eagle-2-layers"])
@pytest.mark.parametrize("kind", ["row", "dynamic", "batch"])
@pytest.mark.parametrize("attention", ["sdpa", "matmul"])
def test_fused_step_equals_the_module_step(model_type, family, kind, attention) -> None:
    kw = {
        "eagle-2-layers": {"num_layers": 2, "first_layer_input_norm": False},
        "eagle3-3-layers": {"num_layers": 3},  # (the fused first layer, then plain ones)
    }.get(family, {})
    head = make_head(model_type, family.split("-")[0], **kw)
    fused = fused_step(head)
    assert fused is not None
    fused.attention = attention  # (both blocks below are few queries: matmul serves them all)
    tol = (
        {"atol": 1e-6, "rtol": 1e-6} if attention == "sdpa" else {"atol": 1e-5, "rtol": 1e-4}
    )  # (sums' order)
    layers = kw.get("num_layers", 1)
    batch = 2 if kind == "batch" else 1
    gen = torch.Generator().manual_seed(1)
    feats = torch.randn(batch, 12, H, generator=gen)
    ids = torch.randint(0, V, (batch, 12), generator=gen)
    ref_cache, new_cache = cache_of(kind, layers, batch), cache_of(kind, layers, batch)
    with torch.no_grad():
        # a causal block (commit), then a tree block: 3 nodes at explicit positions under a mask
        ref = run(head.step, ref_cache, kind, feats, ids)
        new = run(fused, new_cache, kind, feats, ids)
        torch.testing.assert_close(new, ref, **tol)
        if kind == "row":
            ref_cache.set_length(12)
            new_cache.set_length(12)
        mask = torch.zeros(batch, 1, 3, 15)
        mask[:, 0, 2, 13] = torch.finfo(torch.float32).min  # node 2 does not see node 1
        positions = torch.tensor([[12, 13, 13]]).expand(batch, 3)
        ref = run(head.step, ref_cache, kind, feats[:, :3] * 2, ids[:, 3:6], mask, positions)
        new = run(fused, new_cache, kind, feats[:, :3] * 2, ids[:, 3:6], mask, positions)
    torch.testing.assert_close(new, ref, **tol)
    for a, b in zip(ref_cache.layers, new_cache.layers):  # the same keys/values were written
        torch.testing.assert_close(b.keys[..., :15, :], a.keys[..., :15, :], **tol)
        torch.testing.assert_close(b.values[..., :15, :], a.values[..., :15, :], **tol)


@pytest.mark.parametrize("groups", [1, 4])
@pytest.mark.parametrize("mask", ["additive", "bool", "none"])
def test_grouped_attention_is_sdpa(groups, mask) -> None:
    """Each key head's group of query heads (query head h reads key head h // groups, as sdpa's
    enable_gqa and transformers' repeat_kv) under an additive, boolean or no mask."""
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(2, 2 * groups, 5, 8, generator=gen)  # (B, nh, T, D)
    k, v = torch.randn(2, 2, 2, 30, 8, generator=gen)  # (B, kv, S, D) each
    allowed = torch.rand(2, 1, 5, 30, generator=gen) > 0.4  # (B, 1, T, S)
    allowed[..., 0] = True
    m = {"additive": torch.zeros(allowed.shape).masked_fill(~allowed, torch.finfo(torch.float32).min),
         "bool": allowed, "none": None}[mask]  # fmt: skip
    ref = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=m, scale=0.3, enable_gqa=True)
    torch.testing.assert_close(grouped_attention(q, k, v, m, 0.3), ref, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("mask", ["additive", "bool"])
def test_grouped_attention_keeps_a_row_that_sees_no_key_finite(mask) -> None:
    """A query that may see no key (a left-padded row of a batch): its output is finite, as sdpa's (whose
    kernels give 0 there), and the other rows are sdpa's; a NaN would reach every row of the next layer
    through the padded position's values."""
    gen = torch.Generator().manual_seed(0)
    q, k, v = torch.randn(1, 4, 3, 8, generator=gen), *torch.randn(2, 1, 2, 5, 8, generator=gen)
    allowed = torch.ones(1, 1, 3, 5, dtype=torch.bool)
    allowed[0, 0, 0] = False  # query 0 sees nothing
    m = (
        allowed
        if mask == "bool"
        else torch.zeros(allowed.shape).masked_fill(~allowed, torch.finfo(torch.float32).min)
    )
    out = grouped_attention(q, k, v, m, 0.3)  # (B, nh, T, D)
    ref = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=m, scale=0.3, enable_gqa=True)
    assert out.isfinite().all()
    torch.testing.assert_close(out[:, :, 1:], ref[:, :, 1:], atol=1e-6, rtol=1e-5)


def test_matmul_attention_serves_only_few_queries(monkeypatch) -> None:
    """attention="matmul" runs `grouped_attention` for up to FEW_QUERIES queries; longer blocks (a
    prompt's pairs) keep sdpa, and "sdpa" never runs it. "auto" (the default) runs it on a device in
    GROUPED_DEVICES (a GPU; here the CPU put in its place), sdpa elsewhere."""
    from spechead.heads import attention
    from spechead.heads import fused as fused_module

    calls = []
    monkeypatch.setattr(fused_module, "FEW_QUERIES", 5)
    monkeypatch.setattr(
        fused_module, "grouped_attention", lambda *a: calls.append(1) or grouped_attention(*a)
    )
    head = make_head("llama", "eagle3")
    fused = fused_step(head)
    feats, ids = torch.randn(1, 12, H), torch.randint(0, V, (1, 12))
    with torch.no_grad():
        fused(feats[:, :3], ids[:, :3], None, None, RowCache(1, 1, 32))
        assert fused.attention == "auto" and calls == []  # the default: sdpa on a CPU
        monkeypatch.setattr(attention, "GROUPED_DEVICES", ("cpu",))
        fused(feats[:, :3], ids[:, :3], None, None, RowCache(1, 1, 32))
        assert calls == [1]  # matmuls on a grouped device
        fused.attention = "sdpa"
        fused(feats[:, :3], ids[:, :3], None, None, RowCache(1, 1, 32))
        assert calls == [1]
        fused.attention = "matmul"
        fused(feats, ids, None, None, RowCache(1, 1, 32))
        assert calls == [1]  # 12 > 5 queries
        fused(feats[:, :5], ids[:, :5], None, None, RowCache(1, 1, 32))
    assert calls == [1, 1]


def test_angles_follow_a_grown_cache() -> None:
    head = make_head("llama", "eagle3")
    fused = fused_step(head)
    feats, ids = torch.randn(1, 1, H), torch.randint(0, V, (1, 1))
    with torch.no_grad():
        for length in (100, 300, 700):  # positions past the first table: it is rebuilt
            ref_cache, new_cache = RowCache(1, 1, length + 1), RowCache(1, 1, length + 1)
            for cache in (ref_cache, new_cache):
                cache.set_length(0)
            mask, pos = torch.zeros(1, 1, 1, 1), torch.tensor([[length]])
            ref = head.step(feats, ids, mask, pos, ref_cache)
            new = fused(feats, ids, mask, pos, new_cache)
            torch.testing.assert_close(new, ref, atol=1e-6, rtol=1e-6)


def test_other_layer_kinds_are_left_to_the_module_step() -> None:
    cfg = AutoConfig.for_model("llama", num_key_value_heads=2, hidden_act="gelu", **COMMON)
    assert fused_step(EagleHead(EagleConfig.from_target(cfg))) is None
    assert fused_step(torch.nn.Linear(2, 2)) is None


@pytest.mark.parametrize("model_type", list(CONFIGS))
def test_fused_logits_equal_the_module_logits(model_type) -> None:
    """EAGLE-3's final norm as one op: the same draft-vocab logits as `head.logits` (EAGLE-1/2 have no
    norm before the target's lm_head: nothing to fuse)."""
    head = make_head(model_type, "eagle3")
    with torch.no_grad():
        head.norm.weight.uniform_(0.5, 1.5)  # a trained norm's weight is not all ones
        hidden = torch.randn(2, 5, H, generator=torch.Generator().manual_seed(2)) * 3
        fused = fused_logits(head)
        assert fused is not None
        torch.testing.assert_close(fused(hidden), head.logits(hidden), atol=1e-5, rtol=1e-5)
    assert fused_logits(make_head(model_type, "eagle")) is None


def test_a_head_with_its_own_embedding_drafts_with_it() -> None:
    """own_embedding (EAGLE-3): the fused step embeds with the head's table, as head.step does, not with
    the attached target embedding (which would give other outputs)."""
    cfg = AutoConfig.for_model("llama", **COMMON, **CONFIGS["llama"])
    torch.manual_seed(0)
    head = Eagle3Head(Eagle3Config.from_target(cfg, draft_vocab_size=V, own_embedding=True))
    head.attach_target_modules(
        lm_head=torch.nn.Linear(H, V, bias=False), embed_tokens=torch.nn.Embedding(V, H)
    )
    fused = fused_step(head.eval())
    assert fused is not None
    gen = torch.Generator().manual_seed(4)
    feats, ids = torch.randn(1, 6, H, generator=gen), torch.randint(0, V, (1, 6), generator=gen)
    with torch.no_grad():
        ref = head.step(feats, ids, None, None, DynamicCache())
        new = fused(feats, ids, None, None, DynamicCache())
        torch.testing.assert_close(new, ref, atol=1e-6, rtol=1e-6)
        head.embed_tokens.weight.copy_(head.target_embed_tokens.weight)  # the target's table: other drafts
        assert not torch.allclose(fused(feats, ids, None, None, DynamicCache()), ref, atol=1e-3)


class _ScaledEmbedding(torch.nn.Embedding):
    """An embedding with its own forward (as Gemma scales its embeddings)."""

    def forward(self, ids):
        return super().forward(ids) * 3.0


@pytest.mark.parametrize("family", ["eagle3", "eagle"])
def test_modules_replaced_after_fused_step_are_the_ones_used(family) -> None:
    """The fused step reads submodules and weights when it runs (not kept from its creation): a
    projection swapped in later and a subclassed target embedding (its own forward) both count."""
    head = make_head("llama", family)
    fused = fused_step(head)
    assert fused is not None
    layer = head.midlayer if family == "eagle3" else head.layers[0]
    old = layer.self_attn.q_proj
    layer.self_attn.q_proj = torch.nn.Linear(old.in_features, old.out_features, bias=False)
    head.attach_target_modules(embed_tokens=_ScaledEmbedding(V, H))
    gen = torch.Generator().manual_seed(3)
    feats, ids = torch.randn(1, 6, H, generator=gen), torch.randint(0, V, (1, 6), generator=gen)
    with torch.no_grad():
        ref = head.step(feats, ids, None, None, DynamicCache())
        new = fused(feats, ids, None, None, DynamicCache())
    torch.testing.assert_close(new, ref, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("shared", [False, True])
def test_fused_medusa_logits_equal_the_module_logits(shared) -> None:
    """Medusa's heads without module calls: the same logits as `head_logits`, bit for bit, with its own
    projections or the target's shared (bf16) lm_head; blocks swapped in later are the ones used."""
    cfg = MedusaConfig(
        hidden_size=H, vocab_size=V, num_heads=3, num_layers=2, target_num_layers=2, share_lm_head=shared
    )
    head = MedusaHead(cfg)
    gen = torch.Generator().manual_seed(4)
    with torch.no_grad():
        for p in head.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.2)
    if shared:
        head.attach_target_modules(lm_head=torch.nn.Linear(H, V, bias=False).to(torch.bfloat16))
    fused = fused_medusa_logits(head)
    assert fused is not None
    hidden = torch.randn(2, 5, H, generator=gen)
    with torch.no_grad():
        for k in range(3):
            out, ref = fused(k, hidden), head.head_logits(k, hidden)
            assert out.dtype == ref.dtype and torch.equal(out, ref), k
        head.heads[1][0].act = torch.nn.GELU()  # no longer a plain block: it runs its own forward
        head.heads[2][1] = ResBlock(H)  # a new block (the identity) in place of the old one
        for k in (1, 2):
            assert torch.equal(fused(k, hidden), head.head_logits(k, hidden)), k
    assert fused_medusa_logits(head) is None  # a head made with another block kind keeps its modules


def test_a_peagle_heads_future_positions_embed_as_its_step() -> None:
    """P-EAGLE's fused step (EAGLE-3's) embeds its future positions' MASK_ID with the head's learned mask
    embedding, as `head.step` does (the plain embedding table has no such row)."""
    from spechead.heads.peagle import MASK_ID, PEagleConfig, PEagleHead

    cfg = AutoConfig.for_model("llama", **COMMON, **CONFIGS["llama"])
    torch.manual_seed(0)
    head = PEagleHead(PEagleConfig.from_target(cfg, draft_vocab_size=V, block_size=4))
    for p in head.parameters():
        p.data.add_(0.2 * torch.randn_like(p))
    head.attach_target_modules(
        lm_head=torch.nn.Linear(H, V, bias=False), embed_tokens=torch.nn.Embedding(V, H)
    )
    fused = fused_step(head.eval())
    assert fused is not None
    gen = torch.Generator().manual_seed(3)
    future_hidden, future_ids = head.future_inputs(1, 3)
    feats = torch.cat([torch.randn(1, 5, H, generator=gen), future_hidden], dim=1)  # (1, 8, H)
    ids = torch.cat([torch.randint(0, V, (1, 5), generator=gen), future_ids], dim=1)  # MASK_ID at 5..7
    assert (ids[0, 5:] == MASK_ID).all()
    with torch.no_grad():
        ref = head.step(feats, ids, None, None, DynamicCache())
        new = fused(feats, ids, None, None, DynamicCache())
    torch.testing.assert_close(new, ref, atol=1e-6, rtol=1e-6)
