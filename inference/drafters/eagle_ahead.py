"""A compiled EagleDrafter's accept and next draft queued from an acceptance still on the device.

The engine one draft ahead (engine/loop.py) queues the head's commit of the accepted path and the
next whole draft before the host has read which path that is: the path comes as device tensors (its nodes
[N], their count K [0-d], the target's next token [0-d]), so every shape is fixed: the commit runs on
P >= K pairs (the pairs past K land in scratch slots no earlier pair sees, as `_commit` pads), the head
cache's device length moves by K on the device, and the next draft reads the last real pair's output and
the next token from device tensors. Once the host has read K, `settle` makes its bookkeeping follow.
`EagleAhead` is the drafter's queued form for the engine (drafters/ahead.py says what each method does).
"""

from __future__ import annotations

from typing import TypeGuard

import torch
from torch import Tensor

from spechead.heads.grad import inference_mode
from spechead.inference.drafters.base import Draft
from spechead.inference.drafters.eagle import EagleDrafter
from spechead.inference.drafters.eagle_commit import GRAPH_COMMIT, commit_size
from spechead.inference.tree import TokenTree


def runs_ahead(drafter: object) -> TypeGuard[EagleDrafter]:
    """Whether `drafter` can accept and draft from device tensors: an EagleDrafter itself (a subclass may
    hear paths its own way), compiled (its commit and draft fixed-shape graphs), with P <= GRAPH_COMMIT."""
    return (
        type(drafter) is EagleDrafter
        and drafter._compiled is not None
        and drafter._compiled_commit is not None
        and commit_size(drafter) <= GRAPH_COMMIT
    )


class EagleAhead:
    """A compiled EagleDrafter (`runs_ahead`) driven from an acceptance on the device (drafters/ahead.py)."""

    def __init__(self, drafter: EagleDrafter):
        self.drafter = drafter
        self.size = commit_size(drafter)  # P: the path's length at least that `accept` reads

    @inference_mode
    def accept(
        self, hidden: dict[int, Tensor], tokens: Tensor, path: Tensor, k: Tensor, next_token: Tensor
    ) -> None:
        """Queue the commit of the accepted path: target states {layer: [1, N, H]} of the verified tree, its
        tokens [N] (device), path [>= P] (the nodes ascending, the last repeated), K [0-d] and the target's
        next token [0-d]. The head cache's device length moves by K; the host's count waits for `settle`."""
        drafter = self.drafter
        cache = drafter._cache
        assert cache is not None and drafter._compiled_commit is not None  # start ran; runs_ahead held
        p = self.size
        rows = path[:p]  # [P]
        features = drafter._features(hidden, tokens.shape[0])[0, rows]  # [P, H]
        ids = tokens[rows]  # [P]: the pairs' own tokens, then the last one repeated
        # pair i is fed the token after it: the path's next node for i < K - 1, the target's token at K - 1
        after = torch.cat([ids[1:], next_token.view(1)])  # [P]
        after = torch.where(torch.arange(p, device=ids.device) == k - 1, next_token, after)[None]  # [1, P]
        # room for these pairs and the next draft, grown (rarely) now: the host's count is C until
        # `settle`, and a grown cache takes its device length from it
        drafter._ensure_room(p + drafter.max_nodes)
        length = cache.device_length()
        out = drafter._compiled_commit(features, after, length)  # [P, H]
        length.add_(k)  # C + K committed (the draft graph reads it)
        drafter._feature = out.index_select(0, (k - 1).view(1))  # [1, H]: the last real pair's output

    @inference_mode
    def propose(self, root: Tensor) -> Draft:
        """The next tree drafted from the root (a one-element device tensor) after `accept`, as `propose`
        drafts it greedily; the speculative entries stay until `settle` crops them."""
        drafter = self.drafter
        cache = drafter._cache
        assert cache is not None and drafter._compiled is not None and drafter._feature is not None
        drafter._map_ids(drafter._weight.device)
        drafter._values = None
        if drafter._static is not None:
            drafter._static_plan()  # built eagerly (host loops), read by the graph
        tokens, parents, scores = drafter._compiled(drafter._feature, root.view(1, 1), cache.device_length())
        drafter._scores = scores  # [N] on the head's device
        drafter._root = None  # (known once settled)
        if drafter._plan is not None:
            return Draft(tree=TokenTree.trusted(tokens, drafter._plan.host_parents))
        return Draft(tree=TokenTree.trusted(tokens, parents), rule="deterministic")

    @inference_mode
    def settle(self, k: int, next_token: int) -> None:
        """The host's count follows the queued commit (K pairs) and the draft's speculative entries are
        dropped (the device length set to C + K again)."""
        drafter = self.drafter
        cache = drafter._cache
        assert cache is not None  # start ran
        drafter._committed += k
        cache.set_length(drafter._committed)
        drafter._root = next_token
