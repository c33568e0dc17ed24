"""A short functional forward of an EAGLE head's decoder layer(s), for drafting.

Drafting runs one head step per tree depth, so what a step costs outside its matrix products adds up:
through transformers' modules a Llama-family layer is about 90 small ops (norms of 7 ops each, the
rotary angles recomputed every call, GQA keys repeated, module dispatch); on the demo target on a CPU
that overhead is as large as the step's arithmetic, and on a GPU each op is a kernel launch.
`fused_step(head)` returns a function with `head.step`'s signature and result that runs the SAME
weights (no copies) through about half as many ops: one `rms_norm` per norm, cos/sin gathered from a
table made once by the head's own rotary module (exact: an angle is one product per position), and
grouped-query attention without repeating keys. The head's modules stay the reference (training,
export and everything else use them); tests check this path against `head.step`.

Only layers whose math is known here qualify (Llama, Mistral, Qwen2: q/k/v/o projections with
optional biases, RMSNorm, a gated SiLU MLP); anything else returns None and drafting uses `head.step`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol, cast

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from transformers import Cache, DynamicCache

from spechead.heads.decoder_layer import causal_mask4d, default_positions
from spechead.heads.eagle import EagleHead
from spechead.heads.eagle3 import Eagle3Head

_LAYERS = {"LlamaDecoderLayer", "MistralDecoderLayer", "Qwen2DecoderLayer"}
_NORMS = {"LlamaRMSNorm", "MistralRMSNorm", "Qwen2RMSNorm"}
# keys repeated for grouped-query attention unless sdpa takes enable_gqa (torch >= 2.5)
_GQA = tuple(int(x) for x in torch.__version__.split(".")[:2]) >= (2, 5)

StepFn = Callable[..., Tensor]


class _RMSNorm(Protocol):
    weight: Tensor
    variance_epsilon: float


class _GatedMLP(Protocol):
    gate_proj: nn.Linear
    up_proj: nn.Linear
    down_proj: nn.Linear


class _Layer(Protocol):
    """The parts of a supported decoder layer (`_supported` checked them) that `__call__` runs."""

    input_layernorm: _RMSNorm | nn.Identity
    post_attention_layernorm: _RMSNorm
    mlp: _GatedMLP


class _MidLayer(_Layer, Protocol):
    hidden_norm: _RMSNorm  # EAGLE-3's midlayer (see heads/eagle3.py)


def fused_step(head: nn.Module) -> StepFn | None:
    """A drop-in for `head.step(hidden, next_ids, mask4d=None, position_ids=None, cache=None)` (no
    autograd: drafting only), or None when the head's layers are not of a supported kind."""
    if isinstance(head, Eagle3Head):
        layers = [head.midlayer]
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
    if not isinstance(head, Eagle3Head) or not _is_norm(head.norm):
        return None
    norm = cast(_RMSNorm, head.norm)
    return lambda hidden: _linear(head.lm_head, _norm(norm, hidden))


def _is_norm(module: object, identity_ok: bool = False) -> bool:
    return type(module).__name__ in _NORMS or (identity_ok and isinstance(module, nn.Identity))


def _supported(layer: nn.Module) -> bool:
    attn, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
    if type(layer).__name__ not in _LAYERS or attn is None or mlp is None:
        return False
    projections = ("q_proj", "k_proj", "v_proj", "o_proj")
    return (
        all(isinstance(getattr(attn, p, None), nn.Linear) for p in projections)
        and not any(hasattr(attn, n) for n in ("q_norm", "k_norm"))
        and all(isinstance(getattr(mlp, p, None), nn.Linear) for p in ("gate_proj", "up_proj", "down_proj"))
        and type(getattr(mlp, "act_fn", None)).__name__ in ("SiLU", "SiLUActivation")
        and _is_norm(layer.input_layernorm, identity_ok=True)
        and _is_norm(layer.post_attention_layernorm)
        and _is_norm(getattr(layer, "hidden_norm", layer.post_attention_layernorm))
    )


def _views_end_at_write(cache: Cache | None) -> bool:
    """Whether `cache.update` returns keys up to the last written position only: none, a DynamicCache or
    a preallocated cache without fixed shapes (spechead's SlotCache), not a fixed-size buffer whole."""
    return cache is None or isinstance(cache, DynamicCache) or getattr(cache, "static_shapes", None) is False


def _linear(module: nn.Linear, x: Tensor) -> Tensor:
    """module(x), without the module call for a plain nn.Linear (the call's hook checks cost about as
    much as a small GEMV on a CPU); a subclass (quantized, adapted) runs its own forward."""
    if type(module) is nn.Linear:
        return F.linear(x, module.weight, module.bias)
    return module(x)


def _norm(module: _RMSNorm | nn.Identity, x: Tensor) -> Tensor:
    """RMSNorm (or the Identity EAGLE-1 may put first) as one op, (..., H) -> (..., H)."""
    if isinstance(module, nn.Identity):
        return x
    return F.rms_norm(x, module.weight.shape, module.weight, module.variance_epsilon)


class _FusedStep:
    """The fused step of one head (see the module doc); keeps one cos/sin table, made again when the
    device, the dtype or the cache size changes."""

    def __init__(self, head: EagleHead | Eagle3Head, layers: list[nn.Module]) -> None:
        self.head, self.layers = head, cast("list[_Layer]", layers)
        rope = getattr(head.rotary.module, "rope_type", "default")
        self.tabled = "dynamic" not in str(rope)  # dynamic rope angles depend on the sequence length
        self.table: tuple[Tensor, Tensor] | None = None  # cos, sin [S, head_dim]

    @torch.no_grad()
    def __call__(
        self,
        hidden: Tensor,
        next_ids: Tensor,
        attention_mask4d: Tensor | None = None,
        position_ids: Tensor | None = None,
        past_key_values: Cache | None = None,
    ) -> Tensor:
        """hidden (B, T, H) at t and tokens x_{t+1} (B, T) -> next hidden (B, T, H), as `head.step`."""
        head, dtype = self.head, self.head.fc.weight.dtype
        past = past_key_values.get_seq_length() if past_key_values is not None else 0
        if position_ids is None:
            position_ids = default_positions(hidden, past)
        if isinstance(head, Eagle3Head):
            hidden = hidden.to(dtype)
            mid = cast(_MidLayer, self.layers[0])
            attn_in = torch.cat(
                [_norm(mid.input_layernorm, head.embed(next_ids)), _norm(mid.hidden_norm, hidden)], -1
            )
        else:
            hidden = _linear(head.fc, torch.cat([head.embed(next_ids), hidden.to(dtype)], dim=-1))
            attn_in = None
        # one query under the causal default sees every key its cache returns: no mask at all, where
        # the cache's views end at the write (not a fixed-size buffer's whole length)
        mask: Tensor | None = None
        if attention_mask4d is not None or hidden.shape[1] > 1 or not _views_end_at_write(past_key_values):
            mask = (
                attention_mask4d if attention_mask4d is not None else causal_mask4d(hidden, None, past)
            ).to(dtype)
        cos, sin = self._angles(hidden, position_ids, past_key_values)  # (B, 1, T, D) each
        for i, layer in enumerate(self.layers):
            x = attn_in if attn_in is not None else _norm(layer.input_layernorm, hidden)
            hidden = hidden + self._attention(layer, i, x, cos, sin, mask, past_key_values)
            mlp, x = layer.mlp, _norm(layer.post_attention_layernorm, hidden)
            hidden = hidden + _linear(
                mlp.down_proj, F.silu(_linear(mlp.gate_proj, x)) * _linear(mlp.up_proj, x)
            )
        return hidden

    def _attention(
        self, layer, i: int, x: Tensor, cos: Tensor, sin: Tensor, mask: Tensor | None, cache
    ) -> Tensor:
        """Self-attention of x (B, T, Hin) with rotary angles cos/sin, appending K/V to `cache` layer i."""
        attn = layer.self_attn
        batch, length, _ = x.shape
        dim = attn.head_dim
        q = _linear(attn.q_proj, x).view(batch, length, -1, dim).transpose(1, 2)  # (B, nh, T, D)
        k = _linear(attn.k_proj, x).view(batch, length, -1, dim).transpose(1, 2)  # (B, kv, T, D)
        v = _linear(attn.v_proj, x).view(batch, length, -1, dim).transpose(1, 2)
        q, k = q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin
        if cache is not None:
            k, v = cache.update(k, v, i)  # (B, kv, S, D): the cache's view after writing
        groups = q.shape[1] // k.shape[1]
        extra = {"enable_gqa": True} if _GQA and groups > 1 else {}
        if groups > 1 and not _GQA:
            k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=attn.scaling, **extra)
        return _linear(attn.o_proj, out.transpose(1, 2).reshape(batch, length, -1))

    def _angles(self, hidden: Tensor, positions: Tensor, cache) -> tuple[Tensor, Tensor]:
        """cos, sin (B, 1, T, D) for positions (B, T): gathered from the table when the cache bounds
        the positions (preallocated caches: a position never exceeds the slots), else computed."""
        size = getattr(cache, "max_length", None)
        if not self.tabled or not isinstance(size, int):
            cos, sin = self.head.rotary(hidden, positions)
            return cos[:, None], sin[:, None]
        table = self.table
        if (
            table is None
            or table[0].shape[0] < size
            or table[0].device != hidden.device
            or table[0].dtype != hidden.dtype
        ):
            grid = torch.arange(max(size, 256), device=hidden.device)[None]  # [1, S]
            cos, sin = self.head.rotary(hidden[:1, :1], grid)  # the head's own rotary: exact angles
            self.table = table = (cos[0], sin[0])  # [S, D] each
        return table[0][positions][:, None], table[1][positions][:, None]


def _rotate_half(x: Tensor) -> Tensor:
    half = x.shape[-1] // 2
    return torch.cat([-x[..., half:], x[..., :half]], dim=-1)
