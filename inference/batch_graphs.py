"""Batch > 1 with fixed shapes: the target's verify and commit as compiled graphs (CUDA graphs on CUDA).

`CompiledBatchRunner` is a `BatchRunner` whose every pass has one of a few shapes, so that
torch.compile traces each once and, on CUDA, each is captured as a CUDA graph of our own
(`runner.compile_function`, cuda_graphs.py):
- rows: `capacity` PHYSICAL rows, fixed for the runner's life; a call's B <= capacity prompts take rows
  0..B-1 and `keep` only remaps which physical row each active row is (no data moves, no new shape).
  An idle row (finished, or never used) runs along with length 0 and a one-node tree: it writes
  scratch into its own row only and its outputs are dropped.
- trees: padded to a bucket size (`runner.CUDA_BUCKETS`) with children of the root nobody attends to;
  accepted paths padded to a power of 2 (repeating their last node).
- the cache: `BatchSlotCache(static_shapes=True)`: row b writes after its device-side length
  `lengths_t[b]` and attends over all S_max slots behind a [P, 1, N, S_max] mask built in the graph.
  The cache lives as long as the runner (the generator keeps one runner per capacity), so graphs
  are reused from one `generate_batch` call to the next.
The prefill stays eager (rows of similar lengths together, any length), as in the batch-1 compiled runner.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from spechead.heads.grad import inference_mode
from spechead.inference.batch import BatchRunner, BatchSlotCache
from spechead.inference.devices import host_to_device
from spechead.inference.runner import CUDA_BUCKETS
from spechead.inference.sliding import layer_masks, slot_positions
from spechead.inference.tree import tree_inputs_after

if TYPE_CHECKING:
    from transformers import PreTrainedModel


def batch_capacity(batch: int) -> int:
    """Physical rows for a batch of `batch`: the next power of 2 (a few graph shapes serve every B)."""
    return 1 << max(batch - 1, 0).bit_length()


class CompiledBatchRunner(BatchRunner):
    """BatchRunner with `capacity` fixed rows and compiled verify / commit passes (see the module doc)."""

    def __init__(
        self,
        model: PreTrainedModel,
        hidden_layers: Sequence[int] = (),
        *,
        max_length: int,
        capacity: int,
        compile: bool | str,
    ) -> None:
        from spechead.inference.runner import compile_function  # (looked up when used, as the drafters do)

        super().__init__(model, hidden_layers, max_length=max_length)
        self.capacity = capacity
        cuda = self.device.type == "cuda"
        self._verify_graph = compile_function(self._graph_verify, compile, cuda, state=self._graph_state)
        self._commit_graph = compile_function(self._graph_commit, compile, cuda, state=self._graph_state)
        self.cache = BatchSlotCache(self.num_layers, capacity, max_length, static_shapes=True)
        self.rows: list[int] = []  # the physical row of each active row, in the caller's order
        self.lengths = torch.zeros(capacity, dtype=torch.long)  # [P] committed positions (host)

    def _graph_state(self) -> tuple:
        """What the graphs read besides their arguments: the cache's allocation and the captured layers."""
        cache = self._cache
        return cache.generation, tuple(self.layers.values())

    @property
    def _cache(self) -> BatchSlotCache:
        assert self.cache is not None  # made in __init__, kept for the runner's life
        return self.cache

    def _sync_lengths(self) -> None:
        """The device lengths follow the host's (one small copy, no sync)."""
        lengths_t = self._cache.lengths_t
        if lengths_t is not None:
            lengths_t.copy_(host_to_device(self.lengths, lengths_t.device))  # (device to device)

    def room(self) -> int:
        """Tree nodes every row can still take (idle rows sit at length 0)."""
        return self.max_length - int(self.lengths.max())

    @torch.inference_mode()
    def prefill(self, prompts: Sequence[Tensor]) -> tuple[Tensor, list[dict[int, Tensor]]]:
        """Prefill prompts ids_b [T_b] (B <= capacity) into rows 0..B-1, eagerly (length groups):
        logits [B, V] (fp32, last positions), [{l: [T_b, H]}]."""
        if len(prompts) > self.capacity:
            raise ValueError(f"{len(prompts)} prompts > this runner's {self.capacity} rows")
        self.check_prompts(prompts)
        self.lengths.zero_()
        logits, hiddens = self._prefill_rows(prompts, self._cache)  # [B, V]
        self.lengths[: len(prompts)] = torch.tensor([p.numel() for p in prompts])
        self.rows = list(range(len(prompts)))
        self._sync_lengths()
        return logits, hiddens

    def _bucket(self, n: int) -> int:
        room = self.room()
        return next((s for s in CUDA_BUCKETS if n <= s <= room), n)

    @inference_mode
    def verify(self, tokens: Tensor, parents: Tensor) -> tuple[Tensor, dict[int, Tensor]]:
        """ONE compiled target forward over the active rows' trees tokens [B, N] / parents [B, N]:
        logits [B, N, V] (fp32) and {l: [B, N, H]}, as `BatchRunner.verify`."""
        batch, n = tokens.shape
        if parents.shape != tokens.shape or batch != len(self.rows):
            raise ValueError(
                f"tokens and parents must be [B={len(self.rows)}, N], got {tuple(tokens.shape)}, "
                f"{tuple(parents.shape)}"
            )
        if n > self.room():
            raise ValueError(f"a tree of {n} nodes does not fit: {self.room()} KV slots left")
        size, dev = self._bucket(n), self.device
        first = self.rows == list(range(batch))  # the active rows are physical rows 0..B-1 (no rows left)
        host = tokens.device.type == "cpu" and parents.device.type == "cpu"
        # [2, P, N'] tokens, parents of every physical row: idle rows a one-node tree, padding children
        # of the root nobody attends to; packed on the host where the draft is (one copy to the device)
        packed = torch.zeros(2, self.capacity, size, dtype=torch.long, device="cpu" if host else dev)
        packed[1, :, 0] = -1
        picked = (
            None if first else host_to_device(torch.tensor(self.rows), packed.device)
        )  # [B] physical rows
        rows: slice | Tensor = slice(0, batch) if picked is None else picked
        packed[0, rows, :n] = tokens
        packed[0, rows, n:] = tokens[:, :1]
        packed[1, rows, :n] = parents
        all_tokens, all_parents = host_to_device(packed, dev)  # [P, N'] each (no wait for the GPU)
        logits, anc, states = self._verify_graph(all_tokens, all_parents)  # [P, N', V], [P, N', N']
        if picked is not None and host:
            rows = host_to_device(picked, dev)
        self.last_ancestors = anc[rows, :n, :n]  # [B, N, N] (views when the rows come first)
        hidden = {k: v[rows, :n] for k, v in zip(self.layers, states)}
        return logits[rows, :n], hidden

    def _graph_verify(self, tokens: Tensor, parents: Tensor) -> tuple[Tensor, Tensor, tuple[Tensor, ...]]:
        """The compiled pass over all P rows, trees tokens / parents [P, N] after the device lengths:
        logits [P, N, V] (fp32), ancestors [P, N, N], the captured layers' states [P, N, H] (graph
        outputs, not hooks: hooks added after a graph was traced would not run in it)."""
        cache = self._cache
        lengths = cache.lengths_t
        assert lengths is not None  # the prefill's copies allocated it
        mask, positions, anc = tree_inputs_after(parents, lengths, cache.max_length, self.dtype)
        keys = slot_positions(lengths, positions, cache.max_length) if self.sliding else positions  # [P, S]
        out = self.model(
            input_ids=tokens,
            attention_mask=layer_masks(self.sliding, mask, positions, keys),
            position_ids=positions,
            cache=cache,
            use_cache=True,
            output_hidden_states=bool(self.layers),
        )
        states = tuple(out.hidden_states[c] for c in self.layers.values()) if self.layers else ()
        return out.logits.float(), anc, states

    @inference_mode
    def commit(self, paths: Sequence[Tensor | Sequence[int]]) -> None:
        """Active row b keeps the accepted nodes paths[b] [K_b] (ascending, paths[b][0] = 0)."""
        if len(paths) != len(self.rows):
            raise ValueError(f"need one path per row ({len(self.rows)}), got {len(paths)}")
        nodes = [p.tolist() if isinstance(p, Tensor) else list(p) for p in paths]  # host lists
        ks = [len(p) for p in nodes]
        if any(p != list(range(k)) for p, k in zip(nodes, ks)):  # some path must move
            size = 1 << max(max(ks) - 1, 0).bit_length()  # K' >= K_b: a few graph shapes
            padded = [[0] * size for _ in range(self.capacity)]  # [P, K'] idle rows: node 0
            for row, p in zip(self.rows, nodes):
                padded[row] = p + p[-1:] * (size - len(p))
            self._commit_graph(host_to_device(torch.tensor(padded), self.device))  # one copy, no wait
        self.lengths.index_add_(0, torch.tensor(self.rows), torch.tensor(ks))
        self._sync_lengths()

    queues_commits = True  # `commit_queued` runs here (engine/loop.py)

    @inference_mode
    def commit_queued(self, paths: Tensor) -> None:
        """`commit` of paths still on the device, in two halves: the copies queued now (paths [B, P]: each
        active row's accepted nodes ascending, then its last one repeated), `advance(K_b)` once read."""
        padded = paths.new_zeros(self.capacity, paths.shape[1])  # [P_rows, P] idle rows: node 0
        padded[host_to_device(torch.tensor(self.rows), paths.device)] = paths
        self._commit_graph(padded)

    @inference_mode
    def advance(self, ks: Sequence[int]) -> None:
        """The second half of `commit_queued`: active row b committed ks[b] entries (host and device)."""
        self.lengths.index_add_(0, torch.tensor(self.rows), torch.tensor(list(ks)))
        self._sync_lengths()

    def _graph_commit(self, nodes: Tensor) -> None:
        """Copy each row's entries of tree nodes [P, K] to the K slots after its device length, in every
        layer. Padding repeats the last node: its copies land past the new length (scratch), clamped
        to the last slot where the cache ends (the same entry's value)."""
        cache = self._cache
        lengths = cache.lengths_t
        assert lengths is not None  # verify ran
        rows, k = nodes.shape
        src = lengths[:, None] + nodes  # [P, K] slots the verify wrote these nodes at
        dst = (lengths[:, None] + torch.arange(k, device=nodes.device)).clamp(max=cache.max_length - 1)
        for layer in cache.slot_layers:
            for buf in (layer.keys, layer.values):
                _, heads, _, dim = buf.shape
                moved = buf.gather(2, src[:, None, :, None].expand(rows, heads, k, dim))  # copies first
                buf.scatter_(2, dst[:, None, :, None].expand(rows, heads, k, dim), moved)

    @inference_mode
    def keep(self, rows: Sequence[int]) -> None:
        """Keep only these active rows (in this order); the others become idle (length 0)."""
        kept = [self.rows[i] for i in rows]
        for row in set(self.rows) - set(kept):
            self.lengths[row] = 0
        self.rows = kept
        self._sync_lengths()


def kept_runner(
    kept: dict[tuple, CompiledBatchRunner],
    target: PreTrainedModel,
    hidden_layers: Sequence[int],
    batch: int,
    max_length: int,
    compile: bool | str,
) -> CompiledBatchRunner:
    """The compiled runner in `kept` for `batch` rows of up to `max_length` slots, made (and kept) when
    none fits: one per capacity and captured layers, grown to the longest batch seen (its graphs, and
    on CUDA its captures, are reused by every later call that fits)."""
    key = (batch_capacity(batch), tuple(hidden_layers))
    runner = kept.get(key)
    if runner is None or runner.max_length < max_length:
        length = max(max_length, runner.max_length if runner is not None else 0)
        runner = CompiledBatchRunner(
            target, hidden_layers, max_length=length, capacity=key[0], compile=compile
        )
        kept[key] = runner
    return runner
