"""EAGLE-1/2 and EAGLE-3 drafting: ONE drafter for any number of rows, static (Medusa-style) or dynamic
(EAGLE-2) trees from a feature head.

Cache convention (as in training, spechead.heads.unroll): the head's cache holds one COMMITTED entry per
position t whose pair (target feature f_t, token x_{t+1}) is known, at rotary position t; C = number of
committed entries = the target's cached length. The output of the last pair (position C - 1, token x_C =
the root) predicts its children.

Drafting a tree rooted at x_C: a node at depth d >= 1 (token x_{C+d}) is run as TTT step d at position
C + d - 1: it reads its parent's output feature and its own token, and attends to the C committed entries,
the entries of its ancestors at depths 1..d-1 and itself (exactly `ttt_allowed`). Growth runs on the head's
device: one head call per depth over every row's frontier, top-k and cumulative scores kept as tensors.

Where the rows live is a setting of the one drafter, chosen at `start`:
- a batch of one, eager (a CPU's case): this object's own state, a `RowCache` of one row grown by doubling,
  the speculative entries dropped after every propose; host-list commits, kept masks and kept buffers
  (drafters/eagle/growth.py) because on a CPU each op costs about as much as the head's small GEMMs;
- B rows, eager: `EagleRows` (rows.py), per-row committed lengths in one `RowCache` [B, ...];
- compiled (`use_compile`): `GraphRows` (graphs.py), the same growth code with fixed shapes, every row's
  whole draft and accept one captured graph each, kept per row capacity; its accept and next draft also
  run from an acceptance still on the device (`queues`: the engine's depth 1).
Row b's tree is the tree its batch of one proposes (up to float rounding of batched matmuls).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from spechead.heads.eagle import EagleHead
from spechead.heads.eagle3 import Eagle3Head
from spechead.heads.fused import fused_logits, fused_step
from spechead.heads.grad import inference_mode
from spechead.inference.devices import host_ids
from spechead.inference.drafters.base import BatchDraft, Drafter, path_index
from spechead.inference.drafters.eagle.graphs import GRAPH_COMMIT, GraphRows
from spechead.inference.drafters.eagle.growth import EagleGrowth
from spechead.inference.drafters.eagle.head_masks import HeadMasks
from spechead.inference.drafters.eagle.rows import EagleRows
from spechead.inference.drafters.eagle.sampled_children import SampledChildren, check_rule
from spechead.inference.drafters.eagle.static_eager import StaticOutputs
from spechead.inference.drafters.eagle.static_plan import StaticPlan, kept_scores
from spechead.inference.drafters.topk import Chunk
from spechead.inference.positions import PositionIds
from spechead.inference.sampling import SamplingParams
from spechead.inference.target.cache import RowCache
from spechead.inference.tree import StaticTree, TokenTree, causal_inputs_static, tree_from_choices


class EagleDrafter(EagleGrowth, Drafter):
    """Drafts token trees for B rows with an EagleHead (EAGLE-1/2) or Eagle3Head; children are the head's
    top-k.

    tree: "dynamic" (EAGLE-2: per depth expand the `top_k` frontier nodes of highest cumulative
    log-prob, each with its `top_k` children, down to `depth`; keep the best `total_tokens - 1`
    nodes) or static paths of child ranks, e.g. [[0], [1], [0, 0]] (see `tree_from_choices`).
    rule: when sampling, children are the head's top-k ("deterministic", rule A) or, for a static tree
    drafted eagerly for a batch of one, draws from the head ("without_replacement", rule C:
    sampled_children.py; more accepted at temperatures near 1, for more draft work a depth). Greedy takes
    the top-k. After each eager batch-of-one `propose`, `last_scores` [N] holds every node's cumulative
    draft log-prob (root 0).
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
        self.rule = check_rule(rule)  # how a static tree's children are chosen when sampling
        self.head = head
        # the head's device and dtype from one kept Parameter (head.to() moves it in place; no module lookup)
        self._weight = head.fc.weight
        # the head's step as a short chain of ops on its own weights where its layer kind allows
        self.head_step = fused_step(head) or head.step
        self.head_logits = fused_logits(head) or head.logits  # (B, T, H) -> (B, T, Vd), the same way
        self.hidden_layers = tuple(head.config.target_layers)
        self._vocab = getattr(head.config, "draft_vocab_size", head.config.vocab_size)  # Vd
        self._vocab_out = head.config.vocab_size  # V: the target's
        self._static: StaticTree | None = None
        if isinstance(tree, str):
            if tree != "dynamic":
                raise ValueError(f'tree must be "dynamic" or a list of rank paths, got {tree!r}')
            for name, value, low in (
                ("top_k", top_k, 1),
                ("depth", depth, 1),
                ("total_tokens", total_tokens, 2),
            ):
                if not isinstance(value, int) or value < low:
                    raise ValueError(f"{name} must be an int >= {low}, got {value!r}")
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
        # speculative slots one propose may write: depth-1 runs of top_k nodes, or the static inner nodes
        self._spec_slots = (
            (depth - 1) * top_k if self._static is None else int((self._static.depth > 0).sum())
        )
        self._compile: bool | str = False  # what `use_compile` was given
        self._graphs: GraphRows | None = None  # compiled: the kept fixed-shape rows (their graphs), once made
        # compiled drafting of B > 1 rows: None = on CUDA only (on a CPU the eager batch draft measured
        # faster: docs/PERFORMANCE.md, scripts/bench_batch_draft.py); True: wherever compiled; False: never.
        # (A compiled batch of one always drafts as a graph.)
        self.batch_graphs: bool | None = None
        self.topk_chunk: Chunk = "auto"  # each depth's top-k over chunks of this many ids (topk.py)
        self._d2t: Tensor | None = None  # [Vd] target id of every head-vocab id (one gather maps ids)
        # where the rows live (module doc): None = a batch of one here, eager; else EagleRows / GraphRows
        self._rows: EagleRows | None = None
        # a batch of one, eager: the head's cache, C, the last committed pair's output and its root
        self._cache: RowCache | None = None
        self._committed = 0  # C: committed cache entries
        self._feature: Tensor | None = None  # [1, H]: output of the last committed pair
        self._root: int | None = None  # the token x_C that pair was fed with
        self._outputs: StaticOutputs | None = None  # static tree: the kept buffers eager drafting fills
        self._masks = HeadMasks(GRAPH_COMMIT)  # eager masks from kept pieces (head_masks.py)
        self._positions = PositionIds()  # eager position ids [1, q]: views of one kept arange
        self._scores: Tensor | None = None  # [N] float64, see `last_scores`
        self._values: list[tuple[Tensor, Tensor]] | None = None  # eager static: per depth logits, ids
        self._parents: tuple[Tensor, Tensor] | None = None  # a static tree's parents [N] and kept [1, N]

    def check_target(self, hidden_size: int, vocab_size: int, num_layers: int) -> None:
        """Delegate to the head (HeadError, a ValueError, on a mismatch)."""
        self.head.check_target(hidden_size, vocab_size, num_layers)

    def with_tree(self, choices: list[list[int]]) -> EagleDrafter:
        """The same head with a static tree of these rank paths (see `tree_from_choices`)."""
        other = EagleDrafter(self.head, tree=choices, rule=self.rule)
        other.batch_graphs, other.topk_chunk = self.batch_graphs, self.topk_chunk
        return other

    def use_compile(self, compile: bool | str) -> None:
        """Draft and accept as fixed-shape graphs (`GraphRows`: every depth's head step, top-k and the
        final selection as ONE torch.compile graph; on CUDA one CUDA graph replay per propose, as SGLang
        captures EAGLE's draft): a batch of one always, B > 1 rows where `batch_graphs` says.
        compile: True (inductor; CUDA graphs on CUDA), "graphs" (no compiler: the eager draft captured as a
        CUDA graph on CUDA) or a torch.compile backend name; False: eager."""
        self._compile, self._graphs = compile, None  # (the graphs are made at the next start)

    def _shared_state(self) -> tuple:
        """What every graph of this drafter reads besides its arguments (CUDA graphs bake it in): the id
        map, the static plan, the tree's settings (top-k chunks, the fused step's attention) and that step's
        rotary table, remade larger when a longer cache asks."""
        table, attention = getattr(self.head_step, "table", None), getattr(self.head_step, "attention", None)
        angles = None if table is None else (table[0].data_ptr(), table[0].shape[0])
        settings = (self.top_k, self.depth, self.total_tokens, self.topk_chunk, attention)
        return id(self._d2t), id(self._plan), *settings, angles

    def _graphed(self, batch: int) -> bool:
        """Whether `batch` rows draft as graphs (compiled: a batch of one always, more where `batch_graphs`
        says: on CUDA by default)."""
        if not self._compile:
            return False
        wanted = self._weight.device.type == "cuda" if self.batch_graphs is None else self.batch_graphs
        return batch == 1 or wanted

    # ---- Drafter: read first ----------------------------------------------------------------

    @inference_mode
    def start(
        self, prompts: Sequence[Tensor], hidden: Sequence[dict[int, Tensor]], roots: Sequence[int]
    ) -> None:
        """New rows (whatever came before): commit each row's prompt pairs (f_t, x_{t+1}), x_T = root."""
        for prompt in prompts:
            if prompt.dim() != 1 or prompt.numel() == 0:
                raise ValueError(
                    f"a prompt must be a non-empty 1-D tensor [T], got shape {tuple(prompt.shape)}"
                )
        self._cache, self._scores, self._values = None, None, None
        if self._graphed(len(prompts)):
            if self._graphs is None:
                self._graphs = GraphRows(self, self._compile)
            self._rows = self._graphs
        elif len(prompts) > 1:
            self._rows = EagleRows(self)
        else:
            self._rows = None
            self._start_one(prompts[0], hidden[0], roots[0])
            return
        self._rows.start(prompts, hidden, roots)

    @inference_mode
    def propose(
        self,
        roots: Sequence[int],
        sampling: Sequence[SamplingParams],
        generators: Sequence[torch.Generator | None],
    ) -> BatchDraft:
        """Every row's tree of the head's top-k children (rule A; greedy), or for an eager batch of one of
        children drawn from it (`rule`)."""
        if self._rows is not None:
            return self._rows.propose(roots, sampling, generators)
        return self._propose_one(int(roots[0]), sampling[0], generators[0])

    @inference_mode
    def accept(
        self, tokens: Tensor, lengths: Sequence[int], hidden: dict[int, Tensor], next_roots: Sequence[int]
    ) -> None:
        """Commit row b's first lengths[b] pairs of tokens [B, K] (root + accepted drafts) with the target's
        states {layer: [B, K, H]}, one head step."""
        if self._rows is not None:
            return self._rows.accept(tokens, lengths, hidden, next_roots)
        if self._cache is None:
            raise RuntimeError("EagleDrafter.accept called before start")
        k = lengths[0]
        self._crop()
        features = self._features({layer: h[0, :k] for layer, h in hidden.items()}, k)[None]  # [1, K, H]
        self._commit(tokens[0, :k].tolist(), features, next_roots[0])

    @inference_mode
    def accept_paths(
        self,
        tokens: Sequence[list[int]],
        hidden: dict[int, Tensor],
        paths: Sequence[list[int]],
        next_roots: Sequence[int],
    ) -> None:
        """`accept` from the verified trees' states at every node {layer: [B, N, H]}. A batch of one fuses
        the input features over all N nodes first (EAGLE-3: one fc over N rows, no per-layer slices), then
        takes the path's K rows once (the same features as `accept`'s, up to the matmul's rounding)."""
        if self._rows is not None or type(self).accept is not EagleDrafter.accept:  # (a subclass's own
            return super().accept_paths(tokens, hidden, paths, next_roots)  # `accept` hears every path)
        if self._cache is None:
            raise RuntimeError("EagleDrafter.accept_paths called before start")
        nodes = next(iter(hidden.values())).shape[1]  # N (the head reads at least one layer)
        self._crop()
        features = self._features(hidden, nodes)  # [1, N, H]
        path = paths[0]
        self._commit(tokens[0], features[:, path_index(path, features.device)], next_roots[0])  # [1, K, H]

    @inference_mode
    def keep(self, rows: Sequence[int]) -> None:
        """Keep only these rows (in this order)."""
        if self._rows is not None:
            self._rows.keep(rows)
        elif list(rows) != [0]:
            raise ValueError(f"a batch of one keeps row 0, not {list(rows)}")

    # ---- Drafter: one draft ahead (engine/loop.py), the graphs' ---------------------------------

    def queues(self, batch: int) -> bool:
        """Whether `batch` rows accept and draft from device tensors: compiled as graphs, and the commit of
        a path fits one graph (P <= GRAPH_COMMIT); an EagleDrafter itself (a subclass may hear paths its own
        way, its `accept`: read first)."""
        return type(self) is EagleDrafter and self._graphed(batch) and self.commit_width <= GRAPH_COMMIT

    @property
    def commit_width(self) -> int:
        """P: pairs a queued accept commits per row (a power of two >= the longest path: depth + 1)."""
        depth = int(self._static.depth.max()) if self._static is not None else self.depth
        return 1 << depth.bit_length()

    def accept_queued(self, hidden, tokens, paths, ks, nexts) -> None:
        assert isinstance(self._rows, GraphRows)  # `queues` held: the graphs' rows
        self._rows.accept_queued(hidden, tokens, paths, ks, nexts)

    def propose_queued(self, nexts: Tensor) -> BatchDraft:
        assert isinstance(self._rows, GraphRows)  # `queues` held: the graphs' rows
        return self._rows.propose_queued(nexts)

    def settle(self, ks: Sequence[int], nexts: Sequence[int]) -> None:
        assert isinstance(self._rows, GraphRows)  # `queues` held: the graphs' rows
        self._rows.settle(ks, nexts)

    # ---- a batch of one, eager ----------------------------------------------------------------------

    def _start_one(self, prompt: Tensor, hidden: dict[int, Tensor], root: int) -> None:
        """Reset and commit the pairs (f_t, x_{t+1}) of the prompt [T], with x_T = root."""
        size = max(256, -(-(prompt.numel() + 128 + self._spec_slots) // 256) * 256)
        self._cache = RowCache(self.head.config.num_layers, 1, size)  # a cache layer per decoder layer
        self._committed, self._feature = 0, None
        self._commit(prompt.tolist(), self._features(hidden, prompt.numel())[None], root)  # [1, T, H]

    def _propose_one(
        self, root: int, sampling: SamplingParams, generator: torch.Generator | None
    ) -> BatchDraft:
        """A batch of one's tree [1, N] (its parents, a static tree's, ONE kept [1, N] view each pass: the
        target runner knows the very tensor again without reading it)."""
        if self._cache is None or self._feature is None:
            raise RuntimeError("EagleDrafter.propose called before start")
        if root != self._root:
            raise ValueError(f"propose got root {root} but start/accept announced {self._root}")
        self._ensure_room(self.max_nodes)
        self._map_ids(self._weight.device)
        self._values = None  # (set again by an eager static tree's growth)
        try:
            if self._static is not None:  # its scores are summed only when `last_scores` is read
                drawn = None  # a static tree's children drawn from the head (sampling, rule C)
                if self.rule != "deterministic" and not sampling.is_greedy:
                    drawn = SampledChildren(self.head_logits, sampling, generator, self._vocab_out)
                tokens, parents, scores = self._grow_static_eager(root, drawn)
            else:  # (torch.full costs less than torch.tensor on a CPU)
                root_t = torch.full((1, 1), root, device=self._weight.device)  # [1, 1] long
                tokens, parents, scores = self._grow_dynamic(self._feature, root_t)
                drawn = None
        finally:
            self._crop()  # drop every speculative entry: the cache holds the C committed ones only
        # The tree stays where it was drafted: on a GPU the target's verify is queued right behind the
        # draft, and the host reads the tree's tokens with the acceptance's one transfer (no wait here).
        self._scores = scores  # [N] on the head's device: `last_scores` brings it over when read
        if self._plan is None:  # (a dynamic tree is valid by construction: its nodes are kept in id order,
            # each after its parent; tests/inference/drafters/eagle/test_drafter.py validates them)
            return BatchDraft(tokens[None], parents[None], [tokens.shape[0]])
        plan = self._plan  # the plan's parents, validated once by tree_from_choices
        if self._parents is None or self._parents[0] is not plan.host_parents:
            self._parents = (plan.host_parents, plan.host_parents[None])
        if drawn is None:
            return BatchDraft(tokens[None], self._parents[1], [tokens.shape[0]])
        draft = drawn.draft(TokenTree.trusted(tokens, plan.host_parents), plan, self._d2t)
        assert draft.q is not None  # drawn children carry their distributions
        return BatchDraft(tokens[None], self._parents[1], [tokens.shape[0]], draft.rule, draft.q[None])

    # ---- a batch of one's committed cache -----------------------------------------------------------

    def _commit(self, tokens: list[int], features: Tensor, next_token: int) -> None:
        """Step the head on pairs (features [1, K, H] of tokens[i], tokens[i+1] or next_token) at
        positions C.. (causal); tokens [K] a host list."""
        device, k = self._weight.device, len(tokens)
        # the next tokens made from a host list at once (a slice and a concatenation are three ops)
        next_ids = host_ids([[*tokens[1:], int(next_token)]], device)  # [1, K] (no wait)
        self._ensure_room(k)
        c, cache = self._committed, self._cache
        assert cache is not None  # start made it
        if k <= GRAPH_COMMIT:  # an accept: few ops from cached pieces
            # [1, 1, K, C + K]; one pair sees every entry: the step's causal default, unmasked
            causal = self._masks.causal_block(k, self._weight) if k > 1 else None  # [k, k]
            mask = None if causal is None else self._masks.after_committed(causal, c, cache.max_length, key=k)
            positions = self._positions(c, k, device)  # [1, K]
        else:  # causal after the C committed entries (the prompt)
            mask, positions = causal_inputs_static(k, c, c + k, self._weight.dtype, device)
        out = self.head_step(features, next_ids, mask, positions, cache)  # [1, K, H]
        self._committed += k
        cache.crop_to(self._committed)  # (the cache's layer is there already: its write moved it)
        self._feature = out[:, -1]  # [1, H]
        self._root = int(next_token)

    def _ensure_room(self, extra: int) -> None:
        """Grow the preallocated head cache (doubling, rare) so C + extra + a full tree fit."""
        need, cache = self._committed + extra + self._spec_slots, self._cache
        assert cache is not None  # start made it
        if need > cache.max_length:
            cache.grow(max(need, 2 * cache.max_length))

    def _features(self, hidden: dict[int, Tensor], length: int | None = None) -> Tensor:
        """Target states {layer: [..., K, H]} -> the head's input features [..., K, H] (fused for EAGLE-3);
        length: K, checked when given."""
        missing = [layer for layer in self.hidden_layers if layer not in hidden]
        if missing:
            raise KeyError(f"hidden states of layers {missing} missing (drafter reads {self.hidden_layers})")
        weight, states = self._weight, []
        for layer in self.hidden_layers:
            state = hidden[layer]  # [..., K, H]
            if length is not None and state.shape[-2] != length:
                raise ValueError(f"hidden[{layer}] has {state.shape[-2]} positions, expected {length}")
            if state.dtype != weight.dtype or state.device != weight.device:  # (`to` costs even as a no-op)
                state = state.to(weight.device, weight.dtype)  # a bf16 target may feed an fp32 head
            states.append(state)
        # EAGLE-3: fused (over any leading dims: a caller's one unsqueeze after, not three)
        return self.head.features(states)  # [..., K, H]

    def _crop(self) -> None:
        if self._cache is not None:
            self._cache.crop_to(self._committed)

    @property
    def last_scores(self) -> Tensor | None:
        """Every node's cumulative draft log-prob [N] (float64, root 0) of the last eager batch-of-one
        `propose` (None for rows drafted otherwise)."""
        if self._scores is None and self._values is not None:  # eager static tree: summed on demand
            self._scores = kept_scores(self._static_plan(), self._values)
        if self._scores is not None and self._scores.device.type != "cpu":  # read: to the host, once
            self._scores = self._scores.cpu()
        return self._scores
