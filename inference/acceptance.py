"""Accepting a verified draft tree: greedy, lossless sampling (rules A, B, C) and lossy typical acceptance.

Pure functions over ONE tree: tokens / parents [N], node 0 the root (the last emitted token).
`target_logits` / `p` [N, V]: row i is the target's output AT node i, the distribution of node i's CHILD
tokens (and of the token emitted after node i when the path stops there). `q` [N, V]: row i is the draft
distribution node i's children were SAMPLED from (rules B, C).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np
import torch

from spechead.inference.sampling import TargetRows, argmax_ids, sample
from spechead.inference.tree import TokenTree, children, path_to_node

RULES = ("deterministic", "iid", "without_replacement")
Row = torch.Tensor | np.ndarray  # one row [V] of a walk: numpy on a CPU (cheap calls), else torch


@dataclass
class Acceptance:
    """`path`: accepted nodes, root first (path[0] == 0); `next_token`: emitted after them (the correction
    or bonus: the next tree's root); `path_tokens`: the tokens at `path`. The emitted tokens are
    path_tokens[1:] + [next_token]."""

    path: list[int]
    next_token: int
    path_tokens: list[int] = field(compare=False)  # (derived from path: equality ignores it)


def _check_rows(tree: TokenTree, x: torch.Tensor | TargetRows, name: str) -> None:
    if len(x.shape) != 2 or x.shape[0] != tree.size:
        raise ValueError(f"{name} must be [N, V] with N = {tree.size}, got {tuple(x.shape)}")


def greedy_accept(tree: TokenTree, target_logits: torch.Tensor) -> Acceptance:
    """Deepest path whose every child token equals the argmax of its parent's logits [N, V] (ties: lowest
    node index); next_token: the argmax at its last node. Plain greedy decoding, token for token."""
    _check_rows(tree, target_logits, "target_logits")
    return greedy_walk(tree.tokens.tolist(), tree.parents.tolist(), argmax_ids(target_logits))


def greedy_walk(tokens: list[int], parents: list[int], best: list[int]) -> Acceptance:
    """`greedy_accept` on host lists: a tree's tokens and parents [N] and the argmax of the target's
    logits at every node [N] (first max on ties). A walk in node order (parents come first)."""
    n = len(tokens)
    ok = [True] + [False] * (n - 1)
    depth = [0] * n
    deepest = 0
    for i in range(1, n):
        p = parents[i]
        depth[i] = depth[p] + 1
        ok[i] = ok[p] and tokens[i] == best[p]
        if ok[i] and depth[i] > depth[deepest]:
            deepest = i
    path = [deepest]  # walked back from the deepest accepted node (parents checked with the tree)
    while path[-1] > 0:
        path.append(parents[path[-1]])
    path.reverse()
    return Acceptance(path=path, next_token=int(best[deepest]), path_tokens=[tokens[i] for i in path])


def _normalised(r: Row, fallback: Row) -> Row:
    """A new r / sum(r), or a copy of `fallback` (p at the node) when the mass vanished or is not finite:
    rounding only, since in exact arithmetic a rejection never empties the residual."""
    s = float(r.sum())
    if s > 0 and math.isfinite(s):
        return r / s
    return _copy(fallback)


def _copy(x: Row) -> Row:
    return x.copy() if isinstance(x, np.ndarray) else x.clone()


def _uniform(generator: torch.Generator | None, device: torch.device) -> float:
    dev = generator.device if generator is not None else device
    return float(torch.rand((), generator=generator, device=dev))


def sample_accept(
    tree: TokenTree,
    p: torch.Tensor | TargetRows,
    rule: str,
    q: torch.Tensor | None = None,
    generator: torch.Generator | None = None,
) -> Acceptance:
    """Lossless speculative sampling on a tree: emitted tokens ~ p exactly, for p [N, V] probabilities
    (or `TargetRows`, which computes only the rows the walk reads).

    Walk from the root; at each node try its children in index order with residual r = p[node]:
    - "deterministic" (A, e.g. top-k of a head, n-gram): accept child x with prob r(x)/sum(r); on
      rejection r(x) = 0. q is ignored. Lossless for ANY children chosen independently of these
      acceptance coins (even sampled ones); it just does not exploit q.
    - "iid" (B, children sampled i.i.d. from q[node]): accept with min(1, r(x)/q(x)); on rejection
      r = norm(max(r - q, 0)).
    - "without_replacement" (C, children sampled from q[node] without replacement): as B, then also
      q(x) = 0 and q renormalised.
    On acceptance descend into the child; if every child is rejected emit y ~ r; at a leaf a bonus
    y ~ p[leaf]. A duplicate sibling token is rejected (r(x) = 0 by then). Under B/C a child with
    q(x) = 0 cannot have been sampled from q: ValueError. `generator` lives on p's device (or is None).
    """
    if rule not in RULES:
        raise ValueError(f"rule must be one of {RULES}, got {rule!r}")
    _check_rows(tree, p, "p")
    if rule != "deterministic":
        if q is None:
            raise ValueError(
                f"rule {rule!r} needs q [N, V], the draft distributions children were sampled from"
            )
        if q.shape != p.shape:
            raise ValueError(f"q {tuple(q.shape)} and p {tuple(p.shape)} must have the same shape [N, V]")
        q = q.to(p.device)  # drafters may run on another device than the target
    return walk(tree, p, rule, q, generator, host=p.device.type == "cpu")


def walk(
    tree: TokenTree,
    p: torch.Tensor | TargetRows,
    rule: str,
    q: torch.Tensor | None,
    generator: torch.Generator | None,
    host: bool,
) -> Acceptance:
    """`sample_accept`'s walk, its arguments checked; `host`: rows as numpy arrays (p and q on the CPU),
    else as torch tensors. Both draw the same path with the same coins (up to rounding)."""

    def row(x: torch.Tensor) -> Row:  # [V] fp32
        return x.detach().float().numpy() if host else x.float()

    def draw(r: Row) -> int:
        return sample(torch.from_numpy(r) if isinstance(r, np.ndarray) else r, generator)

    kids = children(tree.parents)
    tokens = tree.tokens.tolist()
    path = [0]
    node = 0
    while True:
        p_node = row(p[node])  # [V]
        if not kids[node]:  # whole path accepted: bonus token from p at the leaf
            return Acceptance(path, draw(p_node), [tokens[i] for i in path])
        if rule == "deterministic":
            accepted, r = _rule_a(kids[node], tokens, p_node, generator, p.device)
        else:
            assert q is not None  # rules B/C: sample_accept checked it
            accepted, r = _rules_bc(kids[node], tokens, p_node, row(q[node]), rule, node, generator, p.device)
        if accepted is None:  # every child rejected: correction token from the residual
            return Acceptance(path, draw(r), [tokens[i] for i in path])
        path.append(accepted)
        node = accepted


def _rule_a(
    kids: list[int], tokens: list[int], p_node: Row, generator: torch.Generator | None, device: torch.device
) -> tuple[int | None, Row]:
    """Rule A at one node: the first child accepted (None: all rejected) and the residual [V] (p_node
    itself until a rejection, which zeroes r(x) and takes it off a running mass: no pass over [V]
    renormalises). One coin per child tried."""
    r, mass = p_node, float(p_node.sum())  # the residual (unnormalised) and its mass
    for c in kids:
        x = tokens[c]
        rx = float(r[x])
        if _uniform(generator, device) < (rx / mass if mass > 0 else 0.0):  # (mass 0: a row without mass)
            return c, r
        if r is p_node:  # the first rejection: p's row itself is never written
            r = _copy(p_node)
        r[x] = 0.0
        mass -= rx
        if not (mass > 0 and math.isfinite(mass)):  # rounding only (see _normalised): p is a valid target
            r, mass = _copy(p_node), float(p_node.sum())
    return None, r


def _rules_bc(
    kids: list[int],
    tokens: list[int],
    p_node: Row,
    q_row: Row,
    rule: str,
    node: int,
    generator: torch.Generator | None,
    device: torch.device,
) -> tuple[int | None, Row]:
    """Rules B ("iid") and C ("without_replacement") at one node whose children were drawn from q_row
    [V]: the first child accepted (None: all rejected) and the residual [V], normalised."""
    r = _normalised(p_node, p_node)  # [V] residual, normalised (a new array)
    q_node = _normalised(q_row, q_row)  # [V] (q_row may be a view of q: this makes a new one)
    for c in kids:
        x = tokens[c]
        qx = float(q_node[x])
        if not qx > 0:
            raise ValueError(
                f"rule {rule!r}: child {c} (token {x}) has q = 0 at node {node}; "
                "children must be sampled from q[node]"
            )
        if _uniform(generator, device) < min(1.0, float(r[x]) / qx):
            return c, r
        r = r - q_node
        r = _normalised(np.maximum(r, 0.0) if isinstance(r, np.ndarray) else r.clamp(min=0.0), p_node)
        if rule == "without_replacement":
            q_node[x] = 0.0
            q_node = _normalised(q_node, q_node)
    return None, r


def typical_accept(
    tree: TokenTree,
    logits: torch.Tensor,
    temperature: float,
    posterior_threshold: float = 0.09,
    posterior_alpha: float = 0.3,
    generator: torch.Generator | None = None,
) -> Acceptance:
    """Medusa's typical acceptance. LOSSY (output does NOT follow the target's distribution): opt-in only.

    A child x of node i is accepted when
    pi(x) > min(posterior_threshold, posterior_alpha * exp(-H(pi))) with pi = softmax(logits[i] / T)
    and H its entropy; keep the deepest path of accepted nodes (ties: highest sum of log pi, then lowest
    index); next_token ~ pi at the last node restricted to tokens above the same threshold (the argmax is
    always kept). temperature 0 falls back to `greedy_accept` (which IS lossless).
    """
    _check_rows(tree, logits, "logits")
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0, got {temperature}")
    if temperature == 0:
        return greedy_accept(tree, logits)
    pi = torch.softmax(logits.float() / temperature, dim=-1)  # [N, V]
    entropy = -torch.special.xlogy(pi, pi).sum(-1)  # [N]
    threshold = torch.clamp(posterior_alpha * torch.exp(-entropy), max=posterior_threshold)  # [N]
    parent_idx = tree.parents.clamp(min=0).to(pi.device)  # [N]
    child_p = pi[parent_idx, tree.tokens.to(pi.device)]  # [N]: prob of node i's token at its parent
    ok_here = (child_p > threshold[parent_idx]).tolist()  # [N]
    logp = torch.log(child_p.clamp(min=1e-30)).tolist()  # [N]
    ok, depth, score = [True] * tree.size, [0] * tree.size, [0.0] * tree.size
    best = 0
    for i, j in enumerate(tree.parents.tolist()[1:], start=1):  # node i, its parent j
        ok[i] = ok[j] and ok_here[i]
        depth[i], score[i] = depth[j] + 1, score[j] + logp[i]
        if ok[i] and (depth[i], score[i]) > (depth[best], score[best]):
            best = i
    keep = pi[best] > threshold[best]  # [V]
    keep[pi[best].argmax()] = True
    path = path_to_node(tree.parents, best)
    return Acceptance(path, sample(pi[best] * keep, generator), tree.tokens[path].tolist())
