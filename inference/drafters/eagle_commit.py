"""How many accepted tokens a compiled EAGLE drafter commits as one fixed-shape graph: shared by the
drafter (eagle.py), its batch graphs (eagle_batch_graphs.py), its queued accepts (eagle_ahead.py) and
the engine one draft ahead (engine/loop.py), below all of them."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from spechead.inference.drafters.eagle import EagleDrafter

GRAPH_COMMIT = 16  # compiled: accepts of at most this many tokens run as a graph (the prompt runs eager)


def commit_size(drafter: EagleDrafter) -> int:
    """P: pairs a queued commit runs (a power of two >= the longest accepted path: the tree's depth + 1)."""
    depth = int(drafter._static.depth.max()) if drafter._static is not None else drafter.depth
    return 1 << depth.bit_length()  # >= depth + 1
