"""DFlash head: config checks, the block mask (what a block query sees), the context injected into every
layer, the batched multi-anchor forward equal to one forward per anchor, and the save / load round trip."""

from __future__ import annotations

import pytest
import torch

from spechead.heads import DFlashConfig, DFlashHead, load_head
from spechead.heads.decoder_layer import additive_mask
from spechead.heads.dflash import MASK, block_layout, block_mask
from spechead.heads.errors import HeadError
from spechead.heads.families import family_of

VOCAB = 64


def _head(tiny_llama, **overrides) -> tuple[DFlashHead, torch.nn.Module]:
    target = tiny_llama(VOCAB, layers=4, hidden=32)
    torch.manual_seed(1)
    head = DFlashHead(
        DFlashConfig.from_target(target.config, **{"block_size": 4, "num_layers": 2, **overrides})
    )
    head.attach_target_modules(target.get_output_embeddings(), target.get_input_embeddings())
    return head.eval(), target


def _context(head: DFlashHead, batch: int, length: int) -> torch.Tensor:
    states = [torch.randn(batch, length, head.config.hidden_size) for _ in head.config.target_layers]
    return head.fuse(states)  # (B, T, H)


def test_config_defaults_and_checks(tiny_llama):
    config = DFlashConfig.from_target(tiny_llama(VOCAB, layers=8).config)
    assert config.target_layers == [2, 4, 5] and config.block_size == 16 and config.num_layers == 1
    assert family_of(config).name == "dflash"
    assert family_of(config).work(DFlashConfig.from_target(tiny_llama(VOCAB).config, num_layers=3)) == (
        1,
        VOCAB,
        3,
        2.0,  # T block queries over T context + T block keys
    )
    with pytest.raises(HeadError, match="block_size must be >= 2"):
        DFlashConfig.from_target(tiny_llama(VOCAB).config, block_size=1)
    with pytest.raises(HeadError, match="num_layers"):
        DFlashConfig.from_target(tiny_llama(VOCAB).config, num_layers=0)
    with pytest.raises(HeadError, match="mask_token_id"):
        DFlashConfig.from_target(tiny_llama(VOCAB).config, mask_token_id=VOCAB)


def test_block_layout_and_mask_by_hand():
    ids = torch.arange(10, 20)[None]  # (1, 10)
    anchors = torch.tensor([[2, 5]])
    block_ids, positions = block_layout(ids, anchors, 3)
    assert block_ids.tolist() == [[13, MASK, MASK, 16, MASK, MASK]]
    assert positions.tolist() == [[3, 4, 5, 6, 7, 8]]
    valid = torch.ones(1, 10, dtype=torch.bool)
    valid[0, 1] = False  # padding: never seen
    allowed = block_mask(anchors, valid, 3)[0]  # (6, 16)
    assert allowed.shape == (6, 16)
    assert allowed[0, :10].tolist() == [True, False, True] + [False] * 7  # up to and including anchor 2
    assert allowed[3, :10].tolist() == [True, False, True, True, True, True] + [False] * 4
    assert allowed[:3, 10:].tolist() == [[True] * 3 + [False] * 3] * 3  # own block, both directions
    assert allowed[3:, 10:].tolist() == [[False] * 3 + [True] * 3] * 3


def test_a_block_sees_its_context_and_block_and_nothing_else(tiny_llama):
    """Anchor c's block changes with the context at c and with its own first token, not with the context at
    c + 1 nor with another anchor's block (an off-by-one mask fails here)."""
    head, _ = _head(tiny_llama)
    torch.manual_seed(2)
    context, ids = _context(head, 1, 12), torch.randint(0, VOCAB, (1, 12))
    anchors = torch.tensor([[3, 7]])
    with torch.no_grad():
        base = head.predict_blocks(context, ids, anchors)  # (1, 2, 4, H)

        def changed(ctx=context, tokens=ids) -> list[bool]:
            out = head.predict_blocks(ctx, tokens, anchors)
            return [not torch.allclose(out[0, a], base[0, a], atol=1e-6) for a in range(2)]

        at = lambda t: context.index_add(1, torch.tensor([t]), torch.ones(1, 1, context.shape[-1]))  # noqa: E731
        assert changed(ctx=at(3)) == [True, True]  # the anchor itself is context of both
        assert changed(ctx=at(4)) == [False, True]  # after anchor 3: only the later anchor's context
        assert changed(ctx=at(8)) == [False, False]  # after both anchors
        other = ids.clone()
        other[0, 8] = (ids[0, 8] + 1) % VOCAB  # block 1's first token x_{7+1}
        assert changed(tokens=other) == [False, True]


def test_many_anchors_in_one_forward_equal_one_forward_per_anchor(tiny_llama):
    head, _ = _head(tiny_llama)
    torch.manual_seed(3)
    context, ids = _context(head, 2, 10), torch.randint(0, VOCAB, (2, 10))
    anchors = torch.tensor([[1, 4, 6], [0, 5, 8]])
    with torch.no_grad():
        together = head.predict_blocks(context, ids, anchors)  # (2, 3, 4, H)
        for b in range(2):
            for a in range(3):
                c = int(anchors[b, a])
                alone = head.predict_blocks(
                    context[b : b + 1, : c + 1], ids[b : b + 1, : c + 2], anchors[b : b + 1, a : a + 1]
                )
                torch.testing.assert_close(together[b, a], alone[0, 0], atol=1e-5, rtol=1e-5)


def test_the_context_reaches_every_layer(tiny_llama):
    """With layer 0's attention silenced, the blocks still depend on the context: through the K/V
    injected into layer 1 (a head that injects into its first layer only fails here)."""
    head, _ = _head(tiny_llama)
    with torch.no_grad():
        head.layers[0].self_attn.o_proj.weight.zero_()
        context, ids = _context(head, 1, 8), torch.randint(0, VOCAB, (1, 8))
        anchors = torch.tensor([[5]])
        before = head.predict_blocks(context, ids, anchors)
        after = head.predict_blocks(context + 1.0, ids, anchors)
    assert not torch.allclose(before, after, atol=1e-4)


def test_mask_token_id_uses_the_target_embedding(tiny_llama):
    head, target = _head(tiny_llama, mask_token_id=7)
    assert not hasattr(head, "mask_embedding")
    ids = torch.tensor([[3, MASK]])
    torch.testing.assert_close(head.embed_block(ids)[0, 1], target.get_input_embeddings().weight[7].detach())
    learned, _ = _head(tiny_llama)
    torch.testing.assert_close(learned.embed_block(ids)[0, 1], learned.mask_embedding.detach())


def test_save_load_round_trip_and_target_check(tiny_llama, tmp_path):
    head, target = _head(tiny_llama, num_layers=3)
    head.save_pretrained(tmp_path / "h")
    loaded = load_head(tmp_path / "h")
    assert isinstance(loaded, DFlashHead) and loaded.config == head.config
    loaded.attach_target_modules(target.get_output_embeddings(), target.get_input_embeddings())
    context, ids = _context(head, 1, 9), torch.randint(0, VOCAB, (1, 9))
    anchors = torch.tensor([[2, 6]])
    with torch.no_grad():
        torch.testing.assert_close(
            loaded.predict_blocks(context, ids, anchors), head.predict_blocks(context, ids, anchors)
        )
    with pytest.raises(HeadError, match="hidden_size 32.*target has 48"):
        loaded.check_target(48, VOCAB, 4)
    with pytest.raises(HeadError, match="vocab_size 64.*target has 65"):
        loaded.check_target(32, VOCAB + 1, 4)


def test_a_qwen3_layer_with_key_norms_is_injected_like_its_own_attention(tiny_llama):
    """draft_layer=target on a Qwen3 target: the context keys go through the layer's k_norm. With the
    context equal to the block's normed inputs, injecting them equals running the block causally over
    them, the layer's own path (a missing k_norm or rotation fails here)."""
    from transformers import Qwen3Config

    config = Qwen3Config(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=8)  # fmt: skip
    torch.manual_seed(4)
    head = DFlashHead(DFlashConfig.from_target(config, "target", block_size=2, num_layers=1)).eval()
    layer = head.layers[0]
    x = torch.randn(1, 5, 32)
    positions = torch.arange(5)[None]
    with torch.no_grad():
        keys, values = head.inject(layer.input_layernorm(x), positions)[0]
        captured = {}

        class Record:
            def update(self, k, v, layer_idx, **kwargs):
                captured["k"], captured["v"] = k, v
                return k, v

        layer.self_attn(hidden_states=layer.input_layernorm(x), position_embeddings=head.rotary(x, positions),
                        attention_mask=None, cache=Record())  # fmt: skip
    torch.testing.assert_close(keys, captured["k"])
    torch.testing.assert_close(values, captured["v"])


def test_block_mask_rows_never_empty():
    allowed = block_mask(torch.tensor([[0]]), torch.zeros(1, 3, dtype=torch.bool), 2)
    assert allowed.any(-1).all()  # a block always sees itself (an empty row is NaN under sdpa)
    assert additive_mask(allowed, torch.float32).shape == (1, 1, 2, 5)
