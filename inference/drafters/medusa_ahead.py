"""A MedusaDrafter driven from an acceptance still on the device (engine/loop.py, drafters/ahead.py).

Medusa's heads read one target state, the last accepted node's, and nothing of theirs is cached: the
queued accept gathers that state from the verified tree's at the path's last node (a device index), the
queued draft runs the heads and writes the root from the target's next token on the device. No shape
depends on the path, so it runs eager (no graph of the heads needed) and there is nothing to settle.
"""

from __future__ import annotations

from typing import TypeGuard

from torch import Tensor

from spechead.heads.grad import inference_mode
from spechead.inference.drafters.base import Draft
from spechead.inference.drafters.medusa import MedusaDrafter
from spechead.inference.tree import TokenTree


class MedusaAhead:
    """A MedusaDrafter itself (a subclass may hear paths its own way: `runs_ahead` refuses it)."""

    size = 1  # `accept` reads the path's last entry only

    def __init__(self, drafter: MedusaDrafter):
        self.drafter = drafter
        self.layer = drafter.hidden_layers[0]

    @staticmethod
    def runs_ahead(drafter: object) -> TypeGuard[MedusaDrafter]:
        """Whether `drafter` drafts from device tensors this way: a MedusaDrafter, not a subclass."""
        return type(drafter) is MedusaDrafter

    @inference_mode
    def accept(
        self, hidden: dict[int, Tensor], tokens: Tensor, path: Tensor, k: Tensor, next_token: Tensor
    ) -> None:
        """The heads' next state: the verified tree's states {layer: [1, N, H]} at the path's last node
        (path [>= 1], the accepted nodes ascending with the last repeated, so its last entry)."""
        states = hidden[self.layer][0]  # [N, H]
        self.drafter.last_hidden = states.index_select(0, path[-1:].to(states.device))[0]  # [H]

    @inference_mode
    def propose(self, root: Tensor) -> Draft:
        """The static tree's tokens [N] from the heads' top ids and the root (a one-element device tensor)."""
        drafter = self.drafter
        assert drafter.last_hidden is not None  # start ran
        if drafter._used_heads:
            tokens = drafter._one_row(drafter.last_hidden, root)  # [N]
        else:  # a root-only tree
            tokens = root.reshape(1)
        return Draft(TokenTree.trusted(tokens, drafter.static.parents))

    def settle(self, k: int, next_token: int) -> None:
        """Nothing: the heads keep no count of their own."""
