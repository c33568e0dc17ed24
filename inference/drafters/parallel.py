"""What the parallel drafters share (P-EAGLE, DFlash: ONE head forward a pass drafts every row's block):
the static block tree (`block_tree.BlockTree`: a node at depth d with rank r carries the r-th best token
of the block's d-th draft), the head's KV cache of committed positions (a `RowCache`, lengths on the host
and the device), a propose from host or device roots, the queued accept's width and the compiled draft.

Queued (engine/loop.py): `accept_queued` takes each row's path padded to P = `commit_width` and its count
k_b on the device, where the lengths move by k_b; `settle` moves the host's once it has read them.

Compiled (`use_compile`): `_tokens` is the draft as ONE fixed-shape function (`compiling.compile_function`)
that writes its buffers only by device index; a CUDA graph bakes their addresses in (`_graph_state`). So
the shapes stay few, the buffers hold the batch's capacity of rows: finished rows stay idle, every pass
runs over all of them (`_over_rows`) and a new batch of the same capacity reuses them.
"""

from __future__ import annotations

from abc import abstractmethod
from collections.abc import Callable, Sequence
from itertools import zip_longest
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from spechead.heads.dflash import DFlashHead
from spechead.heads.grad import inference_mode
from spechead.heads.peagle import PEagleHead
from spechead.inference import compiling
from spechead.inference.devices import host_to_device
from spechead.inference.drafters.base import BatchDraft, Drafter, head_states
from spechead.inference.drafters.block_tree import BlockTree
from spechead.inference.sampling import SamplingParams
from spechead.inference.target.cache import RowCache
from spechead.inference.target.runner import batch_capacity

if TYPE_CHECKING:
    from typing_extensions import Self


class ParallelDrafter(Drafter):
    """B rows' static block trees from one head forward a pass; children deterministic (rule A when
    sampling). A subclass drafts in `_draft` (host bookkeeping around `_draft_fn`) and `_tokens`."""

    tunes_tree = True
    # an eager draft attends over the cache's every slot (DFlash), not only up to its longest row: a start
    # then sizes a new cache for its rows instead of keeping a larger one
    eager_reads_whole_cache = False
    cache: RowCache  # the head's keys / values of committed positions (made by `start`)
    lengths_t: Tensor  # [B] committed lengths on the head's device (made by `start`)

    def __init__(self, head: PEagleHead | DFlashHead, tree: BlockTree) -> None:
        self.head = head.eval()
        self.tree = tree
        self.choices: list[list[int]] = tree.choices
        self.max_nodes = tree.size
        self.hidden_layers = tuple(head.config.target_layers)
        self._compile: bool | str = False  # what `use_compile` was given
        self._draft_fn: Callable[..., Tensor] = self._tokens  # `_tokens`, compiled when asked

    @property
    def lengths(self) -> list[int]:
        """Every active row's committed length on the host."""
        return self.cache.lengths[: self.lengths_t.shape[0]]

    def _new_rows(self, batch: int, need: int) -> None:
        """B new rows at length 0 in a cache of >= `need` slots: the kept one when its rows fit (compiled,
        a pass replays over its buffers; eager, unless `eager_reads_whole_cache`), else a new one."""
        # compiled, the batch's capacity of rows (one graph shape while rows finish); eager, no idle rows
        cache, rows = getattr(self, "cache", None), batch_capacity(batch) if self._compile else batch
        kept = self._compile or not self.eager_reads_whole_cache
        if kept and cache is not None and cache.batch == rows and cache.max_length >= need:
            cache.set_lengths([0] * rows)
        else:
            self.cache = RowCache(self.head.config.num_layers, batch=rows, max_length=need)
        self.lengths_t = torch.zeros(batch, dtype=torch.long, device=self._device())

    def settle(self, ks: Sequence[int]) -> None:
        """The host's committed lengths follow the accept: row b's moves by ks[b], idle rows stay at 0."""
        self.cache.set_lengths([n + k for n, k in zip_longest(self.cache.lengths, ks, fillvalue=0)])

    @inference_mode
    def keep(self, rows: Sequence[int]) -> None:
        self._keep_rows(rows)

    def _keep_rows(self, rows: Sequence[int]) -> Tensor:
        """Only these rows, in this order (compiled: the cache kept whole, rows past B' idle); returns them
        as a device index [B'] for a subclass's own state."""
        self.cache.keep_rows(list(rows), capacity=self.cache.batch if self._compile else None)
        pick = host_to_device(torch.tensor(list(rows)), self._device())
        self.lengths_t = self.lengths_t[pick]
        return pick

    def _fused(self, states: dict[int, Tensor]) -> Tensor:
        """Target states {layer: [..., n, H]} -> fused [..., n, H] on the head's device, in its dtype."""
        return self.head.features(head_states(self.head, states, self.hidden_layers))

    def with_tree(self, choices: list[list[int]]) -> Self:
        """The same head with another static tree (rank paths), compiled as this one."""
        other = type(self)(self.head, choices)  # type: ignore[arg-type]  # (a subclass: head, rank paths)
        other.use_compile(self._compile)
        return other

    def _device(self) -> torch.device:
        return self.head.fc.weight.device

    @staticmethod
    def _over_rows(fn: Callable[..., Tensor], rows: int, batch: int, *args: Any) -> Tensor:
        """fn(*args) over `rows` buffer rows for `batch` active ones: each tensor argument's [B, ...]
        padded with idle rows of zeros to [rows, ...], the first B rows of fn's output."""
        if rows == batch:
            return fn(*args)
        padded = [
            torch.cat([a, a.new_zeros(rows - batch, *a.shape[1:])]) if isinstance(a, Tensor) else a
            for a in args
        ]
        return fn(*padded)[:batch]

    @property
    def commit_width(self) -> int:
        """P: positions a queued accept commits per row, the longest path (the tree's depth + 1)."""
        return self.tree.depth + 1

    @inference_mode
    def propose(
        self,
        roots: Sequence[int],
        sampling: Sequence[SamplingParams],
        generators: Sequence[torch.Generator | None],
    ) -> BatchDraft:
        """Every row's tree rooted at roots [B] from ONE head forward over all rows' blocks (sampling and
        generators are not read: the children are each block slot's top ids)."""
        return self.propose_queued(torch.tensor(list(roots)))

    @inference_mode
    def propose_queued(self, nexts: Tensor) -> BatchDraft:
        """`propose` from the next tokens [B] (host or device; after `accept_queued`)."""
        roots = host_to_device(nexts, self._device())
        batch = roots.shape[0]
        parents = self.tree.batch_parents(batch, roots.device)  # [B, N] (and `pick` where `_draft` reads it)
        tokens = self._draft(roots)  # [B, N]
        return BatchDraft(tokens, parents, [tokens.shape[1]] * batch)

    @abstractmethod
    def _draft(self, roots: Tensor) -> Tensor:
        """Every row's tree tokens [B, N] from its root [B] (on the head's device)."""

    @abstractmethod
    def _tokens(self, *args: Any, **kwargs: Any) -> Tensor:
        """The fixed-shape draft: device tensors (and ints fixed per buffer) -> the trees' tokens [B, N]."""

    def _graph_state(self) -> tuple:
        """What the compiled draft reads besides its arguments: the buffers' allocation and the tree."""
        cache = getattr(self, "cache", None)
        return (cache.generation if cache is not None else None), tuple(map(tuple, self.choices))

    def use_compile(self, compile: bool | str) -> None:
        """Draft through `_tokens` compiled as `compiling.compile_function` says (False: eager)."""
        self._compile, cuda = compile, self._device().type == "cuda"
        self._draft_fn = (
            compiling.compile_function(self._tokens, compile, cuda, fullgraph=True, state=self._graph_state)
            if compile
            else self._tokens
        )
