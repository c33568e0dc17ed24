"""int8 weights for a drafting head's big per-pass layers on a CPU: a quarter of the bytes float32 reads.

On a CPU the draft is bound by the bytes it reads, not by its arithmetic: between two drafts the
target's forward evicts the head's weights from the caches, so each draft reads them again from memory
(the demo's Medusa-2 heads, four 2048 x 192 projections: a draft 1.13 ms after a target forward, 0.47 ms
in int8; scripts/bench_cold_ops.py --medusa HEAD). `Int8Linear` keeps W as int8 [N, K] with one bfloat16
scale per output row and multiplies with `torch._weight_int8pack_mm` (x in bfloat16, one kernel: the
CPU's weight-only int8 GEMM).
Verification stays exact (the target checks every drafted token), so a coarser draft can only change
WHICH tokens are proposed, never the output: decoding stays lossless. The GPU's counterpart is FP8
(heads/fp8.py); `_weight_int8pack_mm` is a CPU kernel.

`to_int8(head)` swaps, in place: an EAGLE / EAGLE-3 head's per-depth layers (`fp8.per_depth_linears`:
its decoder layer, EAGLE-3's lm_head), a Medusa head's own vocabulary projections (not its ResBlocks,
a hundredth of the bytes, nor a shared lm_head, which is the target's). For decoding only: not for
training or saving (`save_pretrained` refuses such a head).
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from spechead.heads.fp8 import per_depth_linears

INT8_MAX = 127
# `_weight_int8pack_mm` reads K in blocks of 16 (other widths crash the process, torch 2.13)
K_MULTIPLE = 16


class Int8Linear(nn.Module):
    """y = x W^T (+ b) from an `nn.Linear` whose in_features are a multiple of 16: W stored as int8
    [N, K] with a bfloat16 scale per row [N]; x (..., K) cast to bfloat16 for the GEMM, y (..., N) back
    in the layer's own dtype."""

    weight_int8: Tensor  # [N, K] (buffers: a frozen drafting layer)
    weight_scale: Tensor  # [N] bfloat16
    bias: Tensor | None

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        n, k = linear.out_features, linear.in_features
        if k % K_MULTIPLE:
            raise ValueError(
                f"int8 GEMMs need in_features that are a multiple of {K_MULTIPLE}, got {k} -> {n}"
            )
        weight = linear.weight.detach().float()  # [N, K]
        # [N]: each row's max -> 127, in bfloat16 (what the GEMM multiplies by) before the weights are
        # divided by it: each weight then within half a step of its int8 value times the scale
        scale = (weight.abs().amax(dim=1).clamp(min=1e-12) / INT8_MAX).to(torch.bfloat16)
        quantized = (weight / scale.float()[:, None]).round().clamp(-INT8_MAX, INT8_MAX).to(torch.int8)
        self.in_features, self.out_features, self.dtype = k, n, linear.weight.dtype
        self.register_buffer("weight_int8", quantized)  # [N, K]
        self.register_buffer("weight_scale", scale)  # [N]
        self.register_buffer("bias", None if linear.bias is None else linear.bias.detach().clone())

    def _apply(self, fn, recurse=True):  # noqa: ANN001, ANN202 - nn.Module's own signature
        """`.to(device)` moves the int8 weights and the bfloat16 scales as they are (the GEMM takes no
        other scale dtype); a dtype cast (`head.to(torch.float16)`) changes only the output's dtype and
        the bias."""
        scale = self.weight_scale
        self.dtype = fn(torch.zeros((), dtype=self.dtype, device=scale.device)).dtype  # where casts go
        out = super()._apply(fn, recurse)
        self.weight_scale = scale.to(fn(scale).device)
        return out

    def forward(self, x: Tensor) -> Tensor:
        """(..., K) -> (..., N) in the layer's dtype."""
        rows = x.reshape(-1, self.in_features).to(torch.bfloat16).contiguous()  # [M, K] (the kernel's rule)
        y = torch._weight_int8pack_mm(rows, self.weight_int8, self.weight_scale)  # [M, N] bfloat16
        y = y.view(*x.shape[:-1], self.out_features).to(self.dtype)
        return y if self.bias is None else y + self.bias

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"
        )


def int8_linears(head: nn.Module) -> list[tuple[nn.Module, str]]:
    """(parent module, attribute) of the `nn.Linear`s a draft reads every pass or depth: an EAGLE head's
    per-depth layers, a Medusa head's own projections (the last module of each of its `heads`)."""
    found = per_depth_linears(head)
    medusa_heads = getattr(head, "heads", None)
    if not found and isinstance(medusa_heads, nn.ModuleList):
        for block in medusa_heads:
            last = next(reversed(block._modules), None)
            if last is not None and type(block._modules[last]) is nn.Linear:
                found.append((block, last))
    return found


def to_int8(head: nn.Module) -> int:
    """Swap the head's `int8_linears` for `Int8Linear`s in place (those whose in_features are not a
    multiple of 16 stay as they are); returns how many were swapped (0: none to swap)."""
    swapped = 0
    for parent, name in int8_linears(head):
        linear = getattr(parent, name)
        if linear.in_features % K_MULTIPLE == 0:
            setattr(parent, name, Int8Linear(linear))
            swapped += 1
    return swapped
