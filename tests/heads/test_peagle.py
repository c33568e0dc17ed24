"""PEagleHead: config, parameters, the parallel mask (every anchor's block equals what decoding that anchor
alone computes), the partitioned training forward equal to the one forward, and save/load."""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache

from spechead.heads import HeadError, PEagleConfig, PEagleHead, load_head
from spechead.heads.families import family_named, family_of
from spechead.heads.peagle import MASK_ID, parallel_allowed

H, V, L, VD, K = 32, 48, 8, 20, 4


@pytest.fixture(scope="module")
def target(tiny_llama):
    return tiny_llama(V, layers=L, hidden=H).requires_grad_(False)


def make_head(target, **kw) -> PEagleHead:
    torch.manual_seed(1)
    config = PEagleConfig.from_target(target.config, **{"draft_vocab_size": VD, "block_size": K, **kw})
    head = PEagleHead(config).eval()
    head.attach_target_modules(lm_head=target.lm_head, embed_tokens=target.get_input_embeddings())
    with torch.no_grad():  # larger mask vectors than the init, so a wrong mask shows in the outputs
        head.mask_hidden.normal_()
        head.mask_embedding.normal_()
    return head


def inputs(batch: int = 2, seq: int = 10, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(batch, seq, H, generator=gen), torch.randint(0, V, (batch, seq), generator=gen)


def test_config_and_registration(target) -> None:
    cfg = PEagleConfig.from_target(target.config, draft_vocab_size=VD)
    assert cfg.block_size == 8 and cfg.target_layers == [2, 4, 5]
    assert PEagleConfig.from_dict(cfg.to_dict()) == cfg
    for bad in (1, 0, 2.5, True):
        with pytest.raises(HeadError, match="block_size must be an int >= 2"):
            PEagleConfig.from_target(target.config, draft_vocab_size=VD, block_size=bad)
    for bad in (0, 1.5, True, "2"):
        with pytest.raises(HeadError, match="num_layers must be an int >= 1"):
            PEagleConfig.from_target(target.config, draft_vocab_size=VD, num_layers=bad)
    assert family_of(cfg) is family_named("peagle")
    assert family_named("peagle").work(cfg) == (8, VD, 8, 64.0)  # one (T * K)^2 mask
    deeper = PEagleConfig.from_target(target.config, draft_vocab_size=VD, num_layers=3)
    assert family_named("peagle").work(deeper) == (8, VD, 24, 64.0)  # K positions through 3 layers each


def test_parameters_are_eagle3_plus_the_two_mask_vectors(target) -> None:
    head = make_head(target)
    extra = {"mask_hidden", "mask_embedding"}
    assert extra <= set(dict(head.named_parameters()))
    assert {
        n for n in head.state_dict() if not n.startswith(("midlayer.", "fc.", "norm.", "lm_head."))
    } == extra | {
        "d2t",
        "t2d",
    }
    deeper = {n.split(".")[1] for n in make_head(target, num_layers=3).state_dict() if n.startswith("extra_")}
    assert deeper == {"0", "1"}  # the plain layers after the midlayer (a one-layer head has none)


def test_embed_maps_the_mask_id_to_the_learned_embedding(target) -> None:
    head = make_head(target)
    ids = torch.tensor([[3, MASK_ID, 5]])
    out = head.embed(ids)
    assert torch.equal(out[0, 1], head.mask_embedding.detach())
    assert torch.equal(out[0, 0], target.get_input_embeddings()(torch.tensor(3)))
    out.sum().backward()  # the mask embedding learns; the frozen target embedding does not
    assert head.mask_embedding.grad is not None and head.mask_embedding.grad.abs().sum() > 0


def test_mask_rule_on_a_small_case() -> None:
    """T = 4 real entries, anchors [1, 2], K = 3: future (i, j) sees real <= anchor and its own block <= j."""
    allowed = parallel_allowed(torch.ones(1, 4, dtype=torch.bool), torch.tensor([1, 2]), 3)[0].int()
    expected = torch.tensor(
        [  # r0 r1 r2 r3 | a1j1 a1j2 | a2j1 a2j2
            [1, 0, 0, 0, 0, 0, 0, 0],
            [1, 1, 0, 0, 0, 0, 0, 0],
            [1, 1, 1, 0, 0, 0, 0, 0],
            [1, 1, 1, 1, 0, 0, 0, 0],
            [1, 1, 0, 0, 1, 0, 0, 0],  # anchor 1, j=1
            [1, 1, 0, 0, 1, 1, 0, 0],  # anchor 1, j=2
            [1, 1, 1, 0, 0, 0, 1, 0],  # anchor 2, j=1
            [1, 1, 1, 0, 0, 0, 1, 1],  # anchor 2, j=2
        ]
    )
    assert torch.equal(allowed, expected)


@torch.no_grad()
def test_every_anchor_block_equals_decoding_that_anchor_alone(target) -> None:
    """The one forward over all anchors gives, for each anchor a, exactly what decoding computes from the
    prefix 0..a alone (a causal pass, then the block): a mask that lets a block see another anchor's block
    or a real token after its anchor (off by one either way) changes these outputs."""
    head = make_head(target)
    fused, ids = inputs()
    seq = ids.shape[1]
    next_ids = torch.cat([ids[:, 1:], torch.zeros_like(ids[:, :1])], dim=1)
    anchors = torch.arange(seq)
    real, future = head.parallel_forward(fused, ids, anchors)
    assert real.shape == (2, seq, H) and future.shape == (2, seq, K - 1, H)
    for a in range(seq):
        alone = head.draft_block(fused[:, : a + 1], next_ids[:, : a + 1], DynamicCache())  # (B, K, H)
        torch.testing.assert_close(real[:, a], alone[:, 0], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(future[:, a], alone[:, 1:], rtol=1e-5, atol=1e-5)
    logits = head.parallel_logits(fused, ids, anchors[2:5])
    assert logits.shape == (2, 3, K, VD)
    torch.testing.assert_close(logits[:, :, 1:], head.logits(future[:, 2:5]))


@torch.no_grad()
@pytest.mark.parametrize("layers", [1, 3])
def test_draft_block_after_a_cache_equals_one_pass(target, layers) -> None:
    """Decoding: the prefix committed into the cache in pieces, then the block, equals one pass."""
    head = make_head(target, num_layers=layers)
    fused, ids = inputs(seq=9, seed=3)
    next_ids = torch.cat([ids[:, 1:], torch.zeros_like(ids[:, :1])], dim=1)
    whole = head.draft_block(fused, next_ids, DynamicCache())
    cache = DynamicCache()
    head.step(fused[:, :5], next_ids[:, :5], None, None, cache)
    torch.testing.assert_close(head.draft_block(fused[:, 5:], next_ids[:, 5:], cache), whole)
    assert cache.get_seq_length() == 9 + K - 1  # the block's K - 1 entries are the caller's to drop


@pytest.mark.parametrize("layers", [1, 3])
def test_partitioned_forward_equals_the_one_forward(target, layers) -> None:
    """Training's partitions (the real pass once, then a few anchors' blocks over every layer's keys)
    compute the same outputs and the same gradients as the one forward over every anchor."""
    head = make_head(target, num_layers=layers)
    fused, ids = inputs(seq=8, seed=5)
    mask = torch.ones_like(ids)
    mask[1, 6:] = 0  # a padded row
    anchors = torch.arange(8)
    real, future = head.parallel_forward(fused, ids, anchors, mask)
    (real.sum() + future.pow(2).sum()).backward()
    one = {n: p.grad.clone() for n, p in head.named_parameters() if p.grad is not None}
    head.zero_grad()
    real2, kv = head.real_forward(fused, ids, mask)
    assert len(kv) == layers
    parts = [head.block_forward(kv, mask.bool(), anchors[i : i + 3]) for i in range(0, 8, 3)]
    future2 = torch.cat(parts, dim=1)
    torch.testing.assert_close(real2, real, rtol=1e-5, atol=1e-5)
    keep = mask.bool()[:, :, None, None].expand_as(future)  # padded anchors' outputs are garbage anyway
    torch.testing.assert_close(future2[keep], future[keep].detach(), rtol=1e-5, atol=1e-5)
    (real2.sum() + sum(p.pow(2).sum() for p in parts)).backward()
    for name, grad in one.items():
        torch.testing.assert_close(dict(head.named_parameters())[name].grad, grad, rtol=1e-4, atol=1e-5)


def test_save_load_round_trip(target, tmp_path) -> None:
    head = make_head(target, block_size=5)
    head.save_pretrained(tmp_path / "h")
    loaded = load_head(tmp_path / "h")
    assert isinstance(loaded, PEagleHead) and loaded.config == head.config and loaded.block_size == 5
    loaded.attach_target_modules(lm_head=target.lm_head, embed_tokens=target.get_input_embeddings())
    fused, ids = inputs()
    anchors = torch.tensor([0, 4, 9])
    with torch.no_grad():
        torch.testing.assert_close(
            loaded.parallel_logits(fused, ids, anchors), head.parallel_logits(fused, ids, anchors)
        )
    assert torch.equal(loaded.mask_hidden, head.mask_hidden)
