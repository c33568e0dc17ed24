"""An independent small draft model (any HF causal LM sharing the target's tokenizer) drafting chains or
token trees (SpecInfer), one draft forward per depth over the whole frontier (never one per node).

Shapes: a chain of `num_draft` (or `depth`) tokens (default); static, `width` children per node at every
depth (`parse_width`) or `tree` rank paths (`tree_from_choices`); or `tree="dynamic"` (EAGLE-2 style: per
depth the `top_k` frontier nodes of highest cumulative log-prob expand `top_k` children, down to `depth`;
the best `total_tokens - 1` nodes stay).

Children and their lossless rule (`acceptance.sample_accept`): greedy decoding and rule "deterministic"
(A) take the draft's top-k; under sampling "iid" (B, the chain default) draws a node's c children i.i.d.
from its draft distribution q, "without_replacement" (C, the tree default) without replacement (fewer
when q has fewer than c tokens). Dynamic trees take rule A only: keeping the best-scored sampled nodes
would bias the draws.

Draft cache: the committed tokens (the root last, at position C - 1); a `propose` appends its nodes depth
by depth under a tree mask with positions C - 1 + depth, then crops them away.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from itertools import product
from typing import cast

import torch
from transformers import DynamicCache, PreTrainedModel

from spechead.heads.hybrid import check_attention_only, refuse_flash
from spechead.inference.acceptance import RULES
from spechead.inference.drafters.base import Draft, at_least
from spechead.inference.drafters.per_row import RowDrafter
from spechead.inference.kv_cache import crop, croppable_cache
from spechead.inference.sampling import SamplingParams, sample, target_probs
from spechead.inference.sliding import layer_masks, sliding_layout
from spechead.inference.tree import (
    StaticTree,
    TokenTree,
    select_best,
    tree_from_choices,
    tree_inputs_on_device,
)

# DraftModelDrafter's (and so LayerSkipDrafter's) options
DRAFT_MODEL_OPTIONS = ("num_draft", "width", "depth", "tree", "rule", "top_k", "total_tokens")
MAX_NODES = 1024  # drafted nodes of a static shape (a width per depth multiplies quickly)


def check_vocab(
    model: PreTrainedModel, vocab_size: int, what: str, fix: str, other: str = "the target"
) -> None:
    """ValueError (one line) when `model`'s output vocabulary is not `other`'s `vocab_size`."""
    mine = model.get_output_embeddings().weight.shape[0]
    if mine != vocab_size:
        raise ValueError(f"{what} has a vocabulary of {mine} tokens, {other} {vocab_size}: {fix}")


def run_model(
    model: PreTrainedModel, cache: DynamicCache | None, tokens: list[int], **kwargs
) -> torch.Tensor:
    """`model`'s float logits [n, V] over `tokens` appended to `cache` (n: logits_to_keep, else all)."""
    ids = torch.tensor([tokens], device=model.device)
    return model(input_ids=ids, cache=cache, use_cache=True, **kwargs).logits[0].float()


def parse_width(width: int | str | Sequence[int]) -> list[int]:
    """Children per node at each depth: 4 -> [4], "4x2x2x1" -> [4, 2, 2, 1], [4, 2] -> [4, 2]."""
    if isinstance(width, str):
        values: list[object] = [int(p) if p.strip().isdigit() else p for p in width.lower().split("x")]
    else:  # a bool, a float, None: the one error below, never a TypeError from list()
        values = list(width) if isinstance(width, Sequence) else [width]
    if not values or not all(isinstance(v, int) and not isinstance(v, bool) and v >= 1 for v in values):
        raise ValueError(f"width must be ints >= 1, one per depth (4, [4, 2] or 4x2x2x1), got {width!r}")
    return cast(list[int], values)


def width_tree(widths: list[int]) -> StaticTree:
    """The full static tree with widths[d] children under every node of depth d ([N] nodes)."""
    if sum(math.prod(widths[: d + 1]) for d in range(len(widths))) > MAX_NODES:
        raise ValueError(
            f"width {widths} makes more than {MAX_NODES} draft nodes: use smaller widths deeper down, "
            "e.g. 4x2x2x1"
        )
    levels = [product(*map(range, widths[: d + 1])) for d in range(len(widths))]  # rank paths, in order
    return tree_from_choices([list(path) for level in levels for path in level])


class DraftModelDrafter(RowDrafter):
    """Chains or token trees from a small causal LM with its own KV cache (kept to committed tokens)."""

    cache: DynamicCache  # made by start

    def __init__(
        self,
        model: PreTrainedModel,
        num_draft: int = 5,
        *,
        width: int | str | Sequence[int] = 1,
        depth: int | None = None,
        tree: str | list[list[int]] | None = None,
        rule: str | None = None,
        top_k: int = 10,
        total_tokens: int = 60,
    ):
        at_least("num_draft", num_draft)
        if depth is not None:
            at_least("depth", depth)
        if rule is not None and rule not in RULES:
            raise ValueError(f"rule must be one of {RULES}, got {rule!r}")
        check_attention_only(model.config, "drafting with it", "use an attention-only draft model")
        self.model = model.eval()
        self.sliding = sliding_layout(model)  # its sliding layers' tree masks are windowed (sliding.py)
        self.shape: StaticTree | None = None  # None: dynamic trees
        if tree == "dynamic":
            at_least("top_k", top_k)
            at_least("total_tokens", total_tokens, 2)
            if rule not in (None, "deterministic"):
                raise ValueError(
                    f'tree="dynamic" keeps the best-scored nodes, which biases sampled children: '
                    f"use rule=deterministic (top-k children, lossless rule A), not {rule!r}"
                )
            self.rule, self.depth, self.max_nodes = "deterministic", depth or num_draft, total_tokens
        else:
            if isinstance(tree, str):
                raise ValueError(f'tree must be "dynamic" or a list of rank paths, got {tree!r}')
            if tree is not None:
                self.shape = tree_from_choices(tree)
            else:
                widths = parse_width(width)
                if len(widths) == 1:
                    widths = widths * (depth or num_draft)
                elif depth is not None and depth != len(widths):
                    raise ValueError(f"width {widths} has {len(widths)} depths but depth={depth}")
                self.shape = width_tree(widths)
            self.depth, self.max_nodes = int(self.shape.depth.max()), self.shape.size
            self.rule = rule or ("iid" if self.max_nodes == self.depth + 1 else "without_replacement")
        if self.shape is None or self.max_nodes > self.depth + 1:  # not a chain: siblings share a pass
            fix = "load the draft model with sdpa or eager, or draft a chain: width=1"
            refuse_flash(model.config, "a draft-model tree", fix)
        self.top_k, self.total_tokens = top_k, total_tokens
        self.pending: list[int] = []  # committed tokens not yet in the draft cache

    def check_target(self, hidden_size: int, vocab_size: int, num_layers: int) -> None:
        check_vocab(self.model, vocab_size, "draft model", "use a draft model with the target's tokenizer")

    def start(self, prompt: torch.Tensor, hidden: dict[int, torch.Tensor], root: int) -> None:
        self.cache = croppable_cache(self.model)
        self.pending = [*prompt.tolist(), root]

    def accept(self, tokens: torch.Tensor, hidden: dict[int, torch.Tensor], next_root: int) -> None:
        self.pending = [*tokens[1:].tolist(), next_root]  # the root itself was fed in propose

    @torch.inference_mode()
    def propose(self, root: int, sampling: SamplingParams, generator: torch.Generator | None) -> Draft:
        # (logits_to_keep=1: the prompt's [T, V] logits would be wasted, and large)
        logits = run_model(self.model, self.cache, self.pending, logits_to_keep=1)
        self.pending = []
        grower = _Grower(self, int(root), logits[-1])
        rule = "deterministic" if sampling.is_greedy else self.rule
        try:
            if self.shape is None:
                keep = self._grow_dynamic(grower)
            else:
                self._grow_static(grower, rule, sampling, generator)
                keep = list(range(len(grower.tok)))
        finally:
            # Drop the speculative entries: only committed tokens stay in the draft cache.
            crop(self.cache, grower.committed)
        index = {node: i for i, node in enumerate(keep)}  # keep is ascending, so topological
        tree = TokenTree(
            tokens=torch.tensor([grower.tok[n] for n in keep], dtype=torch.long),
            parents=torch.tensor([index.get(grower.par[n], -1) for n in keep], dtype=torch.long),
        )
        if rule == "deterministic":
            return Draft(tree)
        # [N, V]: row i = the distribution node i's children were drawn from (a leaf: its parent's row)
        q = torch.stack([grower.q(n if n in grower.logits else grower.par[n], sampling) for n in keep])
        return Draft(tree, rule=rule, q=q)

    # ---- tree growth ---------------------------------------------------------------------------

    def _grow_static(self, grower: _Grower, rule: str, sampling: SamplingParams, generator) -> None:
        """Fill the static shape depth by depth; node i of the shape becomes grower node made[i]."""
        shape = cast(StaticTree, self.shape)  # static trees only
        parents, depth, rank = shape.parents.tolist(), shape.depth.tolist(), shape.rank.tolist()  # [N]
        has_kids = set(parents[1:])
        made = {0: 0}  # shape node -> grower node (nodes whose parent got too few children are dropped)
        for d in range(1, self.depth + 1):
            nodes = [i for i in range(shape.size) if depth[i] == d and parents[i] in made]
            new = []
            for parent in sorted({parents[i] for i in nodes}):
                kids = [i for i in nodes if parents[i] == parent]  # ascending rank
                g = made[parent]
                if rule == "deterministic":
                    ranked = grower.logits[g].topk(min(max(rank[i] for i in kids) + 1, grower.vocab)).indices
                    picks = [int(ranked[rank[i]]) if rank[i] < len(ranked) else None for i in kids]
                else:  # the j-th child is the j-th draw (B: i.i.d., C: without replacement)
                    picks = grower.draw(g, len(kids), rule, sampling, generator)
                for i, token in zip(kids, picks):
                    if token is not None:
                        made[i] = grower.add(token, g)
                        new.append(i)
            grower.run([made[i] for i in new if i in has_kids])  # one forward for this depth

    def _grow_dynamic(self, grower: _Grower) -> list[int]:
        """EAGLE-2: a beam of `top_k` nodes per depth by cumulative log-prob; returns kept node ids."""
        frontier = [0]
        k = min(self.top_k, grower.vocab)
        for d in range(1, self.depth + 1):
            new = []
            for node in frontier:
                values, ids = torch.log_softmax(grower.logits[node], -1).topk(k)
                new += [grower.add(int(t), node, float(v)) for t, v in zip(ids, values)]
            if d < self.depth:
                frontier = sorted(sorted(new, key=lambda n: (-grower.score[n], n))[: self.top_k])
                grower.run(frontier)
        return select_best(grower.par, grower.score, self.total_tokens - 1)


class _Grower:
    """A growing draft tree: tok / par / score [n] (node 0 the root, in the cache at C - 1);
    logits[node] [V] the draft logits of a run node's children; fed the nodes in the cache from C - 1."""

    def __init__(self, drafter: DraftModelDrafter, root: int, root_logits: torch.Tensor):
        self.model, self.cache, self.sliding = drafter.model, drafter.cache, drafter.sliding
        self.committed = int(self.cache.get_seq_length())  # C
        self.tok, self.par, self.score = [root], [-1], [0.0]
        self.logits = {0: root_logits}
        self.vocab = int(root_logits.shape[-1])
        self.slot = {0: 0}  # node -> j: at cache column C - 1 + j, in feeding order (the root at C - 1)
        self._q: dict[int, torch.Tensor] = {}

    def add(self, token: int, parent: int, logp: float = 0.0) -> int:
        self.tok.append(int(token))
        self.par.append(parent)
        self.score.append(self.score[parent] + logp)
        return len(self.tok) - 1

    def q(self, node: int, sampling: SamplingParams) -> torch.Tensor:
        """The draft distribution [V] at `node` after the sampling transforms (cached)."""
        if node not in self._q:
            self._q[node] = target_probs(self.logits[node], sampling)
        return self._q[node]

    def draw(self, node: int, count: int, rule: str, sampling: SamplingParams, generator) -> list[int | None]:
        """`count` children of `node` drawn from q (i.i.d. or without replacement); None = none left."""
        q = self.q(node, sampling)
        if count == 1:
            return [sample(q, generator)]
        if rule == "iid":
            return torch.multinomial(q, count, replacement=True, generator=generator).tolist()
        n = min(count, int((q > 0).sum()))
        drawn = torch.multinomial(q, n, replacement=False, generator=generator).tolist()
        return drawn + [None] * (count - n)

    def run(self, nodes: list[int]) -> None:
        """ONE draft forward over `nodes` (their parents already run): tree mask, positions C - 1 + d."""
        if not nodes:
            return
        self.slot.update({node: len(self.slot) + i for i, node in enumerate(nodes)})
        parents = torch.tensor([-1] + [self.slot[self.par[n]] for n in list(self.slot)[1:]])  # [M] by slot
        device = self.model.device
        kwargs = {}
        if len(nodes) > 1 or not torch.equal(parents, torch.arange(-1, len(parents) - 1)):
            past = self.committed - 1  # the root is fed node 0, at column C - 1
            dtype = self.model.dtype if self.model.dtype.is_floating_point else torch.float32
            every, positions, _ = tree_inputs_on_device(parents[None].to(device), past, dtype)  # [1, M]
            full, rows = every[:, :, -len(nodes) :], positions[:, -len(nodes) :]  # the new nodes' [1, n]
            mask: torch.Tensor | dict[str, torch.Tensor] = full
            if self.sliding:  # keys at positions 0..past-1, then the fed nodes' [C - 1 + M]
                mask = layer_masks(
                    self.sliding, full, rows, torch.cat([torch.arange(past, device=device), positions[0]])
                )
            kwargs = {"attention_mask": mask, "position_ids": rows}
            # mask [1, 1, n, C - 1 + M], positions [1, n]; a chain runs as a plain causal step
        logits = run_model(self.model, self.cache, [self.tok[n] for n in nodes], **kwargs)
        for i, node in enumerate(nodes):
            self.logits[node] = logits[i]  # [V]
