"""EAGLE-1/2 and EAGLE-3 drafting: static (Medusa-style) or dynamic (EAGLE-2) trees from a feature head.

Cache convention (the same as training, see spechead.heads.unroll): the head's DynamicCache holds one
COMMITTED entry per position t whose pair (target feature f_t, token x_{t+1}) is known, at rotary
position t; C = number of committed entries = the target's cached length. The output of the last pair
(position C - 1, token x_C = the root) predicts the root's children.

Drafting a tree rooted at x_C: a node at depth d >= 1 (token x_{C+d}) is run as TTT step d at
position C + d - 1: it reads its parent's output feature and its own token, and attends to the C
committed entries, the entries of its ancestors at depths 1..d-1 and itself (exactly
`ttt_allowed`). Those speculative entries are cropped away after every `propose`.
"""

from __future__ import annotations

import torch
from torch import Tensor
from transformers import DynamicCache

from spechead.heads.decoder_layer import additive_mask
from spechead.heads.eagle import EagleHead
from spechead.heads.eagle3 import Eagle3Head
from spechead.inference.drafters.base import Draft, Drafter
from spechead.inference.sampling import SamplingParams
from spechead.inference.tree import StaticTree, TokenTree, tree_from_choices


class EagleDrafter(Drafter):
    """Drafts token trees with an EagleHead (EAGLE-1/2) or Eagle3Head; children are the head's top-k.

    tree: "dynamic" (EAGLE-2: per depth expand the `top_k` frontier nodes of highest cumulative
    log-prob, each with its `top_k` children, down to `depth`; keep the best `total_tokens - 1`
    nodes) or static paths of child ranks, e.g. [[0], [1], [0, 0]] (see `tree_from_choices`).
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
    ) -> None:
        self.head = head
        self.hidden_layers = tuple(head.config.target_layers)
        self._vocab = getattr(head.config, "draft_vocab_size", head.config.vocab_size)  # Vd
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
            if int(self._static.rank.max()) >= self._vocab:
                raise ValueError(f"a static tree rank exceeds the head's (draft) vocab size {self._vocab}")
        self.top_k, self.depth, self.total_tokens = top_k, depth, total_tokens
        self._cache: DynamicCache | None = None
        self._committed = 0  # C: committed cache entries
        self._feature: Tensor | None = None  # [H]: output of the last committed pair
        self._root: int | None = None  # the token x_C that pair was fed with
        self.last_scores: Tensor | None = None  # [N] float64

    # ---- Drafter interface ---------------------------------------------------------------------

    def check_target(self, hidden_size: int, vocab_size: int, num_layers: int) -> None:
        """Delegate to the head (HeadError, a ValueError, on a mismatch)."""
        self.head.check_target(hidden_size, vocab_size, num_layers)

    def start(self, prompt: Tensor, hidden: dict[int, Tensor], root: int) -> None:
        """Reset and commit the pairs (f_t, x_{t+1}) of the prompt [T], with x_T = root."""
        if prompt.dim() != 1 or prompt.numel() == 0:
            raise ValueError(f"prompt must be a non-empty 1-D tensor [T], got shape {tuple(prompt.shape)}")
        self._cache, self._committed, self._feature = DynamicCache(), 0, None
        self._commit(prompt, hidden, root)

    def accept(self, tokens: Tensor, hidden: dict[int, Tensor], next_root: int) -> None:
        """Commit the pairs of tokens [K] (root + accepted drafts) in one head step."""
        if self._cache is None:
            raise RuntimeError("EagleDrafter.accept called before start")
        if tokens.dim() != 1 or tokens.numel() == 0:
            raise ValueError(f"tokens must be a non-empty 1-D tensor [K], got shape {tuple(tokens.shape)}")
        self._crop()
        self._commit(tokens, hidden, next_root)

    def propose(self, root: int, sampling: SamplingParams, generator: torch.Generator | None) -> Draft:
        """A tree of the head's top-k children (deterministic: no q, lossless rule A / greedy)."""
        if self._cache is None or self._feature is None:
            raise RuntimeError("EagleDrafter.propose called before start")
        if int(root) != self._root:
            raise ValueError(f"propose got root {int(root)} but start/accept announced {self._root}")
        try:
            with torch.no_grad():
                grower = _Grower(self, root)
                if self._static is not None:
                    self._grow_static(grower)
                    keep = list(range(len(grower.tok)))
                else:
                    keep = self._grow_dynamic(grower)
        finally:
            self._crop()  # drop every speculative entry: the cache holds the C committed ones only
        index = {node: i for i, node in enumerate(keep)}  # keep is ascending, so topological
        self.last_scores = torch.tensor([grower.score[n] for n in keep], dtype=torch.float64)
        tree = TokenTree(
            tokens=torch.tensor([grower.tok[n] for n in keep], dtype=torch.long),
            parents=torch.tensor([index.get(grower.par[n], -1) for n in keep], dtype=torch.long),
        )
        return Draft(tree=tree, rule="deterministic")

    # ---- committed cache ---------------------------------------------------------------------

    def _commit(self, tokens: Tensor, hidden: dict[int, Tensor], next_token: int) -> None:
        """Step the head on pairs (f of tokens[i], tokens[i+1] or next_token) at positions C.. (causal)."""
        device = self.head.fc.weight.device
        tokens = tokens.to(device=device, dtype=torch.long)
        features = self._features(hidden, tokens.numel())  # [1, K, H]
        next_ids = torch.cat([tokens[1:], tokens.new_tensor([int(next_token)])])[None]  # [1, K]
        with torch.no_grad():
            out = self.head.step(features, next_ids, past_key_values=self._cache)  # [1, K, H]
        self._committed += tokens.numel()
        self._feature = out[0, -1]
        self._root = int(next_token)

    def _features(self, hidden: dict[int, Tensor], length: int) -> Tensor:
        """Target states {layer: [K, H]} -> the head's input features [1, K, H] (fused for EAGLE-3)."""
        missing = [layer for layer in self.hidden_layers if layer not in hidden]
        if missing:
            raise KeyError(f"hidden states of layers {missing} missing (drafter reads {self.hidden_layers})")
        weight = self.head.fc.weight  # a bf16 target may feed an fp32 head (e.g. evaluated while training)
        states = [
            hidden[layer].to(weight.device, weight.dtype)[None] for layer in self.hidden_layers
        ]  # [1, K, H]
        for layer, state in zip(self.hidden_layers, states):
            if state.shape[1] != length:
                raise ValueError(f"hidden[{layer}] has {state.shape[1]} positions, expected {length}")
        if isinstance(self.head, Eagle3Head):
            with torch.no_grad():
                return self.head.fuse(states)
        return states[0]

    def _crop(self) -> None:
        extra = self._cache.get_seq_length() - self._committed if self._cache is not None else 0
        if extra > 0:
            self._cache.crop(-extra)

    # ---- tree growth ---------------------------------------------------------------------------

    def _grow_static(self, grower: _Grower) -> None:
        """Fill the static tree depth by depth: node i is the rank[i]-th child of its parent."""
        st = self._static
        parents, depth, rank = st.parents.tolist(), st.depth.tolist(), st.rank.tolist()  # [N] each
        for d in range(1, max(depth) + 1):
            nodes = [i for i in range(st.size) if depth[i] == d]
            expand = sorted({parents[i] for i in nodes})
            logp = grower.logprobs(expand)  # [len(expand), Vd]
            need = max(rank[i] for i in nodes) + 1
            values, ids = logp.topk(need, dim=-1)  # [len(expand), need] each
            ids, values = grower.target_ids(ids).tolist(), values.tolist()
            row = {p: r for r, p in enumerate(expand)}
            for i in nodes:
                r, k = row[parents[i]], rank[i]
                added = grower.add(ids[r][k], parents[i], values[r][k])
                assert added == i, "static tree nodes must be added in their topological order"

    def _grow_dynamic(self, grower: _Grower) -> list[int]:
        """EAGLE-2: beam of `top_k` nodes per depth; returns the kept node ids (ascending)."""
        frontier = [0]
        for d in range(1, self.depth + 1):
            logp = grower.logprobs(frontier)  # [F, Vd]
            values, ids = logp.topk(self.top_k, dim=-1)  # [F, top_k] each
            ids, values = grower.target_ids(ids).tolist(), values.tolist()
            new = [
                grower.add(ids[f][j], node, values[f][j])
                for f, node in enumerate(frontier)
                for j in range(self.top_k)
            ]
            if d < self.depth:
                frontier = sorted(sorted(new, key=lambda n: (-grower.score[n], n))[: self.top_k])
        return select_best(grower.par, grower.score, self.total_tokens - 1)


class _Grower:
    """A growing draft tree whose nodes run on the head against the committed cache.

    Node lists tok / par / dep / score are [n] Python lists (node 0 = root); `out[node]` is the
    node's output feature [H] (root: the last committed output); `slot[node]` its speculative
    cache column after the C committed ones.
    """

    def __init__(self, drafter: EagleDrafter, root: int) -> None:
        self.drafter = drafter
        self.tok, self.par, self.dep, self.score = [int(root)], [-1], [0], [0.0]
        self.out: dict[int, Tensor] = {0: drafter._feature}
        self.slot: dict[int, int] = {}

    def target_ids(self, ids: Tensor) -> Tensor:
        """Head-vocab ids (any shape) -> target ids (EAGLE-3 maps its draft vocab with d2t)."""
        head = self.drafter.head
        return head.draft_to_target(ids) if isinstance(head, Eagle3Head) else ids

    def add(self, token: int, parent: int, logp: float) -> int:
        """Append child `token` (a target id) of `parent` with log-prob `logp`; returns its node id."""
        self.tok.append(token)
        self.par.append(parent)
        self.dep.append(self.dep[parent] + 1)
        self.score.append(self.score[parent] + logp)
        return len(self.tok) - 1

    def logprobs(self, nodes: list[int]) -> Tensor:
        """Log-probs [len(nodes), Vd] of each node's children (runs the head on non-root nodes)."""
        todo = [n for n in nodes if n not in self.out]
        if todo:
            self._run(todo)
        feats = torch.stack([self.out[n] for n in nodes])[None]  # [1, n, H]
        return torch.log_softmax(self.drafter.head.logits(feats)[0].float(), dim=-1)

    def _run(self, nodes: list[int]) -> None:
        """One head step on `nodes` (their ancestors already run): tree mask + positions C + d - 1."""
        drafter, head = self.drafter, self.drafter.head
        cache, committed = drafter._cache, drafter._committed
        spec = cache.get_seq_length() - committed  # S speculative entries so far
        q = len(nodes)
        device = head.fc.weight.device
        allowed = torch.zeros(q, committed + spec + q, dtype=torch.bool)  # [q, C + S + q]
        allowed[:, :committed] = True
        for i, node in enumerate(nodes):
            allowed[i, committed + spec + i] = True
            anc = self.par[node]
            while anc > 0:  # ancestors at depth >= 1 (the root's pair is committed)
                allowed[i, committed + self.slot[anc]] = True
                anc = self.par[anc]
        features = torch.stack([self.out[self.par[n]] for n in nodes])[None]  # [1, q, H]
        ids = torch.tensor([[self.tok[n] for n in nodes]], device=device)  # [1, q]
        positions = torch.tensor([[committed + self.dep[n] - 1 for n in nodes]], device=device)  # [1, q]
        mask = additive_mask(allowed[None].to(device), head.fc.weight.dtype)  # [1, 1, q, C + S + q]
        out = head.step(features, ids, mask, positions, cache)  # [1, q, H]
        for i, node in enumerate(nodes):
            self.out[node] = out[0, i]
            self.slot[node] = spec + i


def select_best(parents: list[int], scores: list[float], budget: int) -> list[int]:
    """Node 0 plus the `budget` best nodes by score (ties: lower id), closed under ancestors.

    parents / scores are [n] lists with parents[0] = -1. A node is taken with its missing ancestors
    only if they all fit. Returns the kept ids in ascending (topological) order.
    """
    kept = {0}
    for node in sorted(range(1, len(parents)), key=lambda n: (-scores[n], n)):
        if len(kept) - 1 >= budget:
            break
        chain = []
        anc = node
        while anc not in kept:
            chain.append(anc)
            anc = parents[anc]
        if len(kept) - 1 + len(chain) <= budget:
            kept.update(chain)
    return sorted(kept)
