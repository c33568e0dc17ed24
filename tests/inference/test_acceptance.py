"""Acceptance: greedy on constructed logits; sampling rules A/B/C are LOSSLESS (tested statistically);
deliberately wrong rules fail the same check; typical acceptance is the lossy opt-in."""

from __future__ import annotations

import itertools

import pytest
import torch

from spechead.inference.acceptance import (
    Acceptance,
    greedy_accept,
    sample_accept,
    typical_accept,
    walk,
)
from spechead.inference.queued_acceptance import QueuedAcceptance
from spechead.inference.sampling import SamplingParams, make_generator, sample, target_probs
from spechead.inference.tree import TokenTree, ancestors_on_device

V = 8


def one_hot_logits(argmaxes: list[int]) -> torch.Tensor:
    """Logits [N, V] whose row i has its argmax at argmaxes[i]."""
    logits = torch.zeros(len(argmaxes), V)
    logits[torch.arange(len(argmaxes)), torch.tensor(argmaxes)] = 5.0
    return logits


#        0(root)
#      /   \
#   1:a=3   2:b=5
#    |  \       \
#  3:4  4:6     5:7
#   |
#  6:1
PARENTS = torch.tensor([-1, 0, 0, 1, 1, 2, 3])
TOKENS = torch.tensor([9 % V, 3, 5, 4, 6, 7, 1])


def test_greedy_deep_path():
    # argmax at root=3 (node 1), at node 1 = 4 (node 3), at node 3 = 1 (node 6), at node 6 = 2 (bonus)
    acc = greedy_accept(TokenTree(TOKENS, PARENTS), one_hot_logits([3, 4, 0, 1, 0, 0, 2]))
    assert acc == Acceptance([0, 1, 3, 6], 2, [9 % V, 3, 4, 1])
    assert acc.path_tokens == [9 % V, 3, 4, 1]  # the tokens at the path, root first


def test_greedy_branch_choice_and_correction():
    # root argmax = 5 -> node 2; at node 2 argmax = 0 (node 5 holds 7) -> correction 0
    acc = greedy_accept(TokenTree(TOKENS, PARENTS), one_hot_logits([5, 4, 0, 1, 0, 0, 2]))
    assert acc == Acceptance([0, 2], 0, [9 % V, 5])
    # branch under node 1: argmax 6 -> node 4 (a leaf): bonus = argmax at node 4
    acc = greedy_accept(TokenTree(TOKENS, PARENTS), one_hot_logits([3, 6, 0, 1, 2, 0, 0]))
    assert acc == Acceptance([0, 1, 4], 2, [9 % V, 3, 6])
    assert acc.path_tokens == [9 % V, 3, 6]


def test_greedy_nothing_accepted():
    acc = greedy_accept(TokenTree(TOKENS, PARENTS), one_hot_logits([0, 4, 0, 1, 0, 0, 2]))
    assert acc == Acceptance([0], 0, [9 % V])
    root_only = greedy_accept(TokenTree(torch.tensor([3]), torch.tensor([-1])), one_hot_logits([6]))
    assert root_only == Acceptance([0], 6, [3])


def test_greedy_tie_prefers_lowest_index_at_equal_depth():
    tree = TokenTree(torch.tensor([0, 2, 2, 3]), torch.tensor([-1, 0, 0, 2]))  # duplicate siblings
    assert greedy_accept(tree, one_hot_logits([2, 0, 0, 0])).path == [0, 1]
    assert greedy_accept(tree, one_hot_logits([2, 0, 3, 0])).path == [0, 2, 3]  # deeper wins


def test_the_device_greedy_rule_takes_each_rows_own_tree():
    """Rows of one size but different shapes (a chain, a star, a branching tree): each row's path is
    its own tree's, as greedy_accept finds it alone (not row 0's ancestors of the same node)."""
    shapes = [[-1, 0, 1, 2, 3], [-1, 0, 0, 0, 0], [-1, 0, 0, 2, 1]]
    g = torch.Generator().manual_seed(0)
    for trial in range(20):
        parents = torch.tensor(shapes[trial % 3 :] + shapes[: trial % 3])  # [B, N], row 0 varies
        logits = torch.randn(3, 5, V, generator=g)  # [B, N, V]
        best = logits.argmax(-1)  # [B, N]
        tokens = best.gather(1, parents.clamp(min=0))  # every node its parent's argmax: deep paths
        tokens[:, 0] = 7
        tokens[torch.rand(3, 5, generator=g) < 0.25] = V - 1  # some misses (unless it is the argmax)
        got = QueuedAcceptance.greedy(tokens, parents, ancestors_on_device(parents), logits).result()
        for b in range(3):
            want = greedy_accept(TokenTree(tokens[b], parents[b]), logits[b])
            assert got[b] == want and got[b].path_tokens == want.path_tokens, f"trial {trial}, row {b}"


def test_sampling_with_one_hot_target_is_greedy():
    logits = torch.randn(7, V, generator=torch.Generator().manual_seed(1))
    p = target_probs(logits, SamplingParams(temperature=0.0))
    tokens = TOKENS.clone()
    tokens[1] = int(logits[0].argmax())
    tree = TokenTree(tokens, PARENTS)
    want = greedy_accept(tree, logits)
    for rule in ("deterministic", "iid", "without_replacement"):
        q = torch.full((7, V), 1.0 / V)
        got = sample_accept(tree, p, rule, q, make_generator(0))
        assert got == want and got.path_tokens == want.path_tokens == tokens[want.path].tolist()


def test_sample_accept_argument_errors():
    tree = TokenTree(TOKENS, PARENTS)
    p = torch.full((7, V), 1.0 / V)
    with pytest.raises(ValueError, match="rule"):
        sample_accept(tree, p, "greedy")
    with pytest.raises(ValueError, match="needs q"):
        sample_accept(tree, p, "iid")
    with pytest.raises(ValueError, match=r"\[N, V\]"):
        sample_accept(tree, p[:3], "deterministic")
    q = p.clone()
    q[0, 3] = 0.0  # node 1's token cannot have been sampled from q[0]
    with pytest.raises(ValueError, match="q = 0"):
        sample_accept(tree, p, "iid", q, make_generator(0))


def test_sample_accept_does_not_mutate_inputs():
    tree = TokenTree(TOKENS, PARENTS)
    p = torch.softmax(torch.randn(7, V, generator=torch.Generator().manual_seed(3)), -1)
    q = torch.softmax(torch.randn(7, V, generator=torch.Generator().manual_seed(4)), -1)
    p0, q0 = p.clone(), q.clone()
    for rule in ("deterministic", "iid", "without_replacement"):
        for s in range(20):
            sample_accept(tree, p, rule, q, make_generator(s))
    assert torch.equal(p, p0) and torch.equal(q, q0)


def test_typical_accept_is_lossy_opt_in_and_greedy_at_t0():
    tree = TokenTree(TOKENS, PARENTS)
    logits = one_hot_logits([3, 4, 0, 1, 0, 0, 2]) * 3
    assert typical_accept(tree, logits, 0.0) == greedy_accept(tree, logits)
    acc = typical_accept(tree, logits, 0.7, generator=make_generator(0))
    assert acc.path == [0, 1, 3, 6] and acc.next_token == 2  # peaked target: same as greedy
    # a flat-ish target: typical acceptance accepts a plausible token that is not the argmax
    flat = torch.zeros(7, V)
    flat[:, 0] = 0.5
    acc = typical_accept(tree, flat, 1.0, generator=make_generator(0))
    assert acc.path[:2] == [0, 1]


# Rows of probabilities for typical acceptance (T = 1, logits = log p), V = 8. H = entropy.
FLAT = [0.16, 0.16, 0.16, 0.16, 0.16, 0.06, 0.07, 0.07]  # 0.3 * exp(-H) = 0.040 < 0.09: threshold 0.040
PEAKED = [0.85, 0.12] + [0.005] * 6  # 0.3 * exp(-H) = 0.173 > 0.09: threshold clamped to 0.09


def test_typical_accept_thresholds_a_child_at_its_parent_clamped_at_posterior_threshold():
    """A child is judged by its PARENT's row and threshold min(posterior_threshold, alpha * exp(-H))."""
    chain = TokenTree(torch.tensor([0, 5]), torch.tensor([-1, 0]))
    # token 5 has p = 0.06 at the flat root (threshold 0.040): accepted, although 0.06 is below the
    # threshold of the child's own (peaked) row, 0.09
    logits = torch.tensor([FLAT, PEAKED]).log()
    assert typical_accept(chain, logits, 1.0, generator=make_generator(0)).path == [0, 1]
    # token 1 has p = 0.12 at a peaked root: above the clamped 0.09, below the unclamped 0.173
    chain = TokenTree(torch.tensor([0, 1]), torch.tensor([-1, 0]))
    logits = torch.tensor([PEAKED, FLAT]).log()
    assert typical_accept(chain, logits, 1.0, generator=make_generator(0)).path == [0, 1]
    # and a child below its parent's threshold is rejected (token 2: p = 0.005 < 0.09)
    chain = TokenTree(torch.tensor([0, 2]), torch.tensor([-1, 0]))
    assert typical_accept(chain, logits, 1.0, generator=make_generator(0)).path == [0]


def test_typical_accept_breaks_depth_ties_by_the_paths_log_probability():
    """Two accepted paths of equal depth: the one of higher sum of log pi wins, not the lower index."""
    tree = TokenTree(torch.tensor([0, 1, 0]), torch.tensor([-1, 0, 0]))  # node 1: p 0.12, node 2: p 0.85
    logits = torch.tensor([PEAKED, FLAT, FLAT]).log()
    assert typical_accept(tree, logits, 1.0, generator=make_generator(0)).path == [0, 2]
    # equal scores too: the lowest index
    tree = TokenTree(torch.tensor([0, 0, 0]), torch.tensor([-1, 0, 0]))
    assert typical_accept(tree, logits, 1.0, generator=make_generator(0)).path == [0, 1]


def test_typical_accept_always_keeps_the_argmax_even_above_every_probability():
    """At posterior_alpha >= 1 the threshold can exceed every probability of the last node's row (a flat
    row: alpha * exp(-H) = alpha / V): the next token is then the argmax, never a draw from nothing."""
    root = TokenTree(torch.tensor([0]), torch.tensor([-1]))
    row = torch.full((1, V), 0.12)
    row[0, 3] = 0.16  # p 0.16 at token 3, 0.12 elsewhere: threshold min(0.9, 4 * exp(-H)) ~ 0.50
    for seed in range(8):
        acc = typical_accept(root, row.log(), 1.0, 0.9, 4.0, generator=make_generator(seed))
        assert acc.path == [0] and acc.next_token == 3


# ---------------------------------------------------------------------------------------------------
# Statistical losslessness. A toy "target" is a fixed table of next-token distributions P[context]
# (V_S = 4, contexts of length 0..2) and a toy "drafter" a different table Q[context]. Every trial
# drafts a tree, verifies it and records the first two emitted tokens (when only one was emitted, the
# second is drawn from P[(e1,)], as the next lossless step would). Their empirical joint must match the
# EXACT target joint P[()](a) * P[(a,)](b) within a sampling-noise bound.
# ---------------------------------------------------------------------------------------------------
V_S = 4
TRIALS = 6000
#          0
#      /   |   \
#     1    2    3
#    / \   |
#   4   5  6
S_PARENTS = torch.tensor([-1, 0, 0, 0, 1, 1, 2])
KIDS = {0: [1, 2, 3], 1: [4, 5], 2: [6]}


def _table(seed: int) -> dict[tuple[int, ...], torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ctxs = [()] + [(a,) for a in range(V_S)] + list(itertools.product(range(V_S), repeat=2))
    return {c: torch.softmax(2.0 * torch.randn(V_S, generator=g), -1) for c in ctxs}


P_TAB, Q_TAB = _table(0), _table(1)
# at the root the drafter's favourites are unlikely for the target, one is impossible (p = 0)
P_TAB[()] = torch.tensor([0.15, 0.05, 0.0, 0.8])
Q_TAB[()] = torch.tensor([0.1, 0.3, 0.5, 0.1])
EXACT = torch.stack([P_TAB[()][a] * P_TAB[(a,)] for a in range(V_S)])  # [V_S, V_S] joint of (e1, e2)


def _draft(mode: str, g: torch.Generator) -> tuple[torch.Tensor, list[tuple[int, ...]]]:
    """Tree tokens [N] and each node's context (its path's tokens after the root)."""
    tokens, ctx = [0] * 7, [()] * 7
    for node, kids in KIDS.items():
        q = Q_TAB[ctx[node]]
        if mode == "topk":
            picks = torch.topk(q, len(kids)).indices.tolist()
        elif mode == "dup":  # deterministic children with a duplicate: best, best, second
            top = torch.topk(q, 2).indices.tolist()
            picks = ([top[0], top[0], top[1]])[: len(kids)]
        else:
            picks = torch.multinomial(q, len(kids), replacement=(mode == "iid"), generator=g).tolist()
        for kid, tok in zip(kids, picks):
            tokens[kid], ctx[kid] = tok, ctx[node] + (tok,)
    return torch.tensor(tokens), ctx


def _accept_all(tree: TokenTree, p: torch.Tensor, g: torch.Generator) -> Acceptance:
    """A WRONG rule: accept the first child at every level, then a bonus from p."""
    path = [0]
    while any(int(par) == path[-1] for par in tree.parents):
        path.append(next(i for i, par in enumerate(tree.parents.tolist()) if par == path[-1]))
    return Acceptance(path, sample(p[path[-1]], g), tree.tokens[path].tolist())


def _tv_to_exact(draft_mode: str, rule: str, seed: int) -> tuple[float, float]:
    """(total variation of the empirical (e1, e2) joint to EXACT, noise bound for TRIALS samples)."""
    g = make_generator(seed)
    counts = torch.zeros(V_S, V_S)
    for _ in range(TRIALS):
        tokens, ctx = _draft(draft_mode, g)
        tree = TokenTree(tokens, S_PARENTS)
        p = torch.stack([P_TAB[c] for c in ctx])  # [N, V_S]
        q = torch.stack([Q_TAB[c] for c in ctx])  # [N, V_S]
        if rule == "accept_all":
            acc = _accept_all(tree, p, g)
        elif rule == "device":  # rule A as batched tensor ops (queued_acceptance.py), coins drawn there
            anc = ancestors_on_device(tree.parents[None])
            acc = QueuedAcceptance.sampled(tree.tokens[None], tree.parents[None], anc, p[None], [g]).result()[
                0
            ]
        else:
            acc = sample_accept(tree, p, rule, q, g)
        emitted = tokens[acc.path[1:]].tolist() + [acc.next_token]
        e2 = emitted[1] if len(emitted) > 1 else sample(P_TAB[(emitted[0],)], g)
        counts[emitted[0], e2] += 1
    tv = 0.5 * (counts / TRIALS - EXACT).abs().sum().item()
    # E|freq - p| <= sqrt(p (1 - p) / n) per cell; 3x that bound on E[TV] (~4x the typical noise TV,
    # ~0.01 here) leaves room for any seed while a biased rule (TV ~0.2) is far above it
    bound = 3 * 0.5 * (EXACT * (1 - EXACT) / TRIALS).sqrt().sum().item()
    return tv, bound


@pytest.mark.parametrize(
    ("draft_mode", "rule"),
    [
        ("topk", "deterministic"),  # A: top-k children
        ("dup", "deterministic"),  # A: duplicate sibling tokens
        # A is lossless for ANY children chosen independently of the target's coins, sampled ones too:
        # it is sequential rejection with point-mass proposals (residual r minus the rejected token)
        ("iid", "deterministic"),
        ("topk", "device"),  # A on the device, the coins drawn up front
        ("dup", "device"),
        ("iid", "iid"),  # B
        ("without_replacement", "without_replacement"),  # C
    ],
)
def test_sampling_rules_are_lossless(draft_mode, rule):
    tv, bound = _tv_to_exact(draft_mode, rule, seed=123)
    assert tv < bound, f"{rule} on {draft_mode} children: TV {tv:.4f} >= bound {bound:.4f}"


@pytest.mark.parametrize(
    ("draft_mode", "rule"),
    [
        ("topk", "iid"),  # q ratios with deterministic children
        ("topk", "accept_all"),  # accepting every child
    ],
)
def test_wrong_rules_fail_the_same_check(draft_mode, rule):
    tv, bound = _tv_to_exact(draft_mode, rule, seed=123)
    assert tv > 2 * bound, (
        f"the check has no teeth: {rule} on {draft_mode} gives TV {tv:.4f} (bound {bound:.4f})"
    )


# ---------------------------------------------------------------------------------------------------
# EXACT output distributions (no sampling noise). `Enumerator` runs the real `sample_accept` once per
# outcome of its random draws: every uniform coin `u < t` and every `sample(probs)` call is a branch
# point whose outcomes are replayed depth-first with their exact probabilities. The drafted children are
# enumerated too (every ordered draw, with its exact probability), so the result is the exact joint
# distribution of the first two emitted tokens, to be compared with EXACT up to float rounding.
# ---------------------------------------------------------------------------------------------------
class Enumerator:
    """Replays a function over all branches of its random choices: `outcomes(fn)` -> [(prob, result)]."""

    def __init__(self) -> None:
        self.prefix: list[int] = []  # branch taken at each choice point of the current run
        self.sizes: list[int] = []  # number of branches at each choice point of the current run
        self.weight = 1.0
        self.depth = 0

    def choose(self, probs: list[float]) -> int:
        """A choice point with outcome i of probability probs[i] (zero-probability outcomes skipped)."""
        live = [i for i, x in enumerate(probs) if x > 0]
        if self.depth == len(self.prefix):
            self.prefix.append(0)
            self.sizes.append(len(live))
        i = live[self.prefix[self.depth]]
        self.depth += 1
        self.weight *= probs[i]
        return i

    def outcomes(self, fn) -> list[tuple[float, object]]:
        results = []
        while True:
            self.weight, self.depth = 1.0, 0
            out = fn()
            results.append((self.weight, out))
            del self.prefix[self.depth :], self.sizes[self.depth :]
            while self.prefix and self.prefix[-1] + 1 == self.sizes[-1]:
                self.prefix.pop()
                self.sizes.pop()
            if not self.prefix:
                return results
            self.prefix[-1] += 1


class _Coin:
    """What `_uniform` returns under enumeration: `u < t` is a branch, True with probability t."""

    def __init__(self, enum: Enumerator) -> None:
        self.enum = enum

    def __lt__(self, t: float) -> bool:
        t = min(max(float(t), 0.0), 1.0)
        return self.enum.choose([t, 1.0 - t]) == 0


def _enumerated(monkeypatch) -> Enumerator:
    """Route sample_accept's randomness (its uniforms and its `sample` draws) through an Enumerator."""
    import spechead.inference.acceptance as acceptance

    enum = Enumerator()
    monkeypatch.setattr(acceptance, "_uniform", lambda generator, device: _Coin(enum))

    def draw(probs, generator=None):
        w = probs.double() / probs.double().sum()
        return enum.choose(w.tolist())

    monkeypatch.setattr(acceptance, "sample", draw)
    return enum


def _draw_orders(q: torch.Tensor, k: int, mode: str) -> list[tuple[float, list[int]]]:
    """Every ordered draw of k children from q [V_S] with its exact probability."""
    out = []
    for picks in itertools.product(range(V_S), repeat=k):
        prob, left = 1.0, q.double().clone()
        for x in picks:
            if mode == "iid":
                prob *= float(q[x])
            else:  # without replacement: sequential draws from the renormalised rest
                if left[x] == 0:
                    prob = 0.0
                    break
                prob *= float(left[x] / left.sum())
                left[x] = 0.0
        if prob > 0:
            out.append((prob, list(picks)))
    return out


def exact_joint(
    monkeypatch, draft_mode: str, rule: str, kids: dict[int, list[int]], host: bool = True
) -> torch.Tensor:
    """Exact joint [V_S, V_S] of the first two emitted tokens: the drafter's draws x sample_accept's
    (its walk over numpy rows, a CPU's, or with `host` False over torch rows, every other device's)."""
    enum = _enumerated(monkeypatch)
    n = 1 + sum(len(v) for v in kids.values())
    parents = torch.tensor([-1] + [p for p, cs in sorted(kids.items()) for _ in cs])
    order = [c for _, cs in sorted(kids.items()) for c in cs]
    assert order == list(range(1, n)), "kids must number the nodes breadth-first"
    joint = torch.zeros(V_S, V_S, dtype=torch.float64)

    def expand(node_list, tokens, ctx, prob):
        if not node_list:
            tree = TokenTree(torch.tensor(tokens), parents)
            p = torch.stack([P_TAB[c] for c in ctx]).double()  # [N, V_S]
            q = torch.stack([Q_TAB[c] for c in ctx]).double()  # [N, V_S]
            accept = (
                (lambda: sample_accept(tree, p, rule, q))
                if host
                else (lambda: walk(tree, p, rule, q, None, False))
            )
            for w, acc in enum.outcomes(accept):
                emitted = [tokens[i] for i in acc.path[1:]] + [acc.next_token]
                if len(emitted) > 1:
                    joint[emitted[0], emitted[1]] += prob * w
                else:  # the next lossless step draws e2 from the target at (e1,)
                    joint[emitted[0]] += prob * w * P_TAB[(emitted[0],)].double()
            return
        node, rest = node_list[0], node_list[1:]
        for w, picks in _draw_orders(Q_TAB[ctx[node]], len(kids[node]), draft_mode):
            t, c = list(tokens), list(ctx)
            for kid, tok in zip(kids[node], picks):
                t[kid], c[kid] = tok, ctx[node] + (tok,)
            expand(rest, t, c, prob * w)

    expand(sorted(kids), [0] * n, [()] * n, 1.0)
    return joint


#      0
#    / | \
#   1  2  3        siblings at two levels, so a rejected child's q(x) matters twice
#  / \
# 4   5
EXACT_KIDS = {0: [1, 2, 3], 1: [4, 5]}


@pytest.mark.parametrize(
    ("draft_mode", "rule"),
    [("iid", "iid"), ("without_replacement", "without_replacement"), ("iid", "deterministic")],
)
@pytest.mark.parametrize("host", [True, False], ids=["numpy-rows", "torch-rows"])
def test_sampling_rules_are_exactly_lossless(monkeypatch, draft_mode, rule, host):
    joint = exact_joint(monkeypatch, draft_mode, rule, EXACT_KIDS, host)
    assert abs(float(joint.sum()) - 1.0) < 1e-6  # every branch enumerated (sample_accept runs in fp32)
    err = float((joint - EXACT.double()).abs().max())
    assert err < 1e-6, f"{rule} on {draft_mode} children: max |P - exact| = {err:.2e}"


@pytest.mark.parametrize("host", [True, False], ids=["numpy-rows", "torch-rows"])
def test_without_replacement_needs_q_renormalised(monkeypatch, host):
    """Teeth for rule C: children drawn WITHOUT replacement but verified as rule B (which is rule C
    minus "remove the rejected x from q and renormalise") are off by far more than rounding."""
    joint = exact_joint(monkeypatch, "without_replacement", "iid", EXACT_KIDS, host)
    err = float((joint - EXACT.double()).abs().max())
    assert err > 1e-3, f"skipping the q update went unnoticed (max |P - exact| = {err:.2e})"
