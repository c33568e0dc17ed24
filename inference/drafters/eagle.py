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
host once, at the end.
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
from spechead.inference.drafters.dynamic_tree import grow_dynamic
from spechead.inference.drafters.eagle_commit import GRAPH_COMMIT
from spechead.inference.drafters.head_masks import HeadMasks
from spechead.inference.drafters.sampled_children import SampledChildren, check_rule
from spechead.inference.drafters.static_eager import StaticOutputs, build_static_outputs, grow_static_eager
from spechead.inference.drafters.static_plan import StaticPlan, build_static_plan, kept_scores, static_scores
from spechead.inference.drafters.topk import Chunk, resolve_chunk, topk_rows
from spechead.inference.positions import PositionIds
from spechead.inference.sampling import SamplingParams
from spechead.inference.target.cache import RowCache
from spechead.inference.tree import StaticTree, TokenTree, causal_inputs_static, tree_from_choices


class EagleDrafter(Drafter):
    """Drafts token trees with an EagleHead (EAGLE-1/2) or Eagle3Head; children are the head's top-k.

    tree: "dynamic" (EAGLE-2: per depth expand the `top_k` frontier nodes of highest cumulative
    log-prob, each with its `top_k` children, down to `depth`; keep the best `total_tokens - 1`
    nodes) or static paths of child ranks, e.g. [[0], [1], [0, 0]] (see `tree_from_choices`).
    rule: when sampling, children are the head's top-k ("deterministic", rule A) or, for a static tree
    drafted eagerly at batch 1, draws from the head ("without_replacement", rule C: sampled_children.py;
    more accepted at temperatures near 1, for more draft work a depth). Greedy takes the top-k.
    After each `propose`, `last_scores` [N] holds every node's cumulative draft log-prob (root 0).
    """

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
        # parent, which the selection keeps; tests/inference/test_eagle_drafter.py validates them)
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

    # ---- tree growth (tensors on the head's device; no host round trip inside the depth loop) -----

    def _to_target(self, ids: Tensor) -> Tensor:
        """Head-vocab ids (any shape) -> target ids (EAGLE-3 maps its draft vocab with d2t)."""
        # the whole map, made by `propose` before drafting (eager: a compiled draft reads it): one gather
        return self.head.draft_to_target(ids) if self._d2t is None else self._d2t[ids]

    def _map_ids(self, device: torch.device) -> None:
        """Make `_d2t` (EAGLE-3 with a reduced draft vocab; EAGLE-1/2 ids are the target's already)."""
        if self._vocab != self.head.config.vocab_size and (self._d2t is None or self._d2t.device != device):
            self._d2t = self.head.draft_to_target(torch.arange(self._vocab, device=device))  # [Vd]

    def _top(self, features: Tensor, k: int) -> tuple[Tensor, Tensor]:
        """Output features [1, q, H] -> the k best children: log-probs [q, k] and head-vocab ids [q, k].

        top-k of the raw logits minus their logsumexp (= top-k of log_softmax, without writing it)."""
        logits = self.head_logits(features)[0].float()  # [q, Vd]
        values, ids = topk_rows(logits, k, self.topk_chunk)
        return values - torch.logsumexp(logits, dim=-1, keepdim=True), ids

    def _top_ids(
        self, features: Tensor, k: int, out: tuple[Tensor, Tensor] | None = None
    ) -> tuple[Tensor, Tensor]:
        """`_top` without the log-probs (a static tree only needs the ranks), features [1, q, H]: the logits
        [1, q, Vd] (kept for `last_scores`) and the k best head-vocab ids [1, q, k], written into out =
        (values, ids) [1, q, k] when given (kept buffers: no new tensors)."""
        logits = self.head_logits(features)  # [1, q, Vd]
        chunk = resolve_chunk(self.topk_chunk, logits.device.type, logits.shape[-1])
        if out is None:
            return logits, topk_rows(logits, k, chunk)[1]
        if chunk is None and out[0].dtype == logits.dtype:
            torch.topk(logits, k, dim=-1, out=out)
        else:  # long rows (chunked), or logits in another dtype than the buffer's (an autocast head)
            out[1].copy_(topk_rows(logits, k, chunk)[1])
        return logits, out[1]

    def _step(
        self, features: Tensor, ids: Tensor, allowed_spec: Tensor | None, depth: int, committed: Tensor | None
    ) -> Tensor:
        """One head call on q nodes at `depth` >= 1: parent features [1, q, H], tokens [1, q], allowed_spec
        [q, S + q] (their ancestors' speculative slots and themselves: bool, or in eager drafting already the
        additive block, 0 = attend; or None in eager drafting when ONE node sees every slot so far: no mask)
        -> output features [1, q, H]. committed: None (eager: `self._committed` entries) or, inside the draft
        graph, C as a 0-d device tensor: then the mask spans the whole fixed-size cache and the write slot
        is set on the device, so the graph does not depend on C."""
        cache, dtype, q = self._cache, self._weight.dtype, ids.shape[1]
        assert cache is not None  # start made it
        if committed is None:
            c = self._committed
            positions = self._positions(c + depth - 1, 1, ids.device)  # [1, 1]: a depth's nodes sit there
            if allowed_spec is None:  # one node seeing all C + S + 1 entries: the step's causal default,
                # which a single query over an eager cache (its view ends at the write) runs unmasked
                return self.head_step(features, ids, None, positions, cache)  # [1, 1, H]
            key = None if allowed_spec.dtype == torch.bool else ("depth", depth)  # a static plan's block
            width = allowed_spec.shape[1]  # S + q: speculative slots so far + these q
            if allowed_spec.dtype == torch.bool:  # [q, S + q] -> additive
                allowed_spec = torch.zeros(q, width, dtype=dtype, device=ids.device).masked_fill_(
                    ~allowed_spec, torch.finfo(dtype).min
                )
            mask = self._masks.after_committed(allowed_spec, c, cache.max_length, key)  # [1, 1, q, C + S + q]
            positions = positions.expand(1, q) if q > 1 else positions  # [1, q]
            return self.head_step(features, ids, mask, positions, cache)  # [1, q, H]
        assert allowed_spec is not None  # (the graph always masks: its cache view is the whole buffer)
        width = allowed_spec.shape[1]  # S + q: speculative slots so far + these q
        rel = torch.arange(cache.max_length, device=ids.device) - committed  # [S_max] slot - C
        spec = allowed_spec[:, rel.clamp(0, width - 1)] & (rel >= 0) & (rel < width)  # [q, S_max]
        visible = spec | (rel < 0)  # the committed slots: every node sees them
        mask = torch.zeros(q, cache.max_length, dtype=dtype, device=ids.device)
        mask = mask.masked_fill(~visible, torch.finfo(dtype).min)[None, None]  # [1, 1, q, S_max]
        positions = (committed + (depth - 1)).view(1, 1).expand(1, q)  # [1, q]
        cache.write_at(committed + (width - q))  # these q nodes' slots: C + S ..
        return self.head_step(features, ids, mask, positions, cache)  # [1, q, H]

    @property
    def last_scores(self) -> Tensor | None:
        """Every node's cumulative draft log-prob [N] (float64, root 0) of the last `propose`."""
        if self._scores is None and self._values is not None:  # eager static tree: summed on demand
            self._scores = kept_scores(self._static_plan(), self._values)
        if self._scores is not None and self._scores.device.type != "cpu":  # read: to the host, once
            self._scores = self._scores.cpu()
        return self._scores

    def _grow_graph(
        self, feature: Tensor, root: Tensor, length: Tensor
    ) -> tuple[Tensor, Tensor, Tensor | None]:
        """The tree as one fixed-shape graph: tokens, parents, scores [N] from the root's feature [1, H]
        and token [1, 1]; C is the cache's device length [0-d] (propose's `_crop` sets it back after the
        speculative writes have moved it)."""
        if self._static is not None:
            return self._grow_static(feature, root, length.clone())
        return self._grow_dynamic(feature, root, length.clone())

    def _grow_dynamic(
        self, feature: Tensor, root: Tensor, committed: Tensor | None
    ) -> tuple[Tensor, Tensor, Tensor]:
        """EAGLE-2 from the root's feature [1, H] and token [1, 1] (drafters/dynamic_tree.py): tokens,
        parents, scores [N] (float64)."""
        return grow_dynamic(
            feature,
            root,
            committed,
            (self.top_k, self.depth, self.total_tokens),
            self._step,
            self._top,
            self._to_target,
        )

    def _grow_static(self, feature: Tensor, root: Tensor, committed: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """The static tree inside the draft graph (node i = the rank[i]-th child of its parent), one head
        call per depth over the nodes that have children. Returns tokens, parents, scores [N] (float64).
        (Eager drafting fills kept buffers instead: drafters/static_eager.py.)

        Inside the depth loop only what the next depth needs is gathered (the target ids of the nodes
        it expands); every node's token and score comes at the end from the candidates of all depths at
        once (indices precomputed in the plan)."""
        plan = self._static_plan()
        feats, run = feature[None], root  # [1, E, H] outputs of the nodes expanded at a depth, [1, E] ids
        ids_by_depth, values_by_depth = [], []  # per depth: [1, E * need] head ids; log-probs [E, need]
        for step in plan.steps:
            if step["run"] is not None:  # the nodes to expand (depth d - 1 >= 1) run on the head
                parent_feats = feats[:, step["parent_rows"]]  # bool blocks, always gathered (fused ops)
                feats = self._step(
                    parent_feats, run, step["allowed"], step["depth"] - 1, committed
                )  # [1, E, H]
            values, ids = self._top(feats, step["need"])  # [E, need] each
            values_by_depth.append(values)
            ids_by_depth.append(ids.reshape(1, -1))  # [1, E * need]
            if step["next_run"] is not None:  # target ids of this depth's nodes the next depth expands
                run = self._to_target(ids_by_depth[-1][:, step["next_run"]])  # [1, E']
        candidates = torch.cat(ids_by_depth, dim=1)  # [1, M]: every depth's, in order
        tokens = torch.cat([root, self._to_target(candidates[:, plan.pick])], dim=1)[0]  # [N]
        return tokens, plan.parents, static_scores(plan, values_by_depth)

    def _grow_static_eager(self, root: int, drawn: SampledChildren | None) -> tuple[Tensor, Tensor, None]:
        """The static tree drafted eagerly into kept buffers (drafters/static_eager.py): its tokens [N],
        the plan's parents [N] and no scores (each depth's logits and ids stay for `last_scores`).
        Children are the head's top-k, or drawn by `drawn` (which keeps their distributions)."""
        plan, outs = self._static_plan(), self._outputs
        if outs is None:
            mapped = self._vocab != self.head.config.vocab_size  # EAGLE-3's reduced vocab: ids to map
            outs = self._outputs = build_static_outputs(plan, self._weight.dtype, mapped)
        assert self._feature is not None  # propose checked it
        tokens, logits = grow_static_eager(
            plan,
            outs,
            self._feature,
            root,
            self._d2t,
            self._step,
            self._top_ids if drawn is None else drawn.top,
        )
        self._values = [(x, out.ids) for x, out in zip(logits, outs.depths)]
        return tokens, plan.parents, None

    def _static_plan(self) -> StaticPlan:
        """The static tree's per-depth plan (built once, on the head's device; see static_plan.py)."""
        if self._plan is None:
            assert self._static is not None  # only a static tree has a plan
            weight = self._weight
            self._plan = build_static_plan(self._static, weight.device, weight.dtype)
        return self._plan
