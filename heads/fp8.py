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
lm_head it reads; never `fc`, which runs once per accept and whose dtype the drafter reads), then
stacks the layers that read one input (q/k/v, gate/up) into one GEMM each, their rows kept as `Fp8Rows`
views of the stack: each row's math is the same, with fewer and wider GEMMs per depth. For decoding
only: not for training or saving (`save_pretrained` refuses such a head).
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
        weight = linear.weight.detach().float()  # [N, K]
        scale = weight.abs().amax(dim=1).clamp(min=1e-12) / FP8_MAX  # [N]: each row's max -> 448
        bias = None if linear.bias is None else linear.bias.detach().clone()
        self._keep((weight / scale[:, None]).to(FP8), scale, bias, linear.weight.dtype)

    def _keep(self, weight_fp8: Tensor, scale: Tensor, bias: Tensor | None, dtype: torch.dtype) -> None:
        """Register the e4m3 weights [N, K], their row scales [N], the bias [N] (or None) and the
        output's dtype (the layer's own)."""
        self.out_features, self.in_features = weight_fp8.shape
        self.dtype = dtype
        self.register_buffer("weight_fp8", weight_fp8)  # [N, K]
        self.register_buffer("weight_scale", scale)  # [N] fp32
        self.register_buffer("unit", torch.ones((), device=scale.device))  # fp32 scale of W in the GEMM
        self.register_buffer("bias", bias)

    @classmethod
    def stacked(cls, layers: list[Fp8Linear]) -> Fp8Linear:
        """One layer over the rows of `layers` (same input, same dtype), in order: [sum N_i, K]. Its
        output (..., sum N_i) splits into theirs, each row's math unchanged: one GEMM instead of several."""
        if not cls.stackable(layers):
            raise ValueError("stacked FP8 layers need one input width, one dtype and biases on all or none")
        out = cls.__new__(cls)
        nn.Module.__init__(out)
        biased = layers[0].bias is not None
        bias = torch.cat([cast(Tensor, m.bias) for m in layers]) if biased else None
        weight = torch.cat([m.weight_fp8 for m in layers])  # [sum N_i, K]
        out._keep(weight, torch.cat([m.weight_scale for m in layers]), bias, layers[0].dtype)
        return out

    @staticmethod
    def stackable(layers: list[Fp8Linear]) -> bool:
        """Whether `stacked` takes them: one input width, one dtype, biases on all or none."""
        return len({(m.in_features, m.dtype, m.bias is not None) for m in layers}) == 1

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
        out = _gemm(quantized, self.weight_fp8, self.weight_scale, self.unit, self.bias, self.dtype)
        return out.reshape(*shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, e4m3"


class Fp8Rows(nn.Module):
    """Rows [start, stop) of a stacked `Fp8Linear` (`Fp8Linear.stacked`): a layer (q_proj, up_proj, ...)
    whose weights live in the stack, which its parent module registers once (no copy). Alone it runs
    its rows' GEMM; `linears` runs the whole stack in one GEMM for layers reading the same input."""

    def __init__(self, stack: Fp8Linear, start: int, stop: int) -> None:
        super().__init__()
        self._stack = (stack,)  # (a tuple: not a submodule; `.to()` moves the stack through its parent)
        self.start, self.stop = start, stop
        self.in_features, self.out_features = stack.in_features, stop - start

    @property
    def stack(self) -> Fp8Linear:
        return self._stack[0]

    def forward(self, x: Tensor) -> Tensor:
        """x (..., K) -> (..., stop - start) in the stack's dtype."""
        return self.from_quantized(quantize_rows(x), x.shape)

    def from_quantized(self, quantized: tuple[Tensor, Tensor], shape: torch.Size) -> Tensor:
        """Its rows' output (..., stop - start) for an input of `shape` given as `quantize_rows`' pair."""
        s, rows = self.stack, slice(self.start, self.stop)
        bias = None if s.bias is None else s.bias[rows]
        out = _gemm(quantized, s.weight_fp8[rows], s.weight_scale[rows], s.unit, bias, s.dtype)
        return out.reshape(*shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"rows {self.start}:{self.stop} of a stacked e4m3 layer, in_features={self.in_features}"


def _gemm(
    quantized: tuple[Tensor, Tensor],
    weight_fp8: Tensor,
    weight_scale: Tensor,
    unit: Tensor,
    bias: Tensor | None,
    dtype: torch.dtype,
) -> Tensor:
    """x W^T (+ b) [M, N] in `dtype` from `quantize_rows`' pair ([M, K] e4m3, [M, 1]) and W as e4m3
    [N, K] (rows contiguous) with its row scales [N]."""
    rows, scale = quantized
    # unit scales in the GEMM (tensor-wise: the most portable kind), each row's and each column's own
    # scale after it: (x / s_x) (W / s_w)^T * s_x s_w^T. fp16 would overflow on the unscaled sums
    wide = torch.bfloat16 if dtype == torch.bfloat16 else torch.float32
    out = torch._scaled_mm(rows, weight_fp8.t(), scale_a=unit, scale_b=unit, out_dtype=wide)
    out = out.mul_(scale * weight_scale).to(dtype)  # [M, N] (in place: no wider copy)
    return out if bias is None else out + bias


def quantize_rows(x: Tensor) -> tuple[Tensor, Tensor]:
    """x (..., K) -> its rows in e4m3 [M, K] and their fp32 scales [M, 1] (each row's max -> 448; few
    kernels: eager drafting on a GPU runs each on its own)."""
    rows = x.reshape(-1, x.shape[-1])  # [M, K]
    amax = torch.linalg.vector_norm(rows, float("inf"), dim=1, keepdim=True, dtype=torch.float32)  # [M, 1]
    scale = amax.clamp(min=1e-12) / FP8_MAX
    return (rows / scale).to(FP8), scale


def linears(modules: list[nn.Module], x: Tensor) -> list[Tensor]:
    """[m(x) for m in modules]: FP8 layers (`reads_fp8`) quantize x once, and the rows of one stack in
    order (q/k/v, gate/up after `to_fp8`) run one GEMM."""
    if reads_fp8(modules):
        return linears_from(modules, quantize_rows(x), x.shape)
    return [m(x) for m in modules]


def reads_fp8(modules: list[nn.Module]) -> bool:
    """Whether every module is an FP8 layer (`Fp8Linear` or `Fp8Rows`): then they take one quantized input."""
    return all(type(m) in (Fp8Linear, Fp8Rows) for m in modules)


def linears_from(
    modules: list[nn.Module], quantized: tuple[Tensor, Tensor], shape: torch.Size
) -> list[Tensor]:
    """The FP8 layers' outputs for one input of `shape` (..., K) given as `quantize_rows`' pair: one GEMM
    when they are the rows of one stack in order, else one each."""
    stack = _whole_stack(modules)
    if stack is not None:
        sizes = [cast(Fp8Rows, m).out_features for m in modules]
        return list(stack.from_quantized(quantized, shape).split(sizes, dim=-1))
    return [cast(Fp8Linear | Fp8Rows, m).from_quantized(quantized, shape) for m in modules]


def norm_quantized(parts: list[tuple[Tensor, Tensor, float]]) -> tuple[Tensor, Tensor]:
    """`quantize_rows(cat([rms_norm(x, w, eps) for x, w, eps in parts], -1))` without writing the norms:
    parts x (..., K_i) with their norm's weight [K_i] and eps -> e4m3 rows [M, sum K_i] and fp32 scales
    [M, 1]. A row's largest entry after its norm is rstd * max|x * w| (rstd > 0), so the max and the
    norm's mean square are one pass over x: one reduction where the norm and then the max took two
    (a compiled draft depth reads three normed inputs: q/k/v's, gate/up's and the lm_head's)."""
    rows, peaks = [], []
    for x, weight, eps in parts:
        xf = x.reshape(-1, x.shape[-1]).float()  # [M, K_i]
        rstd = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)  # [M, 1]
        xw = xf * weight.float()  # [M, K_i]
        rows.append((xw, rstd))
        peaks.append(xw.abs().amax(-1, keepdim=True) * rstd)  # [M, 1] the normed row's max
    peak = peaks[0]
    for other in peaks[1:]:
        peak = torch.maximum(peak, other)
    scale = peak.clamp(min=1e-12) / FP8_MAX  # [M, 1]
    normed = torch.cat([xw * (rstd / scale) for xw, rstd in rows], dim=-1)  # [M, sum K_i] within +-448
    return normed.clamp(-FP8_MAX, FP8_MAX).to(FP8), scale  # (the clamp: rounding at the max)


def _whole_stack(modules: list[nn.Module]) -> Fp8Linear | None:
    """The stack `modules` are the rows of, all of them in order, else None."""
    if not all(type(m) is Fp8Rows for m in modules):
        return None
    rows = cast(list[Fp8Rows], modules)
    stack, end = rows[0].stack, 0
    for m in rows:
        if m.stack is not stack or m.start != end:
            return None
        end = m.stop
    return stack if end == stack.out_features else None


def per_depth_linears(head: nn.Module) -> list[tuple[nn.Module, str]]:
    """(parent module, attribute) of every `nn.Linear` a draft depth runs: EAGLE-3 its decoder layers
    and `lm_head`; EAGLE-1/2 its `layers` (the lm_head it reads is the target's). Medusa: none."""
    roots: list[nn.Module] = []
    decoder_layers, layers = getattr(head, "decoder_layers", None), getattr(head, "layers", None)
    if isinstance(decoder_layers, list):  # EAGLE-3: Eagle3Head.decoder_layers
        roots = decoder_layers
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


def to_fp8(head: nn.Module, stack: bool = True) -> int:
    """Swap the head's per-depth `nn.Linear`s (`per_depth_linears`) for `Fp8Linear`s in place; layers
    whose features are not multiples of 16 stay as they are. stack: then join the layers that read one
    input (q/k/v, gate/up: `STACKS`) into one GEMM each (`stack_fp8`). Returns how many were swapped
    (0: a head with no per-depth layers, e.g. Medusa)."""
    swapped = 0
    for parent, name in per_depth_linears(head):
        linear = getattr(parent, name)
        if linear.in_features % 16 == 0 and linear.out_features % 16 == 0:
            setattr(parent, name, Fp8Linear(linear))
            swapped += 1
    if stack:
        stack_fp8(head)
    return swapped


# layers that read one input, and the name their stack takes on their parent
STACKS = {("q_proj", "k_proj", "v_proj"): "qkv_proj_fp8", ("gate_proj", "up_proj"): "gate_up_proj_fp8"}


def stack_fp8(module: nn.Module) -> int:
    """Stack each group of `STACKS` whose layers are all `Fp8Linear`s of one input width and dtype: the
    stack registered on their parent, each layer replaced by its rows (`Fp8Rows`). On a GPU at batch 1
    the small k/v GEMMs leave most of the chip idle and each layer is a GEMM and a scaling kernel of its
    own; stacked, one of each. Returns how many stacks were made."""
    made = 0
    for parent in list(module.modules()):
        for names, stack_name in STACKS.items():
            layers = [getattr(parent, n, None) for n in names]
            if not all(type(m) is Fp8Linear for m in layers):
                continue
            fp8 = cast(list[Fp8Linear], layers)
            if not Fp8Linear.stackable(fp8):
                continue
            stack = Fp8Linear.stacked(fp8)
            parent.add_module(stack_name, stack)
            start = 0
            for n, m in zip(names, fp8):
                setattr(parent, n, Fp8Rows(stack, start, start + m.out_features))
                start += m.out_features
            made += 1
    return made
