"""FP8 (e4m3) per-depth layers (heads/fp8.py): an `Fp8Linear` computes its `nn.Linear` to FP8 precision
(one scaled GEMM), and `to_fp8` swaps exactly a head's per-depth linear layers: EAGLE-3's decoder layer
and draft lm_head, EAGLE-1/2's layers, never `fc` or the target's lm_head."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from spechead.heads import Eagle3Config, Eagle3Head, EagleConfig, EagleHead, MedusaConfig, MedusaHead
from spechead.heads.fp8 import FP8, FP8_MAX, Fp8Linear, Fp8Rows, linears, stack_fp8, to_fp8


def relative_error(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.detach().float() - b.detach().float()).norm() / b.detach().float().norm())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("bias", [False, True])
def test_fp8_linear_is_the_linear_to_fp8_precision(dtype, bias):
    torch.manual_seed(0)
    linear = nn.Linear(64, 48, bias=bias).to(dtype)
    if bias:
        nn.init.normal_(linear.bias, std=1.0)  # large enough that a dropped bias shows
    fp8 = Fp8Linear(linear)
    x = torch.randn(3, 5, 64).to(dtype)  # (..., K): any leading dims
    y, ref = fp8(x), linear(x)
    assert y.shape == ref.shape and y.dtype == dtype
    assert fp8.weight_fp8.dtype == FP8 and fp8.weight_fp8.shape == (48, 64)
    assert relative_error(y, ref) < 0.06  # e4m3: 3 mantissa bits, about 3% per product
    assert relative_error(y, ref) > 1e-4  # (the weights really are e4m3, not a copy)
    # each weight row and each input row keeps its own scale: an outlier row (a value ~6e4 times the
    # others') leaves the others as exact as before (one scale for the whole tensor would push theirs
    # below e4m3's normal range); 6e4 is still an fp16 number
    with torch.no_grad():
        linear.weight[0] *= 1e4
    x[0, 0] = 6e4
    scaled, ref = Fp8Linear(linear)(x), linear(x)
    assert relative_error(scaled[..., 1:].flatten(0, 1)[1:], ref[..., 1:].flatten(0, 1)[1:]) < 0.06


def test_features_must_be_multiples_of_16():
    with pytest.raises(ValueError, match="multiples of 16, got 24 -> 48"):
        Fp8Linear(nn.Linear(24, 48))


def test_to_fp8_swaps_the_per_depth_layers_only(tiny_llama):
    target = tiny_llama(256, layers=4, hidden=32)
    eagle3 = Eagle3Head(Eagle3Config.from_target(target.config, draft_vocab_size=128))
    eagle3.attach_target_modules(lm_head=target.lm_head, embed_tokens=target.get_input_embeddings())
    assert to_fp8(eagle3) == 8  # q, k, v, o, gate, up, down and the draft lm_head
    mid = eagle3.midlayer
    attn, mlp = mid.self_attn, mid.mlp
    assert all(type(m) is Fp8Linear for m in (attn.o_proj, mlp.down_proj, eagle3.lm_head))
    assert all(
        type(m) is Fp8Rows for m in (attn.q_proj, attn.k_proj, attn.v_proj, mlp.gate_proj, mlp.up_proj)
    )
    assert type(eagle3.fc) is nn.Linear and type(target.lm_head) is nn.Linear
    deeper = Eagle3Head(Eagle3Config.from_target(target.config, draft_vocab_size=128, num_layers=3))
    assert to_fp8(deeper, stack=False) == 7 * 3 + 1  # every decoder layer's seven and the lm_head
    eagle = EagleHead(EagleConfig.from_target(target.config))
    eagle.attach_target_modules(lm_head=target.lm_head, embed_tokens=target.get_input_embeddings())
    assert to_fp8(eagle, stack=False) == 7 * len(eagle.layers) and type(target.lm_head) is nn.Linear
    assert all(type(m) is Fp8Linear for m in eagle.layers[0].modules() if "Fp8" in type(m).__name__)
    medusa = MedusaHead(MedusaConfig(hidden_size=32, vocab_size=256, num_heads=2, target_num_layers=4))
    assert to_fp8(medusa) == 0


def test_a_dtype_cast_keeps_the_e4m3_weights():
    """head.to(torch.bfloat16) after to_fp8: the weights stay e4m3 (a float8 tensor is a floating point
    one, which Module.to would cast), the output follows the new dtype."""
    torch.manual_seed(0)
    linear = nn.Linear(32, 16)
    fp8 = Fp8Linear(linear).to(torch.bfloat16)
    assert fp8.weight_fp8.dtype == FP8 and fp8.unit.dtype == fp8.weight_scale.dtype == torch.float32
    x = torch.randn(4, 32)
    y = fp8(x.bfloat16())
    assert y.dtype == torch.bfloat16 and relative_error(y, linear(x)) < 0.06


def test_a_head_with_fp8_layers_is_not_saved(tiny_llama, tmp_path):
    """FP8 layers are for drafting only: saving such a head (other tensor names, e4m3) would break it."""
    target = tiny_llama(256, layers=4, hidden=32)
    head = Eagle3Head(Eagle3Config.from_target(target.config, draft_vocab_size=128))
    to_fp8(head)
    with pytest.raises(ValueError, match="FP8 drafting layers"):
        head.save_pretrained(tmp_path / "head")
    assert not (tmp_path / "head").exists()


def test_layers_reading_one_input_quantize_it_once():
    """`linears` (q/k/v, gate/up in the fused step): the same outputs as each layer's own call."""
    from spechead.heads.fp8 import linears

    torch.manual_seed(0)
    q, k = Fp8Linear(nn.Linear(32, 64)), Fp8Linear(nn.Linear(32, 16))
    x = torch.randn(2, 3, 32)
    both = linears([q, k], x)
    assert [t.shape for t in both] == [(2, 3, 64), (2, 3, 16)]
    assert torch.equal(both[0], q(x)) and torch.equal(both[1], k(x))
    plain = nn.Linear(32, 8)  # a layer left wide (features not multiples of 16): each its own call
    mixed = linears([q, plain], x)
    assert torch.equal(mixed[0], q(x)) and torch.equal(mixed[1], plain(x))


def test_stacked_layers_are_their_rows_in_one_gemm(tiny_llama):
    """`to_fp8` stacks q/k/v and gate/up: the rows are views of one e4m3 weight (no copy), alone or
    through `linears` (one GEMM) they give the unstacked layers' outputs, and a cast or move reaches them."""
    target = tiny_llama(256, layers=4, hidden=32)
    torch.manual_seed(0)
    head = Eagle3Head(Eagle3Config.from_target(target.config, draft_vocab_size=128))
    for module in head.modules():  # biases on q/k/v (as Qwen2 has): stacked too
        if isinstance(module, nn.Linear) and module.out_features != 128:
            nn.init.normal_(module.weight, std=0.2)
    attn, mlp = head.midlayer.self_attn, head.midlayer.mlp
    attn.q_proj.bias = nn.Parameter(torch.randn(attn.q_proj.out_features))
    attn.k_proj.bias = nn.Parameter(torch.randn(attn.k_proj.out_features))
    attn.v_proj.bias = nn.Parameter(torch.randn(attn.v_proj.out_features))
    names = [(attn, "q_proj"), (attn, "k_proj"), (attn, "v_proj"), (mlp, "gate_proj"), (mlp, "up_proj")]
    alone = {n: Fp8Linear(getattr(parent, n)) for parent, n in names}  # the layers unstacked
    to_fp8(head)
    stacks = [attn.qkv_proj_fp8, mlp.gate_up_proj_fp8]
    e4m3 = [b for b in head.buffers() if b.dtype == FP8]
    # every e4m3 weight once: the rows hold none of their own
    assert sum(b.numel() for b in e4m3) == sum(m.weight_fp8.numel() for m in alone.values()) + sum(
        m.weight_fp8.numel() for m in (attn.o_proj, mlp.down_proj, head.lm_head)
    )
    assert [s.out_features for s in stacks] == [sum(alone[n].out_features for n in g) for g in
                                                (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))]  # fmt: skip
    x = torch.randn(2, 3, attn.q_proj.in_features)
    q, k, v = linears([attn.q_proj, attn.k_proj, attn.v_proj], x)
    for name, out in (("q_proj", q), ("k_proj", k), ("v_proj", v)):
        assert torch.equal(out, alone[name](x)) and torch.equal(getattr(attn, name)(x), out)
    h = torch.randn(4, mlp.gate_proj.in_features)
    gate, up = linears([mlp.gate_proj, mlp.up_proj], h)
    assert torch.equal(gate, alone["gate_proj"](h)) and torch.equal(up, alone["up_proj"](h))
    # not the stack's rows in order, or not all of them: each layer its own GEMM, the same outputs
    swapped = linears([attn.k_proj, attn.q_proj, attn.v_proj], x)
    assert torch.equal(swapped[0], k) and torch.equal(swapped[1], q) and torch.equal(swapped[2], v)
    assert torch.equal(linears([attn.q_proj, attn.k_proj], x)[1], k)
    head.to(torch.bfloat16)  # the rows follow their stack
    assert attn.v_proj(x.bfloat16()).dtype == torch.bfloat16 and attn.qkv_proj_fp8.weight_fp8.dtype == FP8
    assert stack_fp8(head) == 0  # already stacked


def test_layers_of_different_inputs_are_not_stacked():
    """A group stacks only when its layers read one width in one dtype with biases on all or none."""
    parent = nn.Module()
    parent.gate_proj, parent.up_proj = Fp8Linear(nn.Linear(32, 64)), Fp8Linear(nn.Linear(32, 48, bias=False))
    parent.q_proj, parent.k_proj, parent.v_proj = (Fp8Linear(nn.Linear(k, 16)) for k in (32, 32, 48))
    assert stack_fp8(parent) == 0 and type(parent.up_proj) is type(parent.q_proj) is Fp8Linear
    with pytest.raises(ValueError, match="one input width"):
        Fp8Linear.stacked([parent.q_proj, parent.v_proj])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_norms_fused_into_the_quantization(dtype):
    """`norm_quantized`: the rows of cat(rms_norm(x_i)) quantized as `quantize_rows` would, with no norm
    written: the same scales (each row's max after its norms) and the same values to e4m3 precision,
    for one part and for two (EAGLE-3's q/k/v input), an outlier in either part setting the row's scale."""
    from spechead.heads.fp8 import norm_quantized, quantize_rows

    torch.manual_seed(0)
    xs = [torch.randn(2, 3, 32).to(dtype), torch.randn(2, 3, 48).to(dtype)]
    ws = [(torch.rand(32) + 0.5).to(dtype), (torch.rand(48) * 3).to(dtype)]
    xs[0][0, 1, 5] = 40.0  # an outlier row in the first part, another in the second
    xs[1][1, 2, 7] = -90.0
    for n in (1, 2):
        parts = [(x, w, 1e-5) for x, w in zip(xs[:n], ws[:n])]
        ref = torch.cat(
            [F.rms_norm(x.float(), w.shape, w.float(), 1e-5) for x, w, _ in parts], -1
        )  # (2, 3, K)
        rows, scale = norm_quantized(parts)
        ref_rows, ref_scale = quantize_rows(ref)
        assert (
            rows.dtype == FP8 and rows.shape == ref_rows.shape == (6, ref.shape[-1]) and scale.shape == (6, 1)
        )
        torch.testing.assert_close(scale, ref_scale, rtol=1e-5, atol=0)
        assert relative_error(rows.float() * scale, ref.reshape(6, -1)) < 0.04  # e4m3's rounding
        assert (rows.float().abs().amax(1) == FP8_MAX).all()  # every row's max at e4m3's max
