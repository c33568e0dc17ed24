"""A compiled runner's verify and commit: ONE fixed-shape pass each over every physical row, traced or
captured once per shape through `compiling.compile_function` (CUDA graphs of our own on CUDA). Row b
writes after its DEVICE length and attends over the whole buffer behind a mask made inside the graph, so
one graph serves every length; idle rows run along at length 0 with a one-node tree."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import Tensor

from spechead.inference import compiling
from spechead.inference.devices import host_to_device
from spechead.inference.target.commit import move_fixed, padded_paths
from spechead.inference.target.tree_inputs import pack_rows, rows_inputs

if TYPE_CHECKING:
    from spechead.inference.target.cache import RowCache
    from spechead.inference.target.runner import TargetRunner


class RowGraphs:
    """The graphs of `runner` (compile: as `compiling.compile_function` takes it); they read its cache's
    buffers and captured layers (`_state`: a new allocation or other layers make new graphs)."""

    def __init__(self, runner: TargetRunner, compile: bool | str) -> None:
        self.runner = runner
        cuda = runner.device.type == "cuda"
        self._verify = compiling.compile_function(self._graph_verify, compile, cuda, state=self._state)
        self._commit = compiling.compile_function(self._graph_commit, compile, cuda, state=self._state)

    def verify(self, cache: RowCache, tokens: Tensor, parents: Tensor, size: int) -> tuple[Tensor, dict]:
        """The active rows' trees tokens / parents [B, N], padded to `size`, verified in one pass: logits
        [B, N, V] (fp32) and {l: [B, N, H]}; sets the runner's last ancestors."""
        runner = self.runner
        n, dev = tokens.shape[1], runner.device
        all_tokens, all_parents, rows = pack_rows(tokens, parents, runner.rows, cache.batch, size, dev)
        logits, anc, states = self._verify(all_tokens, all_parents)  # [P, N', V], [P, N', N']
        runner.last_ancestors = anc[rows, :n, :n]  # (a view)
        return logits[rows, :n], {k: v[rows, :n] for k, v in zip(runner.layers, states)}

    def commit(self, cache: RowCache, paths: list[list[int]]) -> None:
        """Queue the copies of the active rows' accepted nodes (host lists) into place (`padded_paths`)."""
        nodes = padded_paths(paths, self.runner.rows, cache.batch)
        if nodes is not None:  # some path must move
            self._commit(host_to_device(nodes, self.runner.device))  # one copy, no wait

    def commit_queued(self, cache: RowCache, paths: Tensor) -> None:
        """Queue the copies of device paths [B, P] (accepted nodes ascending, the last one repeated)."""
        padded = paths.new_zeros(cache.batch, paths.shape[1])  # [P_rows, P] idle rows: node 0
        padded[host_to_device(torch.tensor(self.runner.rows), paths.device)] = paths
        self._commit(padded)

    def _graph_verify(self, tokens: Tensor, parents: Tensor) -> tuple[Tensor, Tensor, tuple[Tensor, ...]]:
        """The pass over all P rows, trees tokens / parents [P, N] after the device lengths: logits
        [P, N, V] (fp32), ancestors [P, N, N] and the captured layers' states [P, N, H] (graph outputs,
        not hooks: hooks added after a graph was traced would not run in it)."""
        runner, cache = self.runner, self.runner.cache
        assert cache is not None and cache.lengths_t is not None  # the prefill's copies made them
        masks, positions, anc = rows_inputs(
            runner.sliding, parents, cache.lengths_t, cache.max_length, runner.dtype
        )
        out = runner.model(
            input_ids=tokens,
            attention_mask=masks,
            position_ids=positions,
            cache=cache,
            use_cache=True,
            output_hidden_states=bool(runner.layers),
        )
        states = tuple(out.hidden_states[c] for c in runner.layers.values()) if runner.layers else ()
        return out.logits.float(), anc, states

    def _graph_commit(self, nodes: Tensor) -> None:
        """The commit's body: nodes [P, K] of every physical row moved into place (commit.move_fixed)."""
        assert self.runner.cache is not None  # (after a prefill)
        move_fixed(self.runner.cache, nodes)

    def _state(self) -> tuple:
        """What the graphs read besides their arguments: the cache's allocation and the captured layers."""
        cache = self.runner.cache
        return (cache.generation if cache is not None else None), tuple(self.runner.layers.values())
