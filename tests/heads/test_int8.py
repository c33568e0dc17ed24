"""int8 drafting layers (heads/int8.py): an `Int8Linear` computes its `nn.Linear` to int8 precision (one
weight-only int8 GEMM, a scale per row), and `to_int8` swaps exactly the layers a draft reads every pass:
EAGLE-3's decoder layer and draft lm_head, EAGLE-1/2's layers, a Medusa head's own projections."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from spechead.heads import Eagle3Config, Eagle3Head, EagleConfig, EagleHead, MedusaConfig, MedusaHead
from spechead.heads.int8 import Int8Linear, to_int8


def relative_error(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.detach().float() - b.detach().float()).norm() / b.detach().float().norm())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("bias", [False, True])
def test_int8_linear_is_the_linear_to_int8_precision(dtype, bias):
    torch.manual_seed(0)
    linear = nn.Linear(64, 48, bias=bias).to(dtype)
    if bias:
        nn.init.normal_(linear.bias, std=1.0)  # large enough that a dropped bias shows
    int8 = Int8Linear(linear)
    x = torch.randn(3, 5, 64).to(dtype)  # (..., K): any leading dims
    y, ref = int8(x), linear(x)
    assert y.shape == ref.shape and y.dtype == dtype
    assert int8.weight_int8.dtype == torch.int8 and int8.weight_int8.shape == (48, 64)
    assert relative_error(y, ref) < 0.02  # 8 bits a weight, bfloat16 inputs
    assert relative_error(y, ref) > 1e-4  # (the weights really are int8, not a copy)
    # each weight rounded to the nearest step of its row's scale (not truncated)
    scale = int8.weight_scale.float()[:, None]  # [N, 1]
    step_error = (int8.weight_int8.float() * scale - linear.weight.detach().float()).abs() / scale  # [N, K]
    assert float(step_error.max()) <= 0.51 and int8.weight_int8.abs().max() == 127
    # each weight row keeps its own scale: a row 1e4 times the others leaves theirs as exact as before
    # (one scale for the whole tensor would round every other row to zero)
    with torch.no_grad():
        linear.weight[0] *= 1e4
    scaled, ref = Int8Linear(linear)(x), linear(x)
    assert relative_error(scaled[..., 1:], ref[..., 1:]) < 0.02


def test_an_input_of_any_layout_is_taken():
    """A transposed or strided input (the kernel refuses one not contiguous on its last dimension)."""
    torch.manual_seed(0)
    linear = nn.Linear(32, 16)
    int8 = Int8Linear(linear)
    x = torch.randn(4, 32)
    for other in (x.t().contiguous().t(), torch.stack([x, x], -1)[..., 0], x.bfloat16().t().contiguous().t()):
        assert not other.is_contiguous() and torch.equal(int8(other), int8(x.to(other.dtype)))


def test_in_features_must_be_a_multiple_of_16():
    """(the CPU kernel crashes the process on other widths: refused before it runs)"""
    with pytest.raises(ValueError, match="multiple of 16, got 24 -> 48"):
        Int8Linear(nn.Linear(24, 48))
    assert Int8Linear(nn.Linear(32, 7))(torch.randn(2, 32)).shape == (2, 7)  # any out_features


def test_to_int8_swaps_the_layers_a_draft_reads(tiny_llama):
    target = tiny_llama(256, layers=4, hidden=32)
    eagle3 = Eagle3Head(Eagle3Config.from_target(target.config, draft_vocab_size=128))
    eagle3.attach_target_modules(lm_head=target.lm_head, embed_tokens=target.get_input_embeddings())
    assert to_int8(eagle3) == 8  # q, k, v, o, gate, up, down and the draft lm_head
    attn, mlp = eagle3.midlayer.self_attn, eagle3.midlayer.mlp
    swapped = (
        attn.q_proj,
        attn.k_proj,
        attn.v_proj,
        attn.o_proj,
        mlp.gate_proj,
        mlp.down_proj,
        eagle3.lm_head,
    )
    assert all(type(m) is Int8Linear for m in swapped)
    assert type(eagle3.fc) is nn.Linear and type(target.lm_head) is nn.Linear  # once per accept; the target's
    eagle = EagleHead(EagleConfig.from_target(target.config))
    eagle.attach_target_modules(lm_head=target.lm_head, embed_tokens=target.get_input_embeddings())
    assert to_int8(eagle) == 7 * len(eagle.layers) and type(target.lm_head) is nn.Linear
    medusa = MedusaHead(MedusaConfig(hidden_size=32, vocab_size=256, num_heads=3, target_num_layers=4))
    assert to_int8(medusa) == 3  # each head's projection
    for block in medusa.heads:
        assert type(block[-1]) is Int8Linear and type(block[0].linear) is nn.Linear  # ResBlocks stay
    shared = MedusaHead(
        MedusaConfig(hidden_size=32, vocab_size=256, num_heads=2, target_num_layers=4, share_lm_head=True)
    )
    shared.attach_target_modules(lm_head=target.lm_head)
    assert to_int8(shared) == 0 and type(target.lm_head) is nn.Linear  # the target's lm_head: never


def test_a_layer_too_narrow_stays_as_it_is():
    medusa = MedusaHead(MedusaConfig(hidden_size=24, vocab_size=64, num_heads=2, target_num_layers=4))
    assert to_int8(medusa) == 0 and all(type(block[-1]) is nn.Linear for block in medusa.heads)


def test_a_cast_keeps_the_int8_weights_and_bfloat16_scales():
    """head.to(torch.float16) after to_int8: the weights stay int8 and the scales bfloat16 (the kernel
    takes no other), the output follows the new dtype."""
    torch.manual_seed(0)
    linear = nn.Linear(32, 16)
    int8 = Int8Linear(linear).to(torch.float16)
    assert int8.weight_int8.dtype == torch.int8 and int8.weight_scale.dtype == torch.bfloat16
    x = torch.randn(4, 32)
    y = int8(x.half())
    assert y.dtype == torch.float16 and relative_error(y, linear(x)) < 0.02


def test_a_head_with_int8_layers_is_not_saved(tmp_path):
    """int8 layers are for drafting only: saving such a head (other tensor names) would break it."""
    head = MedusaHead(MedusaConfig(hidden_size=32, vocab_size=64, num_heads=2, target_num_layers=4))
    to_int8(head)
    with pytest.raises(ValueError, match="int8 drafting layers"):
        head.save_pretrained(tmp_path / "head")
    assert not (tmp_path / "head").exists()
