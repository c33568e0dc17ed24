"""Cascade drafting (tiny -> medium -> target): greedy output equals plain decoding, both levels'
caches follow what was accepted, and sampled output follows the target's exact distribution only
with the chain's rule (the medium's verified tokens with the medium's own q); wrong variants fail."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from spechead.inference.drafter_specs import cascade_models, drafter_options
from spechead.inference.drafters.base import Draft, chain
from spechead.inference.drafters.cascade import CascadeDrafter
from spechead.inference.drafters.per_row import clone_drafter
from spechead.inference.generator import SpeculativeGenerator
from spechead.inference.sampling import SamplingParams, target_probs

from ..distributions import sampling_tv
from .test_draft_model_tree import (
    PARAMS,
    PROMPT,
    perturbed,
    plain_greedy,
    prompts,
    sharpened,
)


@pytest.fixture(scope="module")
def setup(tiny_llama, chatml_tokenizer):
    """A target, a medium close to it and a tiny further away (greedy: ranks differ at some steps)."""
    model = tiny_llama(len(chatml_tokenizer), layers=2, hidden=32, seed=3)
    model.generation_config.eos_token_id = None
    model.config.eos_token_id = None
    return model, chatml_tokenizer, perturbed(model, 0.003), perturbed(model, 0.02)


class Counted(CascadeDrafter):
    """A cascade that counts the medium's passes and the tokens they give (its accepted tiny drafts + its
    own next token each): more tokens than passes means the medium accepts the tiny's drafts."""

    passes = tokens = 0

    def _inner_step(self, seq, sampling, generator):
        tokens, rows = super()._inner_step(seq, sampling, generator)
        self.passes, self.tokens = self.passes + 1, self.tokens + len(tokens)
        return tokens, rows


def cascade(tiny, medium, **options) -> Counted:
    return Counted(tiny, medium, **options)


# ---- greedy: exactly plain decoding ---------------------------------------------------------------


def test_greedy_equals_plain_decoding(setup):
    model, tok, medium, tiny = setup
    taus = []
    for i, prompt in enumerate(prompts(20, model.config.vocab_size)):
        n = 12 + i % 7
        reference = plain_greedy(model, prompt, n)
        for options in ({"num_draft": 5, "tiny_draft": 2}, {"num_draft": 3, "tiny_draft": 4}):
            gen = SpeculativeGenerator(model, tok, cascade(tiny, medium, **options))
            gen.eos = set()
            result = gen.generate(input_ids=prompt, max_new_tokens=n)
            assert result.token_ids == reference, f"prompt {i}, {options}"
            taus.append(result.stats.tau)
    assert sum(taus) / len(taus) > 1.5, "too few drafts accepted for the check to mean much"


def test_caches_follow_the_accepted_tokens_and_stops_inside_a_draft(setup):
    """The medium = the target: every chain is accepted whole (a stale or mis-cropped medium cache would
    break that); the tiny = the medium too: every tiny draft is accepted by the medium (the same for
    the tiny's cache); EOS / max_new_tokens land inside drafts."""
    model, tok, _, tiny = setup
    for i, prompt in enumerate(prompts(6, model.config.vocab_size)):
        reference = plain_greedy(model, prompt, 24)
        same = cascade(model, model, num_draft=4, tiny_draft=2)
        gen = SpeculativeGenerator(model, tok, same)
        gen.eos = set()
        full = gen.generate(input_ids=prompt, max_new_tokens=24)
        assert full.token_ids == reference
        assert same.tokens == 3 * same.passes  # 2 drafts accepted + the medium's next token
        gen = SpeculativeGenerator(model, tok, cascade(tiny, model, num_draft=4, tiny_draft=3))
        gen.eos = set()
        full = gen.generate(input_ids=prompt, max_new_tokens=24)
        assert full.token_ids == reference
        assert all(a == 5 for a in full.stats.accept_lengths[:-1]), full.stats.accept_lengths
        eos = reference[3 + i % 4]  # pretend this token is EOS: generation must stop at its first use
        gen.eos = {eos}
        assert (
            gen.generate(input_ids=prompt, max_new_tokens=24).token_ids
            == reference[: reference.index(eos) + 1]
        )
        gen.eos = set()
        for n in (1, 2, 3, 6):
            assert gen.generate(input_ids=prompt, max_new_tokens=n).token_ids == reference[:n], n


def test_the_chain_stops_at_the_medium_eos(setup):
    model, tok, medium, tiny = setup
    prompt = prompts(1, model.config.vocab_size)[0]
    reference = plain_greedy(model, prompt, 12)
    drafter = cascade(tiny, model, num_draft=8, tiny_draft=2)
    drafter.eos = {reference[2]}  # the medium's own EOS: nothing after it is drafted
    gen = SpeculativeGenerator(model, tok, drafter)
    gen.eos = {reference[2]}
    drafter.start(torch.tensor(prompt), {}, reference[0])
    draft = drafter.propose(reference[0], SamplingParams(), None)
    assert draft.tree.tokens.tolist() == reference[: reference.index(reference[2]) + 1]
    assert (
        gen.generate(input_ids=prompt, max_new_tokens=12).token_ids
        == reference[: reference.index(reference[2]) + 1]
    )


def test_bad_options(setup):
    model, _, medium, tiny = setup
    for kwargs, needle in [({"num_draft": 0}, "num_draft"), ({"tiny_draft": "4"}, "tiny_draft")]:
        with pytest.raises(ValueError, match=needle):
            cascade(tiny, medium, **kwargs)
    other = perturbed(model)
    other.resize_token_embeddings(model.config.vocab_size + 8)
    with pytest.raises(ValueError, match="tiny model has a vocabulary"):
        cascade(tiny, other)
    with pytest.raises(ValueError, match="cascade:TINY\\+MEDIUM"):
        cascade(other, other).check_target(32, model.config.vocab_size, 2)
    for spec in ("cascade:", "cascade:a", "cascade:a+", "cascade:a+b+c"):
        with pytest.raises(ValueError, match="TINY\\+MEDIUM"):
            cascade_models(spec)
    assert cascade_models("cascade:x/tiny+y/medium") == ("x/tiny", "y/medium")


def test_spec_from_the_cli_and_from_pretrained(tiny_target_dir):
    """`--drafter NAME=cascade:TINY+MEDIUM@num_draft=..,tiny_draft=..` (benchmark) and from_pretrained."""
    path, options = drafter_options(f"cascade:{tiny_target_dir}+{tiny_target_dir}@num_draft=3,tiny_draft=2")
    assert options == {"num_draft": 3, "tiny_draft": 2}
    gen = SpeculativeGenerator.from_pretrained(str(tiny_target_dir), path, **options)
    assert isinstance(gen.drafter, CascadeDrafter) and gen.drafter.num_draft == 3
    plain = SpeculativeGenerator(gen.target, gen.tokenizer, None)
    assert (
        gen.generate("hello", max_new_tokens=9).token_ids
        == plain.generate("hello", max_new_tokens=9).token_ids
    )
    with pytest.raises(ValueError, match="unknown option.*valid: num_draft, tiny_draft"):
        SpeculativeGenerator.from_pretrained(str(tiny_target_dir), path, width=2)


def test_demo_cascade_is_the_default_pair():
    """Plain `cascade` = the shipped demo draft (tiny) and medium models, for the demo target."""
    tiny, medium = cascade_models("cascade")
    assert Path(tiny).name == "draft" and Path(medium).name == "medium"
    gen = SpeculativeGenerator.from_pretrained(str(Path(tiny).parent / "target"), "cascade", num_draft=6)
    plain = SpeculativeGenerator(gen.target, gen.tokenizer, None)
    messages = [{"role": "user", "content": "What is 12 plus 30?"}]
    out = gen.generate(messages=messages, max_new_tokens=24)
    assert out.token_ids == plain.generate(messages=messages, max_new_tokens=24).token_ids
    assert out.stats.tau > 1.5, out.stats.tau


def test_batch_rows_equal_single_rows(setup):
    """generate_batch clones the drafter per row (sharing both models' weights); each row = batch 1."""
    model, tok, medium, tiny = setup
    drafter = cascade(tiny, medium, num_draft=4, tiny_draft=2)
    clone = clone_drafter(drafter)
    assert clone.medium is medium and clone.tiny.model is tiny and clone.tiny is not drafter.tiny
    gen = SpeculativeGenerator(model, tok, drafter, cache="static")
    gen.eos = set()
    rows = prompts(4, model.config.vocab_size)
    batch = gen.generate_batch(input_ids=rows, max_new_tokens=[10, 14, 7, 12])
    for b, prompt in enumerate(rows):
        assert batch[b].token_ids == plain_greedy(model, prompt, [10, 14, 7, 12][b]), b
    sampled = gen.generate_batch(input_ids=rows[:2], max_new_tokens=10, temperature=1.0, top_k=3, seed=[4, 5])
    for b in range(2):
        single = gen.generate(input_ids=rows[b], max_new_tokens=10, temperature=1.0, top_k=3, seed=4 + b)
        assert sampled[b].token_ids == single.token_ids, b


# ---- sampling: exactly the target's distribution ---------------------------------------------------


@pytest.fixture(scope="module")
def levels(setup):
    """Target p ~ .41/.34/.25 at PROMPT (top-3), medium flatter, tiny sharp (~.79/.19/.02): one
    ranking, three different distributions on the same support: every level rejects now and then."""
    model, tok, _, _ = setup
    return sharpened(model, 20.0), tok, sharpened(model, 5.0), sharpened(model, 150.0)


def run_along(model, context: list[int], tokens: list[int]) -> torch.Tensor:
    """The model's sampling distributions [len(tokens) + 1, V] at each node of context[-1] -> tokens."""
    with torch.no_grad():
        logits = model(torch.tensor([context + tokens])).logits[0, len(context) - 1 :]
    return target_probs(logits, PARAMS)


class TinyQ(CascadeDrafter):
    """WRONG: the medium's verified chain, but the target is told it was drawn from the TINY's q."""

    def propose(self, root, sampling, generator):
        right = super().propose(root, sampling, generator)
        q = run_along(self.tiny.model, [*self.context, root], right.tree.tokens[1:].tolist())
        return Draft(right.tree, rule="iid", q=q)


class UnverifiedProposal(CascadeDrafter):
    """WRONG: the tiny's chain BEFORE the medium verified it, handed over with the medium's q."""

    def propose(self, root, sampling, generator):
        tokens = self.tiny.propose(root, sampling, generator).tree.tokens[1:].tolist()
        q = run_along(self.medium, [*self.context, root], tokens)
        return Draft(chain(tokens, root), rule="iid", q=q)


@pytest.mark.parametrize(
    ("variant", "num_draft", "tiny_draft"),
    [(Counted, 2, 1), (Counted, 3, 2), (TinyQ, 2, 1), (UnverifiedProposal, 2, 2)],
)
def test_sampling_matches_the_target_distribution(levels, variant, num_draft, tiny_draft):
    """27 outcomes (three tokens, top-3): sampling noise is about TV 0.04 at 1500 samples; the wrong
    variants land far above (TV 0.44 and 0.53 at 500 samples, noise there about 0.07: 500 are enough)."""
    target, tok, medium, tiny = levels
    drafter = variant(tiny, medium, num_draft=num_draft, tiny_draft=tiny_draft)
    gen = SpeculativeGenerator(target, tok, drafter)
    tv = sampling_tv(gen, PROMPT, PARAMS, trials=1500 if variant is Counted else 500, length=3)
    if variant is Counted:
        # (its counts: sampling_tv's seeds decoded alone, ~190 medium passes; batch rows count in clones)
        assert drafter.tokens > 1.2 * drafter.passes, "the medium rarely accepted the tiny"
        runs = [
            gen.generate(input_ids=PROMPT, max_new_tokens=8, temperature=1.0, top_k=3, seed=s)
            for s in range(20)
        ]
        assert sum(r.stats.target_passes for r in runs) < 0.8 * sum(r.stats.new_tokens - 1 for r in runs)
        assert tv < 0.08, f"TV {tv:.3f}"
    else:
        assert tv > 0.12, f"{variant.__name__}: the wrong variant went unnoticed (TV {tv:.3f})"
