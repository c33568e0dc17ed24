"""EAGLE-1/2 and EAGLE-3 drafting: static (Medusa-style) or dynamic (EAGLE-2) trees from a feature head.

Cache convention (as in training, spechead.heads.unroll): the head's cache (a preallocated `RowCache` of one row,
grown by doubling when a sequence outgrows it) holds one COMMITTED entry per position t whose pair (target
feature f_t, token x_{t+1}) is known, at rotary position t; C = number of committed entries = the target's
cached length. The output of the last pair (position C - 1, token x_C = the root) predicts its children.

Drafting a tree rooted at x_C: a node at depth d >= 1 (token x_{C+d}) is run as TTT step d at position
C + d - 1: it reads its parent's output feature and its own token, and attends to the C committed entries,
the entries of its ancestors at depths 1..d-1 and itself (exactly `ttt_allowed`). Those speculative entries
are dropped (the length reset to C) after every `propose`. Growth runs on the head's device: one head call
per depth over the whole frontier, top-k and cumulative scores kept as tensors; the tree comes back to the
host once, at the end (the head steps and the growth: drafters/eagle_growth.py).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor

from spechead.heads.eagle import EagleHead
from spechead.heads.eagle3 import Eagle3Head
from spechead.heads.fused import fused_logits, fused_step
from spechead.heads.grad import inference_mode
from spechead.inference import compiling
from spechead.inference.devices import host_ids
from spechead.inference.drafters.base import BatchDrafter, Draft, Drafter, path_index
from spechead.inference.drafters.eagle_commit import GRAPH_COMMIT
from spechead.inference.drafters.eagle_growth import EagleGrowth
from spechead.inference.drafters.head_masks import HeadMasks
from spechead.inference.drafters.sampled_children import SampledChildren, check_rule
from spechead.inference.drafters.static_eager import StaticOutputs
from spechead.inference.drafters.static_plan import StaticPlan, kept_scores
from spechead.inference.drafters.topk import Chunk
from spechead.inference.positions import PositionIds
from spechead.inference.sampling import SamplingParams
from spechead.inference.target.cache import RowCache
from spechead.inference.tree import StaticTree, TokenTree, causal_inputs_static, tree_from_choices


class EagleDrafter(EagleGrowth, Drafter):
    """Drafts token trees with an EagleHead (EAGLE-1/2) or Eagle3Head; children are the head's top-k.

    tree: "dynamic" (EAGLE-2: per depth expand the `top_k` frontier nodes of highest cumulative
    log-prob, each with its `top_k` children, down to `depth`; keep the best `total_tokens - 1`
    nodes) or static paths of child ranks, e.g. [[0], [1], [0, 0]] (see `tree_from_choices`).
    rule: when sampling, children are the head's top-k ("deterministic", rule A) or, for a static tree
    drafted eagerly at batch 1, draws from the head ("without_replacement", rule C: sampled_children.py;
    more accepted at temperatures near 1, for more draft work a depth). Greedy takes the top-k.
    After each `propose`, `last_scores` [N] holds every node's cumulative draft log-prob (root 0).
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
        self._cache: RowCache | None = None  # the head's preallocated cache
        self._committed = 0  # C: committed cache entries
        self._plan: StaticPlan | None = None  # static tree: per-depth index tensors, built once
        self._outputs: StaticOutputs | None = None  # and the kept buffers eager drafting fills
        # speculative slots one propose may write: depth-1 runs of top_k nodes, or the static inner nodes
        self._spec_slots = (
            (depth - 1) * top_k if self._static is None else int((self._static.depth > 0).sum())
        )
        self._feature: Tensor | None = None  # [1, H]: output of the last committed pair
        # set by `use_compile`: the whole draft (`_grow_graph`) under torch.compile
        self._compiled: Callable[..., tuple[Tensor, Tensor, Tensor | None]] | None = None
        self._compiled_commit: Callable[..., Tensor] | None = None  # and the accept step (`_commit_graph`)
        self._compile: bool | str = False  # what `use_compile` was given (batched() compiles likewise)
        self._batch_graphs: BatchDrafter | None = None  # the kept compiled batch drafter, once made
        # compiled batch drafting (`batched`): None = on CUDA only (on a CPU the eager batch draft measured
        # faster: README, scripts/bench_batch_draft.py); True: wherever the drafter is compiled; False: never
        self.batch_graphs: bool | None = None
        self.topk_chunk: Chunk = "auto"  # each depth's top-k over chunks of this many ids (topk.py)
        self._root: int | None = None  # the token x_C that pair was fed with
        self._masks = HeadMasks(GRAPH_COMMIT)  # eager masks from kept pieces (drafters/head_masks.py)
        self._positions = PositionIds()  # eager position ids [1, q]: views of one kept arange
        self._d2t: Tensor | None = None  # [Vd] target id of every head-vocab id (one gather maps ids)
        self._scores: Tensor | None = None  # [N] float64, see `last_scores`
        self._values: list[tuple[Tensor, Tensor]] | None = None  # eager static: per depth logits, ids

    # ---- Drafter interface ---------------------------------------------------------------------

    def check_target(self, hidden_size: int, vocab_size: int, num_layers: int) -> None:
        """Delegate to the head (HeadError, a ValueError, on a mismatch)."""
        self.head.check_target(hidden_size, vocab_size, num_layers)

    @inference_mode
    def start(self, prompt: Tensor, hidden: dict[int, Tensor], root: int) -> None:
        """Reset and commit the pairs (f_t, x_{t+1}) of the prompt [T], with x_T = root."""
        if prompt.dim() != 1 or prompt.numel() == 0:
            raise ValueError(f"prompt must be a non-empty 1-D tensor [T], got shape {tuple(prompt.shape)}")
        size = max(256, -(-(prompt.numel() + 128 + self._spec_slots) // 256) * 256)
        if self._compiled is None:
            self._cache = RowCache(1, 1, size)
        elif self._cache is None or self._cache.max_length < size:  # fixed shapes: kept across sequences
            self._cache = RowCache(1, 1, -(-size // 1024) * 1024, static_shapes=True)
        self._cache.set_length(0)
        self._committed, self._feature = 0, None
        self._commit(prompt.tolist(), self._features(hidden, prompt.numel())[None], root)  # [1, T, H]

    def use_compile(self, compile: bool | str) -> None:
        """Capture the WHOLE draft (every depth's head step, top-k and the final selection) as one
        torch.compile graph with fixed shapes: the head cache is written at a device-side length and
        read whole behind the mask, the committed length is a device tensor, so one graph serves every
        sequence position (on CUDA one CUDA graph replay per propose, as SGLang captures EAGLE's draft).
        compile: True (inductor; CUDA graphs on CUDA), "graphs" (no compiler: the eager draft captured as a
        CUDA graph on CUDA) or a torch.compile backend name; False: eager."""
        self._compile, self._batch_graphs = compile, None  # (batched() makes its graphs when asked)
        if not compile:
            self._compiled, self._compiled_commit, self._cache = None, None, None
            return
        cuda = self._weight.device.type == "cuda"
        state = self._graph_state
        self._compiled = compiling.compile_function(
            self._grow_graph, compile, cuda, fullgraph=True, state=state
        )
        self._compiled_commit = compiling.compile_function(
            self._commit_graph, compile, cuda, fullgraph=True, state=state
        )
        self._cache = None  # the next `start` allocates the fixed-shape cache

    def _graph_state(self) -> tuple:
        """What the draft graphs read besides their arguments (CUDA graphs bake it in): the head cache's
        allocation, the id map, the static plan, the tree's settings and the step's rotary table."""
        generation = None if self._cache is None else self._cache.generation
        return generation, *self._shared_state()

    def _shared_state(self) -> tuple:
        """What every graph of this drafter reads, the batch drafter's too (eagle_batch_graphs.py): the id
        map, the static plan, the tree's settings (top-k chunks, the fused step's attention) and that step's
        rotary table, remade larger when a longer cache asks (a batch's head cache may be longer)."""
        table, attention = getattr(self.head_step, "table", None), getattr(self.head_step, "attention", None)
        angles = None if table is None else (table[0].data_ptr(), table[0].shape[0])
        settings = (self.top_k, self.depth, self.total_tokens, self.topk_chunk, attention)
        return id(self._d2t), id(self._plan), *settings, angles

    @inference_mode
    def accept(self, tokens: Tensor, hidden: dict[int, Tensor], next_root: int) -> None:
        """Commit the pairs of tokens [K] (root + accepted drafts) in one head step."""
        if self._cache is None:
            raise RuntimeError("EagleDrafter.accept called before start")
        if tokens.dim() != 1 or tokens.numel() == 0:
            raise ValueError(f"tokens must be a non-empty 1-D tensor [K], got shape {tuple(tokens.shape)}")
        self._crop()
        self._commit(tokens.tolist(), self._features(hidden, tokens.numel())[None], next_root)  # [1, K, H]

    @inference_mode
    def accept_path(
        self, tokens: list[int], hidden: dict[int, Tensor], path: list[int], next_root: int
    ) -> None:
        """`accept` from the verified tree's states at every node {layer: [1, N, H]}: the input features
        fused over all N nodes first (EAGLE-3: one fc over N rows, no per-layer slices), then the path's
        K rows taken once (the same features as `accept`'s, up to the matmul's rounding by row count)."""
        if type(self).accept is not EagleDrafter.accept:  # a subclass's own `accept` hears every path
            return super().accept_path(tokens, hidden, path, next_root)
        if self._cache is None:
            raise RuntimeError("EagleDrafter.accept_path called before start")
        nodes = next(iter(hidden.values())).shape[1]  # N (the head reads at least one layer)
        self._crop()
        features = self._features(hidden, nodes)  # [1, N, H]
        self._commit(tokens, features[:, path_index(path, features.device)], next_root)  # [1, K, H]

    @inference_mode
    def propose(self, root: int, sampling: SamplingParams, generator: torch.Generator | None) -> Draft:
        """A tree of the head's top-k children (rule A; greedy), or of children drawn from it (`rule`)."""
        if self._cache is None or self._feature is None:
            raise RuntimeError("EagleDrafter.propose called before start")
        if int(root) != self._root:
            raise ValueError(f"propose got root {int(root)} but start/accept announced {self._root}")
        self._ensure_room(self.max_nodes)
        self._map_ids(self._weight.device)
        self._values = None  # (set again by an eager static tree's growth)
        drawn: SampledChildren | None = None  # a static tree's children drawn from the head (sampling)
        try:
            if self._compiled is not None:
                if self._static is not None:
                    self._static_plan()  # built eagerly (host loops), read by the graph
                root_t = torch.full((1, 1), int(root), device=self._weight.device)  # [1, 1] long
                length = self._cache.device_length()
                tokens, parents, scores = self._compiled(self._feature, root_t, length)
            elif self._static is not None:  # its scores are summed only when `last_scores` is read
                if self.rule != "deterministic" and not sampling.is_greedy:  # drawn children (rule C)
                    drawn = SampledChildren(self.head_logits, sampling, generator, self._vocab_out)
                tokens, parents, scores = self._grow_static_eager(int(root), drawn)
            else:  # (torch.full costs less than torch.tensor on a CPU)
                root_t = torch.full((1, 1), int(root), device=self._weight.device)  # [1, 1] long
                tokens, parents, scores = self._grow_dynamic(self._feature, root_t, None)
        finally:
            self._crop()  # drop every speculative entry: the cache holds the C committed ones only
        # The tree stays where it was drafted: on a GPU the target's verify is queued right behind the
        # draft, and the host reads the tree's tokens with the acceptance's one transfer (no wait here).
        self._scores = scores  # [N] on the head's device: `last_scores` brings it over when read
        if self._plan is not None:  # the plan's parents, validated once by tree_from_choices
            tree = TokenTree.trusted(tokens, self._plan.host_parents)
            return Draft(tree=tree) if drawn is None else drawn.draft(tree, self._plan, self._d2t)
        # (a dynamic tree is valid by construction: its nodes are kept in id order, each after its
        # parent, which the selection keeps; tests/inference/drafters/test_eagle_drafter.py validates them)
        return Draft(tree=TokenTree.trusted(tokens, parents), rule="deterministic")

    def with_tree(self, choices: list[list[int]]) -> EagleDrafter:
        """The same head with a static tree of these rank paths (see `tree_from_choices`)."""
        other = EagleDrafter(self.head, tree=choices, rule=self.rule)
        other.batch_graphs, other.topk_chunk = self.batch_graphs, self.topk_chunk
        return other

    def batched(self) -> BatchDrafter:
        """B rows drafting in one head call per depth (drafters/eagle_batch.py); compiled (`use_compile`)
        on CUDA (see `batch_graphs`): every row's draft and accept as fixed-shape graphs, one drafter
        kept with its graphs (drafters/eagle_batch_graphs.py)."""
        wanted = self._weight.device.type == "cuda" if self.batch_graphs is None else self.batch_graphs
        if self._compile and wanted:
            from spechead.inference.drafters.eagle_batch_graphs import CompiledEagleBatchDrafter

            if self._batch_graphs is None:
                self._batch_graphs = CompiledEagleBatchDrafter(self, self._compile)
            return self._batch_graphs
        from spechead.inference.drafters.eagle_batch import EagleBatchDrafter

        return EagleBatchDrafter(self)

    # ---- committed cache ---------------------------------------------------------------------

    def _commit(self, tokens: list[int], features: Tensor, next_token: int) -> None:
        """Step the head on pairs (features [1, K, H] of tokens[i], tokens[i+1] or next_token) at
        positions C.. (causal); tokens [K] a host list."""
        device, k = self._weight.device, len(tokens)
        # the next tokens made from a host list at once (a slice and a concatenation are three ops)
        next_ids = host_ids([[*tokens[1:], int(next_token)]], device)  # [1, K] (no wait)
        self._ensure_room(k)
        c, cache = self._committed, self._cache
        assert cache is not None  # start made it
        if self._compiled_commit is not None and c > 0 and k <= GRAPH_COMMIT:  # c = 0: start, eager
            padded = 1 << (k - 1).bit_length()  # P >= K: a few graph shapes; the pairs past K land in
            # scratch slots (the committed length moves by K) and no earlier pair sees them (causal)
            out = self._compiled_commit(F.pad(features[0], (0, 0, 0, padded - k)),
                                        F.pad(next_ids, (0, padded - k)), cache.device_length())  # fmt: skip
            self._committed += k
            cache.set_length(self._committed)
            self._feature = out[k - 1 : k]  # [1, H]: the last real pair's output
            self._root = int(next_token)
            return
        # causal after the C committed entries; with fixed shapes (compiled drafting: the prompt, or
        # more than GRAPH_COMMIT tokens) over the whole buffer
        if not cache.static_shapes and k <= GRAPH_COMMIT:  # an accept: few ops from cached pieces
            # [1, 1, K, C + K]; one pair sees every entry: the step's causal default, unmasked
            causal = self._masks.causal_block(k, self._weight) if k > 1 else None  # [k, k]
            mask = None if causal is None else self._masks.after_committed(causal, c, cache.max_length, key=k)
            positions = self._positions(c, k, device)  # [1, K]
        else:
            columns = cache.max_length if cache.static_shapes else c + k
            mask, positions = causal_inputs_static(k, c, columns, self._weight.dtype, device)
        out = self.head_step(features, next_ids, mask, positions, cache)  # [1, K, H]
        self._committed += k
        cache.crop_to(self._committed)  # (an eager cache's layer is there already: its write moved it)
        # [1, H]; for a compiled draft with strides (H, 1) whatever K, so its guards hold (two views)
        self._feature = out[:, -1] if self._compiled is None else out[0, -1:]
        self._root = int(next_token)

    def _commit_graph(self, features: Tensor, next_ids: Tensor, length: Tensor) -> Tensor:
        """The head on P pairs, features [P, H] and next tokens [1, P], causal after the device length C
        [0-d] over the whole fixed-size cache -> output features [P, H] (one graph for every C)."""
        cache = self._cache
        assert cache is not None  # start made it
        p, dtype = next_ids.shape[1], self._weight.dtype
        rows = length + torch.arange(p, device=length.device)  # [P] each pair's slot and position
        cols = torch.arange(cache.max_length, device=length.device)  # [S_max]
        mask = torch.zeros(p, cache.max_length, dtype=dtype, device=length.device)
        mask = mask.masked_fill(cols[None, :] > rows[:, None], torch.finfo(dtype).min)  # [P, S_max]
        return self.head_step(features[None], next_ids, mask[None, None], rows[None], cache)[0]

    def _ensure_room(self, extra: int) -> None:
        """Grow the preallocated head cache (doubling, rare) so C + extra + a full tree fit."""
        need, cache = self._committed + extra + self._spec_slots, self._cache
        assert cache is not None  # start made it
        if need > cache.max_length:
            step = 1024 if cache.static_shapes else 1  # fixed shapes: few sizes, few recompiles
            cache.grow(-(-max(need, 2 * cache.max_length) // step) * step)

    def _features(self, hidden: dict[int, Tensor], length: int) -> Tensor:
        """Target states {layer: [..., K, H]} -> the head's input features [..., K, H] (fused for EAGLE-3)."""
        missing = [layer for layer in self.hidden_layers if layer not in hidden]
        if missing:
            raise KeyError(f"hidden states of layers {missing} missing (drafter reads {self.hidden_layers})")
        weight, states = self._weight, []
        for layer in self.hidden_layers:
            state = hidden[layer]  # [K, H]
            if state.shape[-2] != length:
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
        """Every node's cumulative draft log-prob [N] (float64, root 0) of the last `propose`."""
        if self._scores is None and self._values is not None:  # eager static tree: summed on demand
            self._scores = kept_scores(self._static_plan(), self._values)
        if self._scores is not None and self._scores.device.type != "cpu":  # read: to the host, once
            self._scores = self._scores.cpu()
        return self._scores
