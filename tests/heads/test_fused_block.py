"""heads/fused_block.py: DFlash's block forward as the fused functional chain equals `DFlashHead.forward`
for the layer kinds it accepts (Qwen3 with its per-head q/k norms, the default draft layer; Llama), with
sdpa and with the grouped matmul attention; other kinds are left to the module forward."""

from __future__ import annotations

import pytest
import torch

from spechead.heads import DFlashConfig, DFlashHead
from spechead.heads.decoder_layer import additive_mask
from spechead.heads.dflash import MASK
from spechead.heads.fused_block import fused_block

VOCAB, H = 64, 32


def _head(tiny_llama, layer: str, **overrides) -> DFlashHead:
    target = tiny_llama(VOCAB, layers=4, hidden=H)
    torch.manual_seed(1)
    config = DFlashConfig.from_target(target.config, layer, **{"block_size": 4, "num_layers": 2, **overrides})
    head = DFlashHead(config)
    with torch.no_grad():
        for p in head.parameters():  # away from the init (norms of ones): every weight matters
            p.add_(0.2 * torch.randn_like(p))
    head.attach_target_modules(target.get_output_embeddings(), target.get_input_embeddings())
    return head.eval()


@pytest.mark.parametrize("attention", ["sdpa", "matmul"])
@pytest.mark.parametrize("layer", ["qwen3", "llama"])
def test_fused_block_equals_the_module_forward(tiny_llama, layer, attention):
    """Two rows of other committed lengths, each block [root, MASK, ...] after its own context (the
    drafter's mask: the slots past a row's length hidden), through two layers."""
    head = _head(tiny_llama, layer)
    fused = fused_block(head)
    assert fused is not None
    fused.attention = attention
    gen = torch.Generator().manual_seed(2)
    batch, slots, size = 2, 9, head.config.block_size
    context = head.fuse([torch.randn(batch, slots, H, generator=gen) for _ in head.config.target_layers])
    kv = head.inject(context, torch.arange(slots).expand(batch, slots))  # per layer (B, kv, S, D)
    lengths = torch.tensor([9, 5])
    block = torch.full((batch, size), MASK)
    block[:, 0] = torch.tensor([3, 7])
    positions = lengths[:, None] + torch.arange(size)  # (B, bs)
    seen = torch.arange(slots)[None] < lengths[:, None]  # (B, S)
    allowed = torch.cat([seen, seen.new_ones(batch, size)], dim=1)[:, None].expand(-1, size, -1)
    mask = additive_mask(allowed, torch.float32)  # (B, 1, bs, S + bs)
    with torch.no_grad():
        ref = head(block, positions, kv, mask)
        new = fused(block, positions, kv, mask)
    tol = {"atol": 1e-6, "rtol": 1e-5} if attention == "sdpa" else {"atol": 1e-5, "rtol": 1e-4}
    torch.testing.assert_close(new, ref, **tol)


@pytest.mark.parametrize("layer", ["qwen3", "llama"])
def test_fused_inject_equals_the_modules(tiny_llama, layer):
    """A commit's context keys / values through the chain: `DFlashHead.inject`'s, every layer (the keys
    normed per head where the layer does, then rotated at the context's own positions)."""
    head = _head(tiny_llama, layer)
    fused = fused_block(head)
    assert fused is not None
    gen = torch.Generator().manual_seed(3)
    context = torch.randn(2, 5, H, generator=gen)
    positions = torch.tensor([[4, 5, 6, 7, 8], [0, 1, 2, 3, 4]])
    with torch.no_grad():
        ref, new = head.inject(context, positions), fused.inject(context, positions)
    assert len(new) == len(ref) == 2
    for (k, v), (rk, rv) in zip(new, ref):
        torch.testing.assert_close(k, rk, atol=1e-6, rtol=1e-5)
        torch.testing.assert_close(v, rv, atol=1e-6, rtol=1e-5)


def test_other_kinds_are_left_to_the_module_forward(tiny_llama):
    head = _head(tiny_llama, "qwen3")
    head.layers[1].mlp.act_fn = torch.nn.GELU()  # (a layer the chain does not write out)
    assert fused_block(head) is None
    assert fused_block(torch.nn.Linear(2, 2)) is None
