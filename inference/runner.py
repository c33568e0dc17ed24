"""Compatibility shim, to be deleted with the decode loops that still call it (generator.py,
plain_ahead.py, spec_ahead.py): the old batch-of-one `TargetRunner` API over the one runner
(spechead.inference.target, which new code uses).

    runner = TargetRunner(model, hidden_layers, cache="static")
    runner.reserve(prompt_len, max_new_tokens, tree_room)   # one row
    logits, hidden = runner.prefill(ids)                     # ids [1, T] -> [1, V], {l: [1, T, H]}
    logits, hidden = runner.verify(tokens, parents)          # [1, N] each (the one runner's own verify)
    runner.commit(path)                                      # one row's accepted nodes [K]

cache: "static" or "dynamic" name what the generator asks for; both run on the one runner's row cache
(the DynamicCache back-end is gone). compile: the one runner with one fixed physical row, its trees
padded to CUDA_BUCKETS unless `buckets` says otherwise (as before).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from torch import Tensor

from spechead.inference.target.capture import check_tree_attention
from spechead.inference.target.commit import Path
from spechead.inference.target.runner import CUDA_BUCKETS
from spechead.inference.target.runner import TargetRunner as OneRunner

if TYPE_CHECKING:
    from transformers import PreTrainedModel

__all__ = ["CACHES", "CUDA_BUCKETS", "TargetRunner", "check_tree_attention"]

CACHES = ("dynamic", "static")


class TargetRunner:
    """One row through `OneRunner` with the old call shapes; every other attribute is the one runner's."""

    def __init__(
        self,
        model: PreTrainedModel,
        hidden_layers: Sequence[int] = (),
        *,
        cache: str = "dynamic",
        max_length: int | None = None,
        buckets: Sequence[int] | None = None,
        compile: bool | str = False,
    ) -> None:
        if cache not in CACHES:
            raise ValueError(f"cache must be one of {CACHES}, got {cache!r}")
        if compile and cache != "static":
            raise ValueError(f"compile=True needs cache='static' (fixed shapes), got cache={cache!r}")
        buckets = buckets or (CUDA_BUCKETS if compile else ())
        one = OneRunner(model, hidden_layers, max_length=max_length, buckets=buckets, compile=compile)
        self._bind(one, cache)

    @classmethod
    def around(cls, one: OneRunner) -> TargetRunner:
        """The old shapes over an existing one runner (a benchmark hands the runner it measured to a
        generator)."""
        shim = cls.__new__(cls)
        shim._bind(one, "static")
        return shim

    def _bind(self, one: OneRunner, cache: str) -> None:
        self.kind, self.one = cache, one
        self.verify = one.verify  # (bound once: no extra call a pass)
        self.room = one.room
        self.use_layers = one.use_layers

    def __getattr__(self, name: str) -> Any:
        if name == "one":  # (not set yet: no recursion)
            raise AttributeError(name)
        return getattr(self.one, name)

    @property
    def length(self) -> int:
        """The row's committed positions (set it to drop later commits)."""
        lengths = self.one.lengths
        return lengths[0] if lengths else 0

    @length.setter
    def length(self, length: int) -> None:
        self.one.lengths = [length]

    def reserve(self, prompt_len: int, max_new_tokens: int, tree_room: int = 64) -> None:
        """`OneRunner.reserve` for one row."""
        self.one.reserve([prompt_len], [max_new_tokens], tree_room)

    def prefill(self, input_ids: Tensor) -> tuple[Tensor, dict[int, Tensor]]:
        """input_ids [1, T] -> logits [1, V] (fp32, last position), {l: [1, T, H]}."""
        if input_ids.dim() != 2 or input_ids.shape[1] == 0:
            raise ValueError(f"prefill takes input_ids [B, T] with T >= 1, got {tuple(input_ids.shape)}")
        if input_ids.shape[0] != 1:
            raise ValueError(f"this runner decodes batch size 1, got B = {input_ids.shape[0]}")
        logits, hiddens = self.one.prefill([input_ids[0]])
        return logits, {k: v[None] for k, v in hiddens[0].items()}

    def commit(self, path: Path) -> None:
        """Keep the accepted nodes `path` [K] (ascending, path[0] = 0) of the last verify."""
        self.one.commit((path,))

    def commit_queued(self, path: Tensor) -> None:
        """`OneRunner.commit_queued` of one row's device path [P]."""
        self.one.commit_queued(path[None])

    def advance(self, k: int) -> None:
        """`OneRunner.advance` of one row."""
        self.one.advance((k,))
