"""Stacked projections for a transformers target: in each decoder layer, the linear layers that read one
input (attention's q/k/v, the MLP's gate/up) run as ONE GEMM each, through the model's own forward. At
batch 1 a GEMM reaches the memory bandwidth only when wide, and a grouped-query model's k/v projections
are narrow (vLLM and gpt-fast stack them too).

A group's first layer becomes a `StackedLinear`, the others `StackedRows` of it (exact in any call order).
The weights live once, in the stack (a new state dict): stack a model for decoding, not to save or train.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from transformers import PreTrainedModel

# (module attribute of a decoder layer, the linear layers in it that read one input), in call order
GROUPS = (("self_attn", ("q_proj", "k_proj", "v_proj")), ("mlp", ("gate_proj", "up_proj")))


class StackedLinear(nn.Module):
    """Linear layers that read one input, as one: weight (sum of out_features, in_features). Called, it
    returns the first layer's output and keeps the others' for `take`."""

    def __init__(self, layers: list[nn.Linear]) -> None:
        super().__init__()
        first = layers[0]
        self.weight = nn.Parameter(torch.cat([m.weight.detach() for m in layers]), requires_grad=False)
        bias = None if first.bias is None else torch.cat([layer.bias.detach() for layer in layers])
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)
        self.sizes = [layer.out_features for layer in layers]
        self.in_features, self.out_features = first.in_features, first.out_features
        self._input: Tensor | None = None  # the tensor the kept outputs were computed from
        self._kept: list[Tensor | None] = [None] * len(layers)

    def forward(self, x: Tensor) -> Tensor:
        """x (..., in) -> the first layer's output (..., sizes[0]); the other rows' outputs kept for x."""
        parts = F.linear(x, self.weight, self.bias).split(self.sizes, dim=-1)
        self._input, self._kept = x, [None, *parts[1:]]
        return parts[0]

    def take(self, index: int, x: Tensor) -> Tensor:
        """Layer `index`'s output for x: the kept one if the stack last ran on this very tensor (then
        released), else its own rows' GEMM."""
        kept = self._kept[index]
        if kept is not None and self._input is x:
            self._kept[index] = None
            if all(k is None for k in self._kept):
                self._input = None  # everything taken: hold no activation between steps
            return kept
        rows = slice(sum(self.sizes[:index]), sum(self.sizes[: index + 1]))
        return F.linear(x, self.weight[rows], None if self.bias is None else self.bias[rows])

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, stacked out_features={self.sizes}"


class StackedRows(nn.Module):
    """Layer `index` of a `StackedLinear` (k_proj, v_proj, up_proj): its weights live in the stack."""

    def __init__(self, stack: StackedLinear, index: int) -> None:
        super().__init__()
        self._stack = (stack,)  # a tuple: not a submodule (registered once, in its group's first layer)
        self.index = index
        self.in_features, self.out_features = stack.in_features, stack.sizes[index]

    def forward(self, x: Tensor) -> Tensor:
        return self._stack[0].take(self.index, x)

    def extra_repr(self) -> str:
        return f"rows of a stack, index={self.index}, out_features={self.out_features}"


def stack_projections(model: PreTrainedModel) -> int:
    """Stack q/k/v and gate/up of every decoder layer of a transformers causal LM in place (module doc) ->
    the number of groups stacked. Groups that are missing, not plain `nn.Linear`s or unlike (input width,
    dtype, device, a bias or none) stay as they are."""
    stacked = 0
    for layer in model.get_decoder().layers:
        for block_name, names in GROUPS:
            block = getattr(layer, block_name, None)
            # plain layers only: a quantized or adapter-wrapped one (a subclass, a PEFT wrapper) stays
            layers = [m for m in (getattr(block, name, None) for name in names) if type(m) is nn.Linear]
            alike = {(m.in_features, m.weight.dtype, m.weight.device, m.bias is None) for m in layers}
            if len(layers) < len(names) or len(alike) != 1:
                continue
            stack = StackedLinear(layers)
            setattr(block, names[0], stack)
            for index, name in enumerate(names[1:], start=1):
                setattr(block, name, StackedRows(stack, index))
            stacked += 1
    return stacked
