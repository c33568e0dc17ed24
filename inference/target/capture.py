"""The target's hidden states for a drafter (forward hooks installed once per model, recording only while
a runner's forward runs) and the check that a target can take tree passes at all."""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

from torch import Tensor

from spechead.heads.capture import final_norm
from spechead.heads.hybrid import check_attention_only, refuse_flash

if TYPE_CHECKING:
    from transformers import PreTrainedModel


class Capture:
    """Forward hooks on a model's decoder, installed once; record {canonical index: [B, T, H]} when active."""

    def __init__(self, model: PreTrainedModel) -> None:
        self.decoder = model.get_decoder()
        self.num_layers = len(self.decoder.layers)
        self.wanted: set[int] = set()
        self.store: dict[int, Tensor] = {}
        self.active = False

    def want(self, canonical: Iterable[int]) -> None:
        """Install hooks for canonical indices not hooked yet (0 = embeddings, L = after the final norm)."""
        layers = self.decoder.layers
        for c in sorted(set(canonical) - self.wanted):
            if c == 0:
                layers[0].register_forward_pre_hook(self._save_input, with_kwargs=True)
            elif c == self.num_layers:
                final_norm(self.decoder).register_forward_hook(self._saver(c))
            else:
                layers[c - 1].register_forward_hook(self._saver(c))
            self.wanted.add(c)

    def _saver(self, c: int):
        def hook(_module, _args, output):
            if self.active:
                self.store[c] = output[0] if isinstance(output, (tuple, list)) else output

        return hook

    def _save_input(self, _module, args, kwargs):
        if self.active:
            self.store[0] = args[0] if args else kwargs["hidden_states"]

    @classmethod
    def of(cls, model: PreTrainedModel) -> Capture:
        """The model's capture (created on first use and kept on the model)."""
        if "_spechead_capture" not in model.__dict__:
            model.__dict__["_spechead_capture"] = cls(model)
        return model.__dict__["_spechead_capture"]


def check_tree_attention(model: PreTrainedModel) -> None:
    """ValueError when the target cannot take tree passes: attention that takes no arbitrary 4D (tree)
    masks, or layers with recurrent state (Mamba, linear attention: heads/hybrid.py)."""
    fix = "load the target with attn_implementation='spechead_sdpa', 'sdpa' or 'eager'"
    refuse_flash(model.config, "tree verification", fix)
    check_attention_only(model.config, "speculative decoding")
