"""Lookahead decoding: the pure pieces (pool, window, trees), the Jacobi outputs it reads, and losslessness
through the engine: greedy equals plain decoding, sampling follows the target (rule A), batch rows equal
their batch-1 runs. The generator tests run on the one engine."""

from __future__ import annotations

import pytest
import torch

from spechead.inference.drafter_specs import drafter_options
from spechead.inference.drafters.base import Draft
from spechead.inference.drafters.lookahead import (
    LookaheadDrafter,
    candidate_trie,
    jacobi_update,
    ngrams,
    pool_add,
    window_nodes,
)
from spechead.inference.drafters.per_row import RowLoopDrafter
from spechead.inference.drafters.prompt_lookup import PromptLookupDrafter
from spechead.inference.generator import SpeculativeGenerator
from spechead.inference.sampling import SamplingParams, target_probs
from spechead.inference.tree import path_to_node

from ..distributions import sampling_tv
from ..test_generator import PARAMS, PROMPT, plain_greedy, prompts
from ..trees import ancestor_mask, depths

OPTIONS = {
    "default": {},
    "wide": {"window": 7, "ngram": 5, "candidates": 8},
    "bigram": {"window": 3, "ngram": 2, "candidates": 2},
    "window_only": {"candidates": 0},
}


@pytest.fixture(scope="module")
def setup(tiny_llama, chatml_tokenizer):
    model = tiny_llama(len(chatml_tokenizer), layers=2, hidden=32, seed=3)
    model.generation_config.eos_token_id = None
    return model, chatml_tokenizer


# ---- pure pieces (no model) ------------------------------------------------------------------------


def test_pool_keeps_recent_continuations_per_first_token():
    pool: dict = {}
    for gram in [(1, 2, 3), (1, 4, 5), (2, 3, 4), (1, 2, 3), (1, 6, 7), (1, 8, 9)]:
        pool_add(pool, gram, limit=3)
    assert pool[1] == [(8, 9), (6, 7), (2, 3)]  # newest first, a repeat moved up, oldest dropped
    assert pool[2] == [(3, 4)]
    seq = [5, 6, 7, 8, 9]
    assert ngrams(seq, 3) == [(5, 6, 7), (6, 7, 8), (7, 8, 9)]
    assert ngrams(seq, 3, start=2) == [(7, 8, 9)]  # only those ending at index >= 4
    assert ngrams([1, 2], 3) == []


def test_pool_holds_every_ngram_of_the_prompt_and_the_output():
    """Without window outputs, the pool is exactly the sequence's n-grams, across several accepts."""
    drafter = LookaheadDrafter(ngram=3, pool_size=100)
    drafter.start(torch.tensor([1, 2, 3, 4]), {}, 5)
    for tokens, root in [([5, 6, 7], 8), ([8], 9), ([9, 10], 11)]:
        drafter.accept(torch.tensor(tokens), {}, root)
    sequence = list(range(1, 12))
    assert drafter.tokens == sequence
    held = {(key, *cont) for key, conts in drafter.pool.items() for cont in conts}
    assert held == set(ngrams(sequence, 3))


def test_window_branch_is_the_lookahead_mask_with_depth_positions():
    """Cell (l, c) sees the root, level-0 cells of columns <= c and its own column below level l, and
    sits at offset c + l + 1: the paper's lookahead mask, expressed as a tree."""
    window = [[10, 11, 12], [20, 21, 22], [30, 31, 32]]  # [levels=3][window=3]
    offset = 4  # e.g. three candidate nodes before it
    tokens, parents, at = window_nodes(window, offset)
    full_parents = torch.tensor([-1, 0, 1, 2, *parents])  # root + a 3-node candidate chain + the window
    anc = ancestor_mask(full_parents)  # [N, N]: row i = i's ancestors and itself
    depth = depths(full_parents)
    for level in range(3):
        for c in range(3):
            node = at[level][c]
            assert tokens[node - offset] == window[level][c]
            want = {0, *(at[0][: c + 1]), *(at[j][c] for j in range(level + 1))}
            assert set(anc[node].nonzero().flatten().tolist()) == want, (level, c)
            assert int(depth[node]) == c + level + 1


def test_jacobi_update_keeps_each_cell_at_its_offset():
    window = [[10, 11, 12], [20, 21, 22]]
    top = [30, 31, 32]  # target argmax at the top level
    assert jacobi_update(window, top, shift=1, fill=[99]) == [[20, 21, 22], [30, 31, 32]]
    # root moved 3 on: new (l, c) = old (l + 1, c + 2); two columns fall off and are refilled
    assert jacobi_update(window, top, shift=3, fill=[7, 8]) == [[22, 7, 8], [32, 7, 8]]
    assert jacobi_update(window, [30, None, 32], shift=1, fill=[5]) == [[20, 21, 22], [30, 5, 32]]


def test_candidate_trie_merges_shared_prefixes():
    tokens, parents = candidate_trie([(5, 6, 7), (5, 6, 8), (9, 1, 2)], offset=1)
    assert tokens == [5, 6, 7, 8, 9, 1, 2]
    assert parents == [0, 1, 2, 2, 0, 5, 6]
    assert candidate_trie([], offset=1) == ([], [])


def test_bad_options():
    for kwargs in [{"window": 0}, {"ngram": 1}, {"candidates": -1}, {"pool_size": 0}]:
        with pytest.raises(ValueError, match="lookahead needs"):
            LookaheadDrafter(**kwargs)


# ---- the drafter on a real target -------------------------------------------------------------------


def test_proposal_and_jacobi_outputs_from_the_target(setup):
    """Candidates come from the pool under the root; the top-level outputs `verified` keeps are the
    target's argmax on each top cell's own path run as a plain sequence."""
    model, _ = setup
    prompt = [7, 9, 7, 9, 7, 12, 13]
    drafter = LookaheadDrafter(window=3, ngram=3, candidates=2)
    drafter.start(torch.tensor(prompt[:-1]), {}, prompt[-1])
    draft = drafter.propose(9, SamplingParams(), None)  # root 9: the prompt has 9 7 9 and 9 7 12
    tree = draft.tree
    assert draft.rule == "deterministic" and tree.size <= drafter.max_nodes
    assert tree.tokens[1:4].tolist() == [7, 12, 9]  # newest first: (7, 12) then (7, 9), sharing the 7
    assert tree.parents[1:4].tolist() == [0, 1, 1]
    with torch.no_grad():  # logits [N, V], row i from the path to node i as a plain sequence
        logits = torch.stack([
            model(torch.tensor([prompt + tree.tokens[path_to_node(tree.parents, i)].tolist()])).logits[0, -1]
            for i in range(tree.size)
        ])  # fmt: skip
    drafter.verified(tree, logits)
    top_nodes = drafter._at[-1]
    assert drafter._top == logits[top_nodes].argmax(-1).tolist()
    for c, out in enumerate(drafter._top):  # each column's n-gram (its cells, then its output) is pooled
        assert (drafter.grid[1][c], out) in drafter.pool[drafter.grid[0][c]]
    old, top = [list(row) for row in drafter.grid], list(drafter._top)
    drafter.accept(torch.tensor([9, 7, 12]), {}, 40)  # root + 2 drafts: the new root is 3 tokens on
    assert drafter.grid[0][0] == old[1][2] and drafter.grid[1][0] == top[2]


def test_greedy_equals_plain_decoding(setup):
    model, tok = setup
    taus = {name: [] for name in OPTIONS}
    for i, prompt in enumerate(prompts(20, model.config.vocab_size)):
        n = 12 + i % 7
        reference = plain_greedy(model, prompt, n)
        for name, options in OPTIONS.items():
            gen = SpeculativeGenerator(model, tok, LookaheadDrafter(**options))
            gen.eos = set()
            result = gen.generate(input_ids=prompt, max_new_tokens=n)
            assert result.token_ids == reference, f"{name} on prompt {i}"
            taus[name].append(result.stats.tau)
    mean = {name: sum(v) / len(v) for name, v in taus.items()}
    assert mean["default"] > 1.1, mean  # the pool's n-grams are accepted


class NoJacobi(LookaheadDrafter):
    """Lookahead without its Jacobi branch's outputs (the window never moves, no window n-grams)."""

    def verified(self, tree, logits):
        pass


def test_jacobi_trajectories_feed_the_pool(setup):
    """The window's n-grams add accepted tokens beyond the prompt's and the output's own n-grams; this
    needs the engine to call `verified` with the whole tree's outputs."""
    model, tok = setup
    totals = {}
    for cls in (LookaheadDrafter, NoJacobi):
        gen = SpeculativeGenerator(model, tok, cls())
        gen.eos = set()
        totals[cls] = sum(
            gen.generate(input_ids=p, max_new_tokens=24).stats.accepted_tokens
            for p in prompts(20, model.config.vocab_size)
        )
    assert totals[LookaheadDrafter] > 1.2 * totals[NoJacobi], totals


def test_a_verified_hook_given_to_an_instance_is_called_too(setup):
    """The loop calls `verified` only for drafters that read it: a class's override or, as here, a hook
    set on the instance (which a check of the class alone would miss), once a pass before `accept`."""
    model, tok = setup
    drafter, heard = PromptLookupDrafter(), []  # (its class has no `verified`)
    drafter.verified = lambda tree, logits: heard.append((tree.size, tuple(logits.shape)))
    gen = SpeculativeGenerator(model, tok, drafter)
    gen.eos = set()
    result = gen.generate(input_ids=prompts(1, model.config.vocab_size)[0], max_new_tokens=24)
    passes = result.stats.target_passes
    assert len(heard) == passes - 1, (len(heard), passes)  # every pass but the last (decoding stopped)
    assert all(shape == (n, model.config.vocab_size) for n, shape in heard)
    assert RowLoopDrafter(drafter)._hears and RowLoopDrafter(LookaheadDrafter())._hears  # (its class's hook)
    assert not RowLoopDrafter(PromptLookupDrafter())._hears  # no hook: no [N, V] views, no calls


def test_greedy_stops_at_eos_and_max_new_tokens_inside_a_draft(setup):
    model, tok = setup
    inside = {"eos": 0, "max_new_tokens": 0}
    for i, prompt in enumerate(prompts(20, model.config.vocab_size)):
        reference = plain_greedy(model, prompt, 32)
        eos = reference[8 + i % 12]  # pretend this token is EOS: generation must stop at its first use
        stop = reference.index(eos)
        gen = SpeculativeGenerator(model, tok, LookaheadDrafter())
        gen.eos = {eos}
        result = gen.generate(input_ids=prompt, max_new_tokens=32)
        assert result.token_ids == reference[: stop + 1], i
        inside["eos"] += result.stats.accept_lengths[-1] > 1  # EOS emitted with accepted drafts
        gen.eos = set()
        n = 10 + i % 9
        result = gen.generate(input_ids=prompt, max_new_tokens=n)
        assert result.token_ids == reference[:n], i
        inside["max_new_tokens"] += result.stats.accept_lengths[-1] > 1
    assert min(inside.values()) >= 2, inside  # both stops really happened inside accepted drafts


def test_tree_cut_near_a_fixed_cache_end_is_lossless(setup):
    """A static cache with no scratch left: the engine keeps the tree's first nodes, and `verified`
    gets the cut tree (window cells past the cut have no output)."""
    model, tok = setup
    for prompt in prompts(4, model.config.vocab_size):
        n = 20
        gen = SpeculativeGenerator(
            model, tok, LookaheadDrafter(), cache="static", max_cache_len=len(prompt) + n
        )
        gen.eos = set()
        assert gen.generate(input_ids=prompt, max_new_tokens=n).token_ids == plain_greedy(model, prompt, n)


# ---- sampling: rule A -----------------------------------------------------------------------------


def likely_ngrams(model, prompt: list[int], params: SamplingParams) -> list[tuple[int, int, int]]:
    """3-grams the target often samples after `prompt`: each of its top tokens x, then x's two top
    children y (the second one first, so rank 0 is tried first) and y's top child."""
    out = []
    with torch.no_grad():
        first = target_probs(model(torch.tensor([prompt])).logits[0, -1], params).topk(3).indices.tolist()
        for x in first:
            ys = model(torch.tensor([[*prompt, x]])).logits[0, -1].topk(2).indices.tolist()
            for y in reversed(ys):
                z = int(model(torch.tensor([[*prompt, x, y]])).logits[0, -1].argmax())
                out.append((x, y, z))
    return out


class Hinted(LookaheadDrafter):
    """Lookahead whose pool also starts with n-grams the target is likely to produce (fixed before
    decoding: still deterministic children, so rule A applies), so acceptance really runs."""

    def __init__(self, hints: list[tuple[int, ...]], **options):
        super().__init__(**options)
        self.hints = hints

    def start(self, prompt, hidden, root):
        super().start(prompt, hidden, root)
        for gram in self.hints:
            pool_add(self.pool, gram, self.pool_size)


class HintedClaimingIid(Hinted):
    """A deliberately WRONG variant: the deterministic n-grams verified with rule B as if drawn from a
    uniform q (min(1, p/q) accepts nearly any candidate the target can produce)."""

    def __init__(self, vocab: int, hints: list[tuple[int, ...]], **options):
        super().__init__(hints, **options)
        self.vocab = vocab

    def propose(self, root, sampling, generator):
        tree = super().propose(root, sampling, generator).tree
        return Draft(tree, rule="iid", q=torch.full((tree.size, self.vocab), 1.0 / self.vocab))


def test_sampling_matches_the_target_distribution(setup):
    model, tok = setup
    hints = likely_ngrams(model, PROMPT, PARAMS)
    gen = SpeculativeGenerator(model, tok, Hinted(hints, window=3, ngram=3, candidates=3))
    tv = sampling_tv(gen, PROMPT, PARAMS, trials=1500)
    # 9 outcomes, 1500 samples: sampling noise gives TV around 0.03; a biased rule is far above.
    assert tv < 0.07, f"TV {tv:.3f}"
    accepted = sum(
        gen.generate(
            input_ids=PROMPT, max_new_tokens=4, temperature=1.3, top_k=3, seed=s
        ).stats.accepted_tokens
        for s in range(100)
    )
    assert accepted > 30, accepted  # the check above really exercised accepted drafts


def test_a_wrong_rule_fails_the_distribution_check(setup):
    model, tok = setup
    hints = likely_ngrams(model, PROMPT, PARAMS)
    drafter = HintedClaimingIid(model.config.vocab_size, hints, window=3, ngram=3, candidates=3)
    tv = sampling_tv(SpeculativeGenerator(model, tok, drafter), PROMPT, PARAMS, trials=1500)
    assert tv > 0.1, f"the wrong rule went unnoticed (TV {tv:.3f})"


# ---- batch and specs ------------------------------------------------------------------------------


def test_batch_rows_equal_their_batch1_runs(setup):
    """generate_batch clones the drafter per row (its own pool and window): greedy rows equal batch-1 and
    HF, with the same passes; sampled rows equal their batch-1 draws."""
    model, tok = setup
    rows = prompts(4, model.config.vocab_size)
    max_new = [14, 9, 20, 5]
    gen = SpeculativeGenerator(model, tok, LookaheadDrafter(), cache="static")
    gen.eos = set()
    batch = gen.generate_batch(input_ids=rows, max_new_tokens=max_new)
    for b, (prompt, n) in enumerate(zip(rows, max_new)):
        single = gen.generate(input_ids=prompt, max_new_tokens=n)
        assert batch[b].token_ids == single.token_ids == plain_greedy(model, prompt, n), b
        assert batch[b].stats.accept_lengths == single.stats.accept_lengths, b
    sampled = gen.generate_batch(input_ids=rows, max_new_tokens=12, temperature=1.0, seed=[0, 1, 2, 3])
    for b, prompt in enumerate(rows):
        single = gen.generate(input_ids=prompt, max_new_tokens=12, temperature=1.0, seed=b)
        assert sampled[b].token_ids == single.token_ids, b


def test_options_reach_the_drafter_from_a_spec(tiny_target_dir):
    path, options = drafter_options("lookahead@window=3,ngram=5,candidates=2")
    assert (path, options) == ("lookahead", {"window": 3, "ngram": 5, "candidates": 2})
    gen = SpeculativeGenerator.from_pretrained(str(tiny_target_dir), path, **options)
    drafter = gen.drafter
    assert isinstance(drafter, LookaheadDrafter)
    assert (drafter.window, drafter.ngram, drafter.candidates) == (3, 5, 2)
    assert drafter.max_nodes == 1 + (3 + 2) * 4
    plain = SpeculativeGenerator(gen.target, gen.tokenizer, None)
    assert (
        gen.generate("hello", max_new_tokens=8).token_ids
        == plain.generate("hello", max_new_tokens=8).token_ids
    )
    with pytest.raises(ValueError, match="unknown option.*valid: window, ngram, candidates"):
        SpeculativeGenerator.from_pretrained(str(tiny_target_dir), "lookahead", windw=3)
