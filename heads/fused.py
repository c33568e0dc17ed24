"""A short functional forward of an EAGLE head's decoder layer(s), and of Medusa's heads, for drafting.

Drafting runs one head step per tree depth, so what a step costs outside its matrix products adds up:
through transformers' modules a Llama-family layer is about 90 small ops (norms of 7 ops each, the
rotary angles recomputed every call, GQA keys repeated, module dispatch); on the demo target on a CPU
that overhead is as large as the step's arithmetic, and on a GPU each op is a kernel launch.
`fused_step(head)` returns a function with `head.step`'s signature and result that runs the SAME
weights (no copies) through about half as many ops: one `rms_norm` per norm, cos/sin gathered from a
table made once by the head's own rotary module (exact: an angle is one product per position), and
grouped-query attention without repeating keys. FP8 drafting layers (heads/fp8.py) take their input
quantized once per group, their RMSNorm fused into that quantization. The head's modules stay the
reference (training, export and everything else use them); tests check this path against `head.step`.

Only layers whose math is known here qualify (Llama, Mistral, Qwen2, Qwen3: q/k/v/o projections with
optional biases and per-head q/k norms, RMSNorm, a gated SiLU MLP); anything else returns None and
drafting uses `head.step`. P-EAGLE's step is EAGLE-3's; DFlash's block forward runs the same layer code
(heads/fused_block.py).
`fused_medusa_logits(head)` does the same for Medusa's heads (every one runs each pass): plain
ResBlocks and projections as functional ops on the same weights, bit for bit `head.head_logits`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol, cast

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from transformers import Cache, DynamicCache

from spechead.heads import attention as kernels
from spechead.heads.attention import FEW_QUERIES, grouped_attention
from spechead.heads.base import DraftHead
from spechead.heads.decoder_layer import causal_mask4d, default_positions
from spechead.heads.eagle import EagleHead
from spechead.heads.eagle3 import Eagle3Head
from spechead.heads.fp8 import Fp8Linear, Fp8Rows, linears, linears_from, norm_quantized, reads_fp8
from spechead.heads.grad import no_grad
from spechead.heads.int8 import Int8Linear
from spechead.heads.medusa import MedusaHead, ResBlock

if TYPE_CHECKING:
    from spechead.heads.dflash import DFlashHead

_LAYERS = {"LlamaDecoderLayer", "MistralDecoderLayer", "Qwen2DecoderLayer", "Qwen3DecoderLayer"}
_NORMS = {"LlamaRMSNorm", "MistralRMSNorm", "Qwen2RMSNorm", "Qwen3RMSNorm"}
# keys repeated for grouped-query attention unless sdpa takes enable_gqa (torch >= 2.5)
_GQA = tuple(int(x) for x in torch.__version__.split(".")[:2]) >= (2, 5)

StepFn = Callable[..., Tensor]


class _RMSNorm(Protocol):
    weight: Tensor
    variance_epsilon: float


def fused_step(head: nn.Module) -> StepFn | None:
    """A drop-in for `head.step(hidden, next_ids, mask4d=None, position_ids=None, cache=None)` (no
    autograd: drafting only), or None when the head's layers are not of a supported kind."""
    if isinstance(head, Eagle3Head):
        if _eagle31(head):
            return None
        layers = head.decoder_layers
    elif isinstance(head, EagleHead):
        layers = list(head.layers)
    else:
        return None
    if not all(_supported(layer) for layer in layers):
        return None
    return _FusedStep(head, layers)


def fused_logits(head: nn.Module) -> Callable[[Tensor], Tensor] | None:
    """A drop-in for an EAGLE-3 head's `logits(hidden)` (B, T, H) -> (B, T, Vd) with its final norm as
    one op (the module's RMSNorm is 7), or None when the norm is not of a supported kind or the head is
    not EAGLE-3 (EAGLE-1/2 read the target's lm_head, no norm)."""
    if not isinstance(head, Eagle3Head) or not _is_norm(head.norm) or _eagle31(head):
        return None
    norm = head.norm
    return lambda hidden: _normed_linears([_sub(head, "lm_head")], [(norm, hidden)])[0]


def fused_medusa_logits(head: MedusaHead) -> Callable[[int, Tensor], Tensor] | None:
    """A drop-in for a Medusa head's `head_logits(k, hidden)` (B, T, H) -> (B, T, V) without module
    calls: each plain ResBlock as x + silu(linear(x)), the projection through `_linear`; None when the
    head has a block of another kind. Submodules and weights are read when it runs (swaps, moves and
    loads are seen; a block swapped in later runs its own forward). Drafting runs every head each pass:
    on a CPU the module calls cost about a quarter of the heads' time."""
    shared, keys = head.config.share_lm_head, [str(k) for k in range(len(head.heads))]

    def modules_of(k: int) -> dict[str, nn.Module | None]:
        """Head k's {name: ResBlock ... (+ its projection)}, read now."""
        return _sub(_sub(head, "heads"), keys[k])._modules

    def blocks(modules: dict[str, nn.Module | None]) -> list[nn.Module]:
        mods = [cast(nn.Module, m) for m in modules.values()]
        return mods if shared else mods[:-1]

    if not all(_plain_block(b) for k in range(len(keys)) for b in blocks(modules_of(k))):
        return None

    def logits(k: int, hidden: Tensor) -> Tensor:
        modules = modules_of(k)
        x = hidden
        for block in blocks(modules):
            x = x + F.silu(_linear(_sub(block, "linear"), x)) if _plain_block(block) else block(x)
        if not shared:
            return _linear(cast(nn.Module, next(reversed(modules.values()))), x)
        lm_head = head.target_lm_head  # the target's, frozen: in its dtype, fp32 logits (as `head_logits`)
        return _linear(lm_head, x.to(_param(lm_head, "weight").dtype)).float()

    return logits


def _eagle31(head: Eagle3Head) -> bool:
    """Whether the head uses an EAGLE-3.1 norm option (its own `step` / `logits` run those)."""
    cfg = head.config
    return cfg.norm_before_fc or cfg.norm_before_residual or cfg.norm_output


def _plain_block(module: nn.Module) -> bool:
    """A ResBlock whose activation is SiLU (what `fused_medusa_logits` writes out)."""
    return type(module) is ResBlock and type(module._modules["act"]) is nn.SiLU


def _is_norm(module: object, identity_ok: bool = False) -> bool:
    return type(module).__name__ in _NORMS or (identity_ok and isinstance(module, nn.Identity))


def _supported(layer: nn.Module) -> bool:
    attn, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
    if type(layer).__name__ not in _LAYERS or attn is None or mlp is None:
        return False
    projections = ("q_proj", "k_proj", "v_proj", "o_proj")
    linear = (nn.Linear, Fp8Linear, Fp8Rows, Int8Linear)  # (`_linear` runs any other module's own forward)
    return (
        all(isinstance(getattr(attn, p, None), linear) for p in projections)
        and all(_is_norm(getattr(attn, n)) for n in ("q_norm", "k_norm") if hasattr(attn, n))
        and all(isinstance(getattr(mlp, p, None), linear) for p in ("gate_proj", "up_proj", "down_proj"))
        and type(getattr(mlp, "act_fn", None)).__name__ in ("SiLU", "SiLUActivation")
        and _is_norm(layer.input_layernorm, identity_ok=True)
        and _is_norm(layer.post_attention_layernorm)
        and _is_norm(getattr(layer, "hidden_norm", layer.post_attention_layernorm))
    )


def _views_end_at_write(cache: Cache | None) -> bool:
    """Whether `cache.update` returns keys up to the last written position only: none, a DynamicCache or
    a preallocated cache without fixed shapes (spechead's RowCache written in a row), not a fixed-size buffer whole."""
    return cache is None or isinstance(cache, DynamicCache) or getattr(cache, "static_shapes", None) is False


# A step looks up about 40 submodules and parameters: through nn.Module.__getattr__ each costs ~0.6 us on
# a CPU (its three-dict search), through the module's own dicts ~0.04 us. `_sub` and `_param` read those
# dicts, so a module or weight replaced after `fused_step` is still the one used.


def _sub(module: nn.Module, name: str) -> nn.Module:
    """module.<name> for a registered submodule."""
    return module._modules[name]  # type: ignore[return-value]  # registered: not None


def _param(module: nn.Module, name: str) -> Tensor:
    """module.<name> for a registered parameter (a Linear's bias may be None)."""
    return module._parameters[name]  # type: ignore[return-value]


def _linear(module: nn.Module, x: Tensor) -> Tensor:
    """module(x), without the module call for a plain nn.Linear (the call's hook checks cost about as
    much as a small GEMV on a CPU); a subclass (quantized, adapted) runs its own forward."""
    if type(module) is nn.Linear:
        params = module._parameters
        return F.linear(x, params["weight"], params["bias"])  # type: ignore[arg-type]
    return module(x)


def _linears(modules: list[nn.Module], x: Tensor) -> list[Tensor]:
    """[_linear(m, x) for m in modules]; FP8 layers (heads/fp8.py) reading the same x quantize it once,
    and run one GEMM when stacked."""
    if type(modules[0]) in (Fp8Linear, Fp8Rows):
        return linears(modules, x)
    return [_linear(m, x) for m in modules]


def _normed_linears(modules: list[nn.Module], normed: list[tuple[nn.Module, Tensor]]) -> list[Tensor]:
    """`_linears(modules, x)` for x = cat([norm(h) for norm, h in normed], -1). FP8 layers traced by a
    compiler read RMSNorms fused into the quantization of their input (`fp8.norm_quantized`: one reduction
    fewer a norm once fused; run op by op, as eager drafting and `compile="graphs"` run it, it is more
    kernels than `rms_norm` and `quantize_rows`, which those keep)."""
    fuse = torch.compiler.is_compiling() and reads_fp8(modules)
    if fuse and all(_is_norm(norm) for norm, _ in normed):
        parts = [(h, _param(norm, "weight"), cast(_RMSNorm, norm).variance_epsilon) for norm, h in normed]
        shape = torch.Size([*normed[0][1].shape[:-1], sum(h.shape[-1] for _, h in normed)])
        return linears_from(modules, norm_quantized(parts), shape)
    x = _norm(*normed[0]) if len(normed) == 1 else torch.cat([_norm(norm, h) for norm, h in normed], -1)
    return _linears(modules, x)


def _embed(head: EagleHead | Eagle3Head, ids: Tensor, dtype: torch.dtype) -> Tensor:
    """`head.embed(ids)` (B, T) -> (B, T, H) in `dtype`: for a plain nn.Embedding one op, without the
    module call, a no_grad context and the head's parameter walk for its dtype (a scaled or otherwise
    subclassed embedding runs its own forward, and so does a head with an `embed` of its own: P-EAGLE's mask
    embedding at its future positions)."""
    if type(head).embed is not DraftHead.embed:
        out = head.embed(ids)
        return out if out.dtype == dtype else out.to(dtype)
    module = head.input_embeddings  # the head's own embedding where it has one, else the target's
    if type(module) is nn.Embedding and module.max_norm is None:
        out = F.embedding(ids, _param(module, "weight"))
    else:
        out = module(ids)
    return out if out.dtype == dtype else out.to(dtype)


def _norm(module: _RMSNorm | nn.Module, x: Tensor) -> Tensor:
    """RMSNorm (or the Identity EAGLE-1 may put first) as one op, (..., H) -> (..., H)."""
    if isinstance(module, nn.Identity):
        return x
    weight = _param(cast(nn.Module, module), "weight")
    return F.rms_norm(x, weight.shape, weight, cast(_RMSNorm, module).variance_epsilon)


class _FusedLayers:
    """A head's decoder layers as the fused functional chain (see the module doc); keeps one cos/sin
    table, made again when the device, the dtype or the cache size changes."""

    def __init__(self, head: EagleHead | Eagle3Head | DFlashHead, layers: list[nn.Module]) -> None:
        self.head, self.layers = head, layers  # supported kinds (`_supported` checked them)
        rope = getattr(head.rotary.module, "rope_type", "default")
        self.tabled = "dynamic" not in str(rope)  # dynamic rope angles depend on the sequence length
        self.table: tuple[Tensor, Tensor] | None = None  # cos, signed sin [S, 1, head_dim] (see _angles)
        # how up to FEW_QUERIES queries attend: "sdpa", "matmul" (`grouped_attention`) or "auto": matmul
        # on GROUPED_DEVICES (faster there: heads/attention.py), sdpa elsewhere
        self.attention = "auto"

    def _layers(
        self,
        hidden: Tensor,
        attn_in: list[tuple[nn.Module, Tensor]] | None,
        cos: Tensor,
        sin: Tensor,
        mask: Tensor | None,
        cache,
    ) -> Tensor:
        """hidden (B, T, H) through every layer (the first's attention reads `attn_in` where given: EAGLE-3's
        two normed inputs), layer i's K/V appended to `cache` layer i -> (B, T, H)."""
        for i, layer in enumerate(self.layers):
            normed = (attn_in if i == 0 else None) or [(_sub(layer, "input_layernorm"), hidden)]
            hidden = hidden + self._attention(_sub(layer, "self_attn"), i, normed, cos, sin, mask, cache)
            mlp = _sub(layer, "mlp")
            gate, up = _normed_linears(
                [_sub(mlp, "gate_proj"), _sub(mlp, "up_proj")],
                [(_sub(layer, "post_attention_layernorm"), hidden)],
            )
            hidden = hidden + _linear(_sub(mlp, "down_proj"), F.silu(gate) * up)
        return hidden

    def attends_as_matmuls(self, device: torch.device) -> bool:
        """Whether few queries on `device` attend through `grouped_attention` (`attention`)."""
        return self.attention == "matmul" or (
            self.attention == "auto" and device.type in kernels.GROUPED_DEVICES
        )

    def _attention(
        self,
        attn: nn.Module,
        i: int,
        normed: list[tuple[nn.Module, Tensor]],
        cos: Tensor,
        sin: Tensor,
        mask: Tensor | None,
        cache,
    ) -> Tensor:
        """Self-attention `attn` of x = cat([norm(h) for norm, h in normed], -1) (B, T, Hin) with rotary
        angles cos / signed sin, appending K/V to `cache` layer i. rotate_half(x) * sin = x.roll(D / 2) *
        signed sin: one op, not four."""
        batch, length = normed[0][1].shape[:2]
        q, k, v = _normed_linears([_sub(attn, "q_proj"), _sub(attn, "k_proj"), _sub(attn, "v_proj")], normed)
        q, k = rotated(attn, "q_norm", q, cos, sin), rotated(attn, "k_norm", k, cos, sin)  # (B, n, T, D)
        v = v.view(batch, length, -1, cast(int, attn.head_dim)).transpose(1, 2)  # (B, kv, T, D)
        if cache is not None:
            k, v = cache.update(k, v, i)  # (B, kv, S, D): the cache's view after writing
        if self.attends_as_matmuls(q.device) and length <= FEW_QUERIES:
            out = grouped_attention(q, k, v, mask, cast(float, attn.scaling))  # (B, nh, T, D)
            return _linear(_sub(attn, "o_proj"), out.transpose(1, 2).reshape(batch, length, -1))
        groups = q.shape[1] // k.shape[1]
        extra = {"enable_gqa": True} if _GQA and groups > 1 else {}
        if groups > 1 and not _GQA:
            k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
        out = F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, scale=cast(float, attn.scaling), **extra
        )
        return _linear(_sub(attn, "o_proj"), out.transpose(1, 2).reshape(batch, length, -1))

    def _angles(self, hidden: Tensor, positions: Tensor, cache) -> tuple[Tensor, Tensor]:
        """cos and SIGNED sin (its first half negated) (B, T, 1, D) for positions (B, T): gathered from
        the table when the cache bounds the positions (preallocated caches: a position never exceeds
        the slots), else computed. The sign is exact: rotate_half(x) * sin = roll(x) * signed sin."""
        size = getattr(cache, "max_length", None)
        if not self.tabled or not isinstance(size, int):
            cos, sin = self.head.rotary(hidden, positions)
            return cos[:, :, None], _signed(sin)[:, :, None]
        table = self.table
        if (
            table is None
            or table[0].shape[0] < size
            or table[0].device != hidden.device
            or table[0].dtype != hidden.dtype
        ):
            grid = torch.arange(max(size, 256), device=hidden.device)[None]  # [1, S]
            cos, sin = self.head.rotary(hidden[:1, :1], grid)  # the head's own rotary: exact angles
            self.table = table = (cos[0, :, None], _signed(sin[0])[:, None])  # [S, 1, D] each
        return table[0][positions], table[1][positions]  # one gather each, no unsqueeze


class _FusedStep(_FusedLayers):
    """An EAGLE head's fused step (`fused_step`)."""

    head: EagleHead | Eagle3Head

    @no_grad
    def __call__(
        self,
        hidden: Tensor,
        next_ids: Tensor,
        attention_mask4d: Tensor | None = None,
        position_ids: Tensor | None = None,
        past_key_values: Cache | None = None,
    ) -> Tensor:
        """hidden (B, T, H) at t and tokens x_{t+1} (B, T) -> next hidden (B, T, H), as `head.step`."""
        head = self.head
        dtype = _param(_sub(head, "fc"), "weight").dtype
        embedded = _embed(head, next_ids, dtype)  # (B, T, H)
        if isinstance(head, Eagle3Head):
            hidden = hidden.to(dtype)
            mid = self.layers[0]  # its attention reads cat(norm(embedded), norm(hidden)) (B, T, 2H)
            attn_in = [(_sub(mid, "input_layernorm"), embedded), (_sub(mid, "hidden_norm"), hidden)]
        else:
            hidden = _linear(_sub(head, "fc"), torch.cat([embedded, hidden.to(dtype)], dim=-1))
            attn_in = None
        mask: Tensor | None = attention_mask4d
        # one query under the causal default sees every key its cache returns: no mask at all, where
        # the cache's views end at the write (not a fixed-size buffer's whole length)
        causal = mask is None and (hidden.shape[1] > 1 or not _views_end_at_write(past_key_values))
        if position_ids is None or causal:  # (drafting passes positions and masks: no cache length read)
            past = past_key_values.get_seq_length() if past_key_values is not None else 0
            position_ids = default_positions(hidden, past) if position_ids is None else position_ids
            mask = causal_mask4d(hidden, None, past) if causal else mask
        if mask is not None and mask.dtype != dtype:  # (`to` costs even as a no-op)
            mask = mask.to(dtype)
        cos, sin = self._angles(hidden, position_ids, past_key_values)  # (B, T, 1, D) each; sin signed
        return self._layers(hidden, attn_in, cos, sin, mask, past_key_values)


def rotated(attn: nn.Module, norm: str, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """A query / key projection's output (B, T, n * D) -> heads (B, n, T, D): the layer's per-head norm
    `norm` first where it has one (Qwen3's q_norm / k_norm), then rotated by cos / signed sin (B, T, 1, D)
    before the heads move to dim 1 (the angles need no unsqueeze)."""
    dim = cast(int, attn.head_dim)
    x = x.view(*x.shape[:2], -1, dim)  # (B, T, n, D)
    if norm in attn._modules:
        x = _norm(_sub(attn, norm), x)
    return (x * cos + x.roll(dim // 2, -1) * sin).transpose(1, 2)


def _signed(sin: Tensor) -> Tensor:
    """sin (..., D) with its first half negated: rotate_half(x) * sin == x.roll(D / 2, -1) * _signed(sin),
    since rotate_half(x) = cat(-x2, x1) and x.roll(D / 2) = cat(x2, x1)."""
    half = sin.shape[-1] // 2
    return torch.cat([-sin[..., :half], sin[..., half:]], dim=-1)
