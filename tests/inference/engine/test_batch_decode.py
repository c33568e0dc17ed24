"""engine/loop.py and engine/accept.py: each row of a batch decodes from its own data (its tree's size, its sampling
transform, its accepted tokens when other rows leave), as that row alone would."""

from __future__ import annotations

import pytest
import torch

from spechead.inference.drafters.base import BatchDraft
from spechead.inference.drafters.medusa import MedusaDrafter
from spechead.inference.drafters.per_row import RowLoopDrafter
from spechead.inference.generator import SpeculativeGenerator
from spechead.inference.sampling import SamplingParams

from ..drafters.test_batch_drafters import fitted_medusa, model  # noqa: F401  (model: the fixture fitted_medusa fits)
from ..test_batch import PROMPTS


def test_sampled_rows_of_mixed_tree_sizes_each_read_their_own_nodes():
    """Rows that sample, accepted row by row on the host, with trees of different sizes (row 0's the
    smallest): each row's acceptance reads its own N_b nodes' logits and draws from its own generator,
    exactly batch-1 `sample_accept` of that row's tree (a row read with another row's size fails)."""
    from spechead.inference.acceptance import sample_accept
    from spechead.inference.engine.accept import accept_rows
    from spechead.inference.engine.rows import Row
    from spechead.inference.tree import TokenTree, ancestors_on_device

    g = torch.Generator().manual_seed(1)
    batch, n, vocab = 3, 6, 8
    sizes = [2, 6, 4]
    parents = torch.tensor([[-1, 0, 0, 1, 1, 2]]).repeat(batch, 1)
    tokens = torch.randint(0, vocab, (batch, n), generator=g)
    for b, size in enumerate(sizes):  # padding: copies of the root hanging from it
        tokens[b, size:], parents[b, size:] = tokens[b, 0], 0
    logits = torch.randn(batch, n, vocab, generator=g)
    logits.scatter_add_(2, tokens[..., None].roll(-1, 1), torch.full((batch, n, 1), 3.0))  # drafts likely
    draft = BatchDraft(tokens, parents, sizes)
    params = [SamplingParams(temperature=0.9, seed=s) for s in (3, 4, 5)]
    for seed in range(5):
        rows = [Row(b, torch.tensor([1]), 9, p, torch.Generator().manual_seed(seed * 10 + b), None)
                for b, p in enumerate(params)]  # fmt: skip
        accs = accept_rows(draft, logits, ancestors_on_device(parents), rows, on_device=False)
        for b, size in enumerate(sizes):
            tree = TokenTree(tokens[b, :size], parents[b, :size])
            probs = torch.softmax(logits[b, :size] / 0.9, dim=-1)
            single = sample_accept(
                tree, probs, "deterministic", None, torch.Generator().manual_seed(seed * 10 + b)
            )
            assert accs[b].path == single.path and accs[b].next_token == single.next_token, (seed, b)


def test_rows_of_different_temperatures_each_get_their_own_probs(monkeypatch):
    """The batched target probs `accept_queued` hands rule A for rows that sample with different
    transforms (temperature, top-k): each row's are its own `torch_probs`, not the first row's transform
    applied to every row."""
    from spechead.inference.engine.accept import accept_queued
    from spechead.inference.engine.rows import Row
    from spechead.inference.queued_acceptance import QueuedAcceptance
    from spechead.inference.sampling import torch_probs
    from spechead.inference.tree import ancestors_on_device

    def probs_of(params: list[SamplingParams]) -> torch.Tensor:
        seen: list[torch.Tensor] = []
        monkeypatch.setattr(QueuedAcceptance, "sampled", lambda *args: seen.append(args[3]))
        rows = [Row(b, torch.tensor([1]), 4, p, None, None) for b, p in enumerate(params)]  # type: ignore[arg-type]
        accept_queued(draft, logits, ancestors_on_device(parents), rows, 0)
        return seen[0]

    logits = torch.randn(3, 4, 16, generator=torch.Generator().manual_seed(2))
    parents = torch.tensor([[-1, 0, 0, 1]]).repeat(3, 1)
    draft = BatchDraft(torch.ones(3, 4, dtype=torch.long), parents, [4, 4, 4])
    params = [SamplingParams(temperature=0.5), SamplingParams(temperature=1.5, top_k=4), SamplingParams()]
    every = probs_of(params)
    for b, p in enumerate(params):
        torch.testing.assert_close(every[b], torch_probs(logits[b], p))
    shared = probs_of([SamplingParams(temperature=0.7, seed=s) for s in range(3)])  # seeds aside
    torch.testing.assert_close(shared, torch_probs(logits, SamplingParams(temperature=0.7)))


@pytest.mark.parametrize("kind", ["medusa_fitted", "prompt_lookup"])
def test_rows_leaving_the_batch_hand_the_drafter_their_own_accepted_tokens(
    model,  # noqa: F811  (the fixture)
    chatml_tokenizer,
    monkeypatch,
    kind,
):
    """Rows stop at different passes, a middle one first, while the others go on (accepting paths of
    different lengths): every accept the batch drafter hears gives row b ITS accepted tokens and length (root
    first), so that each row's accepted blocks, joined, are its output; a reindexing that keeps the
    first B' rows' tokens or lengths instead fails."""
    from spechead.inference.drafters.prompt_lookup import PromptLookupDrafter

    if kind == "prompt_lookup":  # per-row clones (the default batch drafter); K varies by row
        drafter, cls = PromptLookupDrafter(num_draft=3, max_ngram=1), RowLoopDrafter
    else:
        drafter, cls = fitted_medusa(model, PROMPTS), MedusaDrafter
    gen = SpeculativeGenerator(model, chatml_tokenizer, drafter, cache="static")
    gen.eos = set()
    heard: dict[int, list[int]] = {b: [] for b in range(len(PROMPTS))}
    order = list(range(len(PROMPTS)))  # the batch's rows as indices into PROMPTS
    accept, keep = cls.accept_paths, cls.keep

    def spy_keep(self, rows):
        order[:] = [order[i] for i in rows]
        keep(self, rows)

    def spy_accept(self, tokens, hidden, paths, next_roots):
        assert len(paths) == len(order) == len(tokens)
        assert all(v.shape[0] == len(order) for v in hidden.values())
        for b, (row, path) in enumerate(zip(tokens, paths)):
            assert len(row) == len(path)
            heard[order[b]].extend(row)
        accept(self, tokens, hidden, paths, next_roots)

    monkeypatch.setattr(cls, "accept_paths", spy_accept)
    monkeypatch.setattr(cls, "keep", spy_keep)
    max_new = [9, 20, 6, 16]  # rows leave at different passes, a middle one first
    batch = gen.generate_batch(input_ids=PROMPTS, max_new_tokens=max_new)
    assert len(order) < len(PROMPTS)  # rows left
    for b in range(len(PROMPTS)):
        out = batch[b].token_ids
        assert heard[b] == out[: len(heard[b])], (kind, b)
        assert heard[b], (kind, b)
    assert any(len(heard[b]) > len(batch[b].stats.accept_lengths) for b in range(1, 4))  # paths of K > 1
