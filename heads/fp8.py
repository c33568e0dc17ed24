"""FP8 (e4m3) weights for a drafting head's per-depth layers: half the bytes bf16 reads per draft depth.

Decoding at batch 1 is bound by the bytes read: an EAGLE-3 head for an 8B target reads about 680 MB per
draft depth in bf16 (its decoder layer and its draft-vocab lm_head), so 7 depths cost at least 22% of a
target step on an H100 (`scripts/bench_gpu.py`: the draft floor). In e4m3 the same depth reads half.
Verification stays exact (the target checks every drafted token), so a coarser draft can only change
WHICH tokens are proposed, never the output: decoding stays lossless.

`Fp8Linear` keeps W as e4m3 [N, K] with one scale per output row, quantizes x with one scale per row
and multiplies with one `torch._scaled_mm` (an FP8 tensor-core GEMM on Ada, Hopper and later) at unit
scales; the outer product of the two scales multiplies the output afterwards (tensor-wise `_scaled_mm`
is the most portable kind). `to_fp8(head)` swaps a head's per-depth `nn.Linear`s in place for
drafting (EAGLE-3: its decoder layer and lm_head; EAGLE-1/2: its decoder layers, not the target's
lm_head it reads; never `fc`, which runs once per accept and whose dtype the drafter reads). For
decoding only: not for training or saving (`save_pretrained` refuses such a head).
"""

from __future__ import annotations

from typing import cast

import torch
from torch import Tensor, nn

FP8 = torch.float8_e4m3fn
FP8_MAX = torch.finfo(FP8).max  # 448


class Fp8Linear(nn.Module):
    """y = x W^T (+ b) from an `nn.Linear` whose features are multiples of 16 (the FP8 GEMM's rule):
    W stored as e4m3 [N, K] / scale [N], x (..., K) quantized per call with one scale per row."""

    weight_fp8: Tensor  # [N, K] e4m3 (buffers: a frozen drafting layer)
    weight_scale: Tensor  # [N] fp32
    unit: Tensor  # fp32 0-d, the scales inside the GEMM (the rows' and columns' own multiply its output)
    bias: Tensor | None

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        n, k = linear.out_features, linear.in_features
        if n % 16 or k % 16:
            raise ValueError(f"FP8 GEMMs need features that are multiples of 16, got {k} -> {n}")
        self.in_features, self.out_features = k, n
        weight = linear.weight.detach().float()  # [N, K]
        scale = weight.abs().amax(dim=1).clamp(min=1e-12) / FP8_MAX  # [N]: each row's max -> 448
        self.dtype = linear.weight.dtype  # the output's (the layer's own)
        self.register_buffer("weight_fp8", (weight / scale[:, None]).to(FP8))  # [N, K]
        self.register_buffer("weight_scale", scale)  # [N] fp32
        self.register_buffer("unit", torch.ones((), device=weight.device))  # fp32 scale of W in the GEMM
        bias = linear.bias
        self.register_buffer("bias", None if bias is None else bias.detach().clone())

    def _apply(self, fn, recurse=True):  # noqa: ANN001, ANN202 - nn.Module's own signature
        """`.to(device)` moves the e4m3 weights and the fp32 scales as they are; a dtype cast
        (`head.to(torch.bfloat16)`) changes only the output's dtype and the bias."""
        kept = (self.weight_fp8, self.weight_scale, self.unit)
        self.dtype = fn(torch.zeros((), dtype=self.dtype, device=self.unit.device)).dtype  # where casts go
        out = super()._apply(fn, recurse)
        device = fn(self.unit).device
        self.weight_fp8, self.weight_scale, self.unit = (t.to(device) for t in kept)
        return out

    def forward(self, x: Tensor) -> Tensor:
        """x (..., K) -> (..., N) in the layer's dtype."""
        return self.from_quantized(quantize_rows(x), x.shape)

    def from_quantized(self, quantized: tuple[Tensor, Tensor], shape: torch.Size) -> Tensor:
        """The layer's output (..., N) for an input of `shape` (..., K) given as `quantize_rows`' pair:
        layers reading the same input (q/k/v, gate/up) quantize it once."""
        rows, scale = quantized  # [M, K] e4m3, [M, 1] fp32
        # unit scales in the GEMM (tensor-wise: the most portable kind), each row's and each column's own
        # scale after it: (x / s_x) (W / s_w)^T * s_x s_w^T. fp16 would overflow on the unscaled sums
        wide = torch.bfloat16 if self.dtype == torch.bfloat16 else torch.float32
        out = torch._scaled_mm(
            rows, self.weight_fp8.t(), scale_a=self.unit, scale_b=self.unit, out_dtype=wide
        )
        out = out.mul_(scale * self.weight_scale).to(self.dtype)  # [M, N] (in place: no wider copy)
        if self.bias is not None:
            out = out + self.bias
        return out.reshape(*shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, e4m3"


def quantize_rows(x: Tensor) -> tuple[Tensor, Tensor]:
    """x (..., K) -> its rows in e4m3 [M, K] and their fp32 scales [M, 1] (each row's max -> 448; few
    kernels: eager drafting on a GPU runs each on its own)."""
    rows = x.reshape(-1, x.shape[-1])  # [M, K]
    amax = torch.linalg.vector_norm(rows, float("inf"), dim=1, keepdim=True, dtype=torch.float32)  # [M, 1]
    scale = amax.clamp(min=1e-12) / FP8_MAX
    return (rows / scale).to(FP8), scale


def linears(modules: list[nn.Module], x: Tensor) -> list[Tensor]:
    """[m(x) for m in modules], x quantized once when they are all `Fp8Linear`s (q/k/v, gate/up)."""
    if all(type(m) is Fp8Linear for m in modules):
        quantized = quantize_rows(x)
        return [cast(Fp8Linear, m).from_quantized(quantized, x.shape) for m in modules]
    return [m(x) for m in modules]


def per_depth_linears(head: nn.Module) -> list[tuple[nn.Module, str]]:
    """(parent module, attribute) of every `nn.Linear` a draft depth runs: EAGLE-3 its `midlayer` and
    `lm_head`; EAGLE-1/2 its `layers` (the lm_head it reads is the target's). Medusa: none."""
    roots: list[nn.Module] = []
    midlayer, layers = getattr(head, "midlayer", None), getattr(head, "layers", None)
    if isinstance(midlayer, nn.Module):
        roots = [midlayer]
    elif isinstance(layers, nn.ModuleList):
        roots = list(layers)
    found = [
        (parent, name)
        for root in roots
        for parent in root.modules()
        for name, child in parent.named_children()
        if type(child) is nn.Linear
    ]
    if roots and type(getattr(head, "lm_head", None)) is nn.Linear:
        found.append((head, "lm_head"))
    return found


def to_fp8(head: nn.Module) -> int:
    """Swap the head's per-depth `nn.Linear`s (`per_depth_linears`) for `Fp8Linear`s in place; layers
    whose features are not multiples of 16 stay as they are. Returns how many were swapped (0: a head
    with no per-depth layers, e.g. Medusa)."""
    swapped = 0
    for parent, name in per_depth_linears(head):
        linear = getattr(parent, name)
        if linear.in_features % 16 == 0 and linear.out_features % 16 == 0:
            setattr(parent, name, Fp8Linear(linear))
            swapped += 1
    return swapped
