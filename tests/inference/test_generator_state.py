"""What generate() tells drafters and reports: the drafter's committed state follows the ACCEPTED tree
rows, `accept_lengths` counts exactly the tokens each pass emitted, and a fully accepted path emits its
bonus token under sampling too."""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache

from spechead.heads import Eagle3Config, Eagle3Head, EagleConfig, EagleHead
from spechead.inference.drafters.base import BatchDraft, Draft, chain
from spechead.inference.drafters.eagle import EagleDrafter
from spechead.inference.drafters.per_row import RowDrafter
from spechead.inference.generator import SpeculativeGenerator
from spechead.inference.sampling import SamplingParams, sample, target_probs
from spechead.inference.target.runner import TargetRunner
from spechead.inference.tree import TokenTree


@pytest.fixture(scope="module")
def setup(tiny_llama, chatml_tokenizer):
    model = tiny_llama(len(chatml_tokenizer), layers=2, hidden=32, seed=3)
    model.generation_config.eos_token_id = None
    return model, chatml_tokenizer


def hf_greedy(model, prompt: list[int], n: int) -> list[int]:
    """Hugging Face greedy decoding (no EOS): the target's own continuation."""
    out = model.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False, pad_token_id=0)
    return out[0, len(prompt) :].tolist()


def split_lengths(emitted: int, full: int) -> list[int]:
    """accept_lengths of passes that each emit `full` tokens, the last cut short: `emitted` in all."""
    return [full] * (emitted // full) + ([emitted % full] if emitted % full else [])


class ReferenceChain(RowDrafter):
    """Drafts the next `depth` tokens of a known continuation (the target's own greedy tokens)."""

    def __init__(self, reference: list[int], depth: int):
        self.reference, self.depth, self.done = reference, depth, 0

    def start(self, prompt, hidden, root):
        self.done = 1  # reference tokens emitted so far (the root included)

    def propose(self, root, sampling, generator):
        return Draft(chain(self.reference[self.done : self.done + self.depth], root))

    def accept(self, tokens, hidden, next_root):
        self.done += len(tokens)


def test_accept_lengths_are_exact(setup):
    """A drafter that drafts the target's own tokens: every pass emits depth + 1 tokens but the last,
    which max_new_tokens or EOS cuts short; the lengths add up to the tokens emitted after the prefill."""
    model, tok = setup
    prompt = [11, 42, 7, 99, 5]
    reference = hf_greedy(model, prompt, 40)
    depth = 4
    for n in (1, 2, 5, 6, 13, 16, 21, 24):
        gen = SpeculativeGenerator(model, tok, ReferenceChain(reference, depth))
        gen.eos = set()
        stats = gen.generate(input_ids=prompt, max_new_tokens=n).stats
        assert stats.accept_lengths == split_lengths(n - 1, depth + 1), f"max_new_tokens={n}"
        assert stats.new_tokens == n and stats.accepted_tokens == n - 1 - len(stats.accept_lengths)
    for stop in (3, 10, 11, 17):  # EOS inside a drafted path (or as the bonus) ends the last pass early
        gen = SpeculativeGenerator(model, tok, ReferenceChain(reference, depth))
        gen.eos = {reference[stop]}
        first = reference.index(reference[stop])  # generation stops at the first use of that token
        result = gen.generate(input_ids=prompt, max_new_tokens=40)
        assert result.token_ids == reference[: first + 1]
        assert result.stats.accept_lengths == split_lengths(first, depth + 1), f"EOS at {first}"


def test_plain_decoding_counts_one_pass_per_token(setup):
    """No drafter: every token after the prefill's costs one target pass, so tau is exactly 1 and the
    benchmark's time per plain step (verify time / passes) is a real step time."""
    model, tok = setup
    gen = SpeculativeGenerator(model, tok, None)
    gen.eos = set()
    for n in (1, 2, 9):
        stats = gen.generate(input_ids=[11, 42, 7], max_new_tokens=n).stats
        assert stats.accept_lengths == [1] * (n - 1) and stats.target_passes == n - 1, f"max_new_tokens={n}"
        assert stats.drafted_tokens == 0 and (n == 1 or stats.tau == 1.0)


class SelfSampler(RowDrafter):
    """Samples a chain from the target's own distribution (q = p up to rounding, so rule B accepts
    every draft) by re-running the target on the whole committed sequence."""

    def __init__(self, model, depth: int):
        self.model, self.depth, self.seq = model, depth, []

    def start(self, prompt, hidden, root):
        self.seq = [*prompt.tolist(), root]

    @torch.no_grad()
    def propose(self, root, sampling, generator):
        drafted, rows = [], []
        for _ in range(self.depth):
            logits = self.model(torch.tensor([self.seq + drafted])).logits[0, -1]  # [V]
            rows.append(target_probs(logits, sampling))
            drafted.append(sample(rows[-1], generator))
        q = torch.stack(rows + [rows[-1]])  # [N, V]: row i = distribution node i's child came from
        return Draft(chain(drafted, root), rule="iid", q=q)

    def accept(self, tokens, hidden, next_root):
        self.seq += [*tokens[1:].tolist(), next_root]


@pytest.mark.parametrize("params", [SamplingParams(1.0, seed=0), SamplingParams(0.7, top_k=1, seed=0)])
def test_fully_accepted_path_emits_the_bonus_when_sampling(setup, params):
    """Every path is accepted whole: each pass must emit len(path) + 1 tokens (the bonus from p at the
    leaf), under sampling as under greedy decoding."""
    model, tok = setup
    prompt, depth, n = [3, 14, 15, 92, 65], 3, 18
    for seed in range(3):
        gen = SpeculativeGenerator(model, tok, SelfSampler(model, depth))
        gen.eos = set()
        result = gen.generate(
            input_ids=prompt, max_new_tokens=n, temperature=params.temperature, top_k=params.top_k, seed=seed
        )
        assert len(result.token_ids) == n
        assert result.stats.accept_lengths == split_lengths(n - 1, depth + 1), f"seed {seed}"
        if params.top_k == 1:  # p is one-hot at the argmax: sampling must reproduce greedy decoding
            assert result.token_ids == hf_greedy(model, prompt, n)


def eagle_head(model, family: str):
    torch.manual_seed(0)
    if family == "eagle":
        head = EagleHead(EagleConfig.from_target(model.config))
    else:
        head = Eagle3Head(Eagle3Config.from_target(model.config, target_layers=[1, 2, 2]))
    head.attach_target_modules(
        lm_head=model.get_output_embeddings(), embed_tokens=model.get_input_embeddings()
    )
    return head.eval().requires_grad_(False)


class EagleWithReferenceBranch(EagleDrafter):
    """The head's own tree plus the target's greedy continuation as a chain under the root, appended as
    the LAST nodes: accepted paths run through the last rows of the tree, not the first. first=True puts
    the chain FIRST (nodes 1..b): accepted paths are then rows 0..k-1, the in-place (sliced) case."""

    def __init__(self, head, reference: list[int], branch: int, first: bool = False, **options):
        super().__init__(head, **options)
        self.reference, self.branch, self.done, self.first = reference, branch, 0, first

    def start(self, prompts, hidden, roots):
        super().start(prompts, hidden, roots)
        self.done = 1

    def accept_paths(self, tokens, hidden, paths, next_roots):  # counted here, whatever `accept` it reaches
        super().accept_paths(tokens, hidden, paths, next_roots)
        self.done += len(tokens[0])

    def propose(self, roots, sampling, generators):
        tree = super().propose(roots, sampling, generators).tree(0)  # a batch of one
        extra = self.reference[self.done : self.done + self.branch]
        if self.first:  # root, the chain (node i's parent i - 1), then the head's nodes shifted by b
            b = len(extra)
            moved = [p + b if p > 0 else 0 for p in tree.parents[1:].tolist()]
            return one_tree(
                TokenTree(
                    torch.tensor([int(tree.tokens[0]), *extra, *tree.tokens[1:].tolist()]),
                    torch.tensor([-1, *range(b), *moved]),
                )
            )
        n = tree.size
        parents = [0] + [n + i for i in range(len(extra) - 1)]  # [len(extra)]: a chain under the root
        return one_tree(
            TokenTree(
                torch.cat([tree.tokens, torch.tensor(extra, dtype=torch.long)]),
                torch.cat([tree.parents, torch.tensor(parents[: len(extra)], dtype=torch.long)]),
            )
        )


def one_tree(tree: TokenTree) -> BatchDraft:
    """A batch of one's draft of `tree` (deterministic children)."""
    return BatchDraft(tree.tokens[None], tree.parents[None], [tree.size])


class ByAccept(EagleWithReferenceBranch):
    """The same drafter with an `accept` of its own: the loop's paths reach it through the default
    `Drafter.accept_paths`, which gathers each path's rows of the trees' states."""

    accept_paths = EagleDrafter.accept_paths  # (not the counting one above: `accept` counts)

    def accept(self, tokens, lengths, hidden, next_roots):
        super().accept(tokens, lengths, hidden, next_roots)
        self.done += lengths[0]


@pytest.mark.parametrize("hook", [EagleWithReferenceBranch, ByAccept])
@pytest.mark.parametrize(
    ("family", "options"),
    [
        ("eagle", dict(tree="dynamic", top_k=3, depth=3, total_tokens=10)),
        ("eagle3", dict(tree=[[0], [1], [2], [0, 0], [1, 0], [0, 0, 0]])),
        ("eagle3", dict(tree=[[0], [1], [0, 0]], first=True)),  # paths in place: rows 0..k-1
    ],
)
def test_drafter_state_follows_the_accepted_rows(setup, family, options, hook):
    """After generate() on branching trees, the EAGLE head's committed cache and last feature equal a
    fresh head run over the target's states of the emitted sequence (the accepted rows were handed on)."""
    model, tok = setup
    head = eagle_head(model, family)
    prompt = [17, 23, 5, 88, 130, 64, 9]
    reference = hf_greedy(model, prompt, 30)
    drafter = hook(head, reference, branch=5, **options)
    gen = SpeculativeGenerator(model, tok, drafter)
    gen.eos = set()
    result = gen.generate(input_ids=prompt, max_new_tokens=30)
    assert result.token_ids == reference
    assert result.stats.tau > 3  # long paths through the appended (last) rows were accepted

    rows = drafter._rows  # (eager: `EagleRows`, a batch of one)
    committed = rows.lengths[0]  # the passes the drafter heard about (not the last one)
    sequence = torch.tensor(prompt + result.token_ids)
    assert committed == len(prompt) + sum(result.stats.accept_lengths[:-1])
    states = TargetRunner(model, head.config.target_layers).prefill([sequence[:committed]])[1][
        0
    ]  # {l: [C, H]}
    inputs = [states[layer][None] for layer in head.config.target_layers]  # [1, C, H] each
    features = head.fuse(inputs) if family == "eagle3" else inputs[0]
    fresh = DynamicCache()
    out = head.step(features, sequence[1 : committed + 1][None], past_key_values=fresh)  # [1, C, H]
    assert int(rows.committed[0]) == committed == fresh.get_seq_length()
    for mine, ref in zip(rows.cache.row_layers, fresh.layers, strict=True):  # preallocated: committed slots
        torch.testing.assert_close(mine.keys[:, :, :committed], ref.keys, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(mine.values[:, :, :committed], ref.values, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(rows.feature, out[:, -1], atol=1e-4, rtol=1e-4)
