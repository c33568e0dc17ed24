"""EAGLE-1/2 and EAGLE-3 drafting: ONE drafter for any number of rows, static or dynamic (EAGLE-2) trees.

Cache convention (as in training, spechead.heads.unroll): the head's cache holds one COMMITTED entry per
position t whose pair (target feature f_t, token x_{t+1}) is known, at rotary position t; C, the number of
committed entries, is the target's cached length. The last pair's output (token x_C = the root) predicts
its children. A node at depth d >= 1 runs as TTT step d at position C + d - 1: its parent's output
feature and its own token, attending to the C committed entries, its ancestors and itself (`ttt_allowed`).

The rows live in eager `EagleRows` (rows.py) or, compiled, in `GraphRows` (graphs.py), chosen at `start`.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from spechead.heads.eagle import EagleHead
from spechead.heads.eagle3 import Eagle3Head
from spechead.heads.fused import fused_logits, fused_step
from spechead.inference.drafters.base import BatchDraft, Drafter, at_least
from spechead.inference.drafters.eagle.graphs import GRAPH_COMMIT, GraphRows
from spechead.inference.drafters.eagle.rows import EagleRows
from spechead.inference.drafters.eagle.static_plan import StaticPlan, build_static_plan
from spechead.inference.drafters.topk import Chunk
from spechead.inference.sampling import SamplingParams
from spechead.inference.tree import StaticTree, tree_from_choices


class EagleDrafter(Drafter):
    """Drafts token trees for B rows with an EagleHead (EAGLE-1/2) or Eagle3Head.

    tree: "dynamic" (EAGLE-2: per depth expand the `top_k` frontier nodes of highest cumulative log-prob,
    each with its `top_k` children, down to `depth`; keep the best `total_tokens - 1` nodes) or static rank
    paths, e.g. [[0], [1], [0, 0]] (`tree_from_choices`). rule: when sampling, children are the head's
    top-k ("deterministic", rule A) or, for a static tree drafted eagerly for a batch of one, draws from
    the head ("without_replacement", rule C: sampled_children.py).
    """

    tunes_tree = True  # `with_tree` swaps its static tree

    def __init__(
        self,
        head: EagleHead | Eagle3Head,
        *,
        tree: str | list[list[int]] = "dynamic",
        top_k: int = 10,
        depth: int = 6,
        total_tokens: int = 60,
        rule: str = "deterministic",
    ) -> None:
        if rule not in ("deterministic", "without_replacement"):  # top-k children, or drawn ones
            raise ValueError(f'rule must be "without_replacement" or "deterministic", got {rule!r}')
        self.rule = rule  # how a static tree's children are chosen when sampling
        self.head = head
        self._weight = head.fc.weight  # the head's device and dtype (head.to() moves it in place)
        # the head's step and logits as short chains of ops on its own weights where its layer kind allows
        self.head_step = fused_step(head) or head.step
        self.head_logits = fused_logits(head) or head.logits  # (B, T, H) -> (B, T, Vd)
        self.hidden_layers = tuple(head.config.target_layers)
        self._vocab = getattr(head.config, "draft_vocab_size", head.config.vocab_size)  # Vd
        self._vocab_out = head.config.vocab_size  # V: the target's
        self._static: StaticTree | None = None
        if isinstance(tree, str):
            if tree != "dynamic":
                raise ValueError(f'tree must be "dynamic" or a list of rank paths, got {tree!r}')
            at_least("top_k", top_k)
            at_least("depth", depth)
            at_least("total_tokens", total_tokens, 2)
            if top_k > self._vocab:
                raise ValueError(f"top_k {top_k} exceeds the head's (draft) vocab size {self._vocab}")
        else:
            self._static = tree_from_choices(tree)
            self.choices = [list(c) for c in tree]
            if int(self._static.rank.max()) >= self._vocab:
                raise ValueError(f"a static tree rank exceeds the head's (draft) vocab size {self._vocab}")
        self.top_k, self.depth, self.total_tokens = top_k, depth, total_tokens
        # the most nodes a proposed tree can have (the root included)
        self.max_nodes = self._static.size if self._static is not None else total_tokens
        self._plan: StaticPlan | None = None  # static tree: per-depth index tensors, built once
        # head cache slots a propose may write past C_b: the speculative ones (depth-1 runs of top_k nodes,
        # or the static inner nodes) and a whole tree
        spec = (depth - 1) * top_k if self._static is None else int((self._static.depth > 0).sum())
        self._spec_room = spec + self.max_nodes
        self._compile: bool | str = False  # what `use_compile` was given
        self._graphs: GraphRows | None = None  # compiled: the kept fixed-shape rows (their graphs), once made
        # compiled drafting of B > 1 rows: None = on CUDA only (on a CPU the eager batch draft is faster:
        # docs/PERFORMANCE.md); True: wherever compiled; False: never. (A compiled batch of one always is.)
        self.batch_graphs: bool | None = None
        self.topk_chunk: Chunk = "auto"  # each depth's top-k over chunks of this many ids (topk.py)
        self._d2t: Tensor | None = None  # [Vd] target id of every head-vocab id (one gather maps ids)
        self._rows: EagleRows | None = None  # where the rows live (module doc): EagleRows / GraphRows

    def with_tree(self, choices: list[list[int]]) -> EagleDrafter:
        """The same head with a static tree of these rank paths (see `tree_from_choices`)."""
        other = EagleDrafter(self.head, tree=choices, rule=self.rule)
        other.batch_graphs, other.topk_chunk = self.batch_graphs, self.topk_chunk
        return other

    def use_compile(self, compile: bool | str) -> None:
        """Draft and accept as fixed-shape graphs (`GraphRows`) where `_graphed` says. compile: True
        (inductor; CUDA graphs on CUDA), "graphs" (the eager functions captured as CUDA graphs), a
        torch.compile backend name, or False (eager)."""
        self._compile, self._graphs = compile, None  # (the graphs are made at the next start)

    def _graphed(self, batch: int) -> bool:
        """Whether `batch` rows draft as graphs: compiled, one row always, more as `batch_graphs` says."""
        wanted = self._weight.device.type == "cuda" if self.batch_graphs is None else self.batch_graphs
        return bool(self._compile) and (batch == 1 or wanted)

    # ---- Drafter: the rows' (their methods run under inference mode) -----------------------------

    def start(
        self, prompts: Sequence[Tensor], hidden: Sequence[dict[int, Tensor]], roots: Sequence[int]
    ) -> None:
        """New rows (whatever came before): commit each row's prompt pairs (f_t, x_{t+1}), x_T = root."""
        if self._graphed(len(prompts)):
            if self._graphs is None:
                self._graphs = GraphRows(self, self._compile)
            self._rows = self._graphs
        else:
            self._rows = EagleRows(self)
        self._rows.start(prompts, hidden, roots)

    def propose(
        self,
        roots: Sequence[int],
        sampling: Sequence[SamplingParams],
        generators: Sequence[torch.Generator | None],
    ) -> BatchDraft:
        return self._started().propose(roots, sampling, generators)

    def accept(
        self, tokens: Tensor, lengths: Sequence[int], hidden: dict[int, Tensor], next_roots: Sequence[int]
    ) -> None:
        self._started().accept(tokens, lengths, hidden, next_roots)

    def keep(self, rows: Sequence[int]) -> None:
        self._started().keep(rows)

    def _started(self) -> EagleRows:
        if self._rows is None:
            raise RuntimeError("EagleDrafter: start first")
        return self._rows

    # ---- Drafter: one draft ahead (engine/loop.py), the graphs' ---------------------------------

    def queues(self, batch: int) -> bool:
        """Whether `batch` rows accept and draft from device tensors (the base's rule): compiled as graphs,
        and the commit of a path fits one graph (P <= GRAPH_COMMIT)."""
        return super().queues(batch) and self._graphed(batch) and self.commit_width <= GRAPH_COMMIT

    @property
    def commit_width(self) -> int:
        """P: pairs a queued accept commits per row (a power of two >= the longest path: depth + 1)."""
        depth = int(self._static.depth.max()) if self._static is not None else self.depth
        return 1 << depth.bit_length()

    def accept_queued(self, hidden, tokens, paths, ks, nexts) -> None:
        self._queued().accept_queued(hidden, tokens, paths, ks, nexts)

    def propose_queued(self, nexts: Tensor) -> BatchDraft:
        return self._queued().propose_queued(nexts)

    def settle(self, ks: Sequence[int]) -> None:
        self._queued().settle(ks)

    def _queued(self) -> GraphRows:
        assert isinstance(self._rows, GraphRows)  # `queues` held: the graphs' rows
        return self._rows

    # ---- what the rows share: the head's id map, the static plan ------------------

    def _to_target(self, ids: Tensor) -> Tensor:
        """Head-vocab ids (any shape) -> target ids (EAGLE-3 maps its draft vocab with d2t)."""
        return self.head.draft_to_target(ids) if self._d2t is None else self._d2t[ids]

    def _map_ids(self, device: torch.device) -> None:
        """Make `_d2t`, the whole map (one gather a depth; a compiled draft reads it), before drafting."""
        if self._vocab != self.head.config.vocab_size and (self._d2t is None or self._d2t.device != device):
            self._d2t = self.head.draft_to_target(torch.arange(self._vocab, device=device))  # [Vd]

    def _static_plan(self) -> StaticPlan:
        """The static tree's per-depth plan (built once, on the head's device; see static_plan.py)."""
        if self._plan is None:
            assert self._static is not None  # only a static tree has a plan
            self._plan = build_static_plan(self._static, self._weight.device)
        return self._plan
