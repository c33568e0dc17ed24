"""The parallel drafters (P-EAGLE, DFlash; chains and trees of each block slot's top-k) through the lossless
tests every drafter passes, with heads fitted a little so paths of several tokens are accepted: greedy
decoding equals plain decoding at a batch of one and of several rows (mixed prompt lengths, per-row
max_new_tokens, an EOS inside an accepted path), every row keeps its batch-of-one passes, row b proposes
its batch-of-one trees pass by pass (`propose_alike`), and sampled decoding (rule A: deterministic
children) follows the target's distribution."""

from __future__ import annotations

import pytest
import torch

from spechead.inference.drafters.block_tree import BlockTree
from spechead.inference.generator import SpeculativeGenerator
from spechead.inference.sampling import SamplingParams

from ..distributions import sampling_tv
from ..test_batch import MAX_NEW, PROMPTS
from ..test_generator import PARAMS, PROMPT, plain_greedy
from .parallel_heads import KINDS, dflash_head, parallel_drafter, peagle_head
from .test_batch_drafters import OneRowEach, propose_alike

# one worker fits the module's heads (`--dist loadgroup`), not every worker that runs one of its tests
pytestmark = pytest.mark.xdist_group("parallel_lossless")


@pytest.fixture(scope="module")
def model(tiny_llama, chatml_tokenizer):
    model = tiny_llama(len(chatml_tokenizer), layers=2, hidden=32, seed=3)
    model.generation_config.eos_token_id = None
    return model


@pytest.fixture(scope="module")
def heads(model):
    """{"peagle": head, "dflash": head} fitted to the target's greedy continuations of PROMPTS and of PROMPT
    after each of its top-3 next tokens (whichever the sampling test draws, its next draft is right)."""
    with torch.no_grad():
        top = model(torch.tensor([PROMPT])).logits[0, -1].topk(3).indices.tolist()
    fit = [*PROMPTS, *(PROMPT + [t] for t in top)]
    return {"peagle": peagle_head(model, fit), "dflash": dflash_head(model, fit)}


def drafter(heads, kind: str):
    return parallel_drafter(heads[kind.split("_")[0]], kind)


def test_a_block_tree_picks_each_slots_ranked_candidates():
    """Node i (depth d, rank r) carries slot d - 1's r-th best id; the default is the chain of best ids."""
    tree = BlockTree([[0], [1], [0, 0], [1, 0], [0, 0, 0], [0, 1]], slots=3)
    top = torch.tensor([[[10, 11], [20, 21], [30, 31]]])  # [1, slots, width]: slot s's ids s*10 + 10 + rank
    tokens = tree.tokens(torch.tensor([7]), top)[0].tolist()
    parents = tree.parents.tolist()
    depth = [0] * len(parents)
    for i in range(1, len(parents)):
        depth[i] = depth[parents[i]] + 1
    assert tokens[0] == 7 and tree.width == 2 and tree.depth == 3
    assert all(tokens[i] // 10 == depth[i] for i in range(1, len(tokens)))  # slot depth - 1
    assert sorted(tokens[1:]) == [10, 11, 20, 20, 21, 30]  # ranks: [0]/[1] at depth 1, [0,1] -> 21
    assert tokens[:4] == [7, 10, 20, 30]  # depth-first: the greedy chain is nodes 0..3
    chain = BlockTree(None, slots=3)
    assert chain.tokens(torch.tensor([7]), top)[0].tolist() == [7, 10, 20, 30]
    assert chain.parents.tolist() == [-1, 0, 1, 2]
    assert BlockTree([[0], [0, 0, 0, 0]][:1], slots=3).size == 2


@pytest.mark.parametrize("kind", KINDS)
def test_greedy_decoding_equals_plain_decoding_at_one_and_many_rows(model, chatml_tokenizer, heads, kind):
    """Mixed prompt lengths, per-row max_new_tokens, row 0 stopping at an EOS inside an accepted path: every
    row equals plain greedy decoding and its batch-of-one run, passes included (accept lengths, drafts)."""
    gen = SpeculativeGenerator(model, chatml_tokenizer, drafter(heads, kind), cache="static")
    gen.eos = set()
    full = gen.generate(input_ids=PROMPTS[0], max_new_tokens=MAX_NEW[0])
    lengths = full.stats.accept_lengths
    assert max(lengths) > 2, lengths  # whole paths accepted (a fitted head)
    # the EOS: an accepted draft in the middle of a pass (not its next token), its first occurrence
    inside = [1 + sum(lengths[:i]) + j for i, k in enumerate(lengths) for j in range(k - 2)]
    at = next(i for i in inside if full.token_ids.index(full.token_ids[i]) == i)
    eos = full.token_ids[at]
    gen.eos = {eos}
    batch = gen.generate_batch(input_ids=PROMPTS, max_new_tokens=MAX_NEW)
    for b, (prompt, n) in enumerate(zip(PROMPTS, MAX_NEW)):
        single = gen.generate(input_ids=prompt, max_new_tokens=n)
        assert batch[b].token_ids == single.token_ids == plain_greedy(model, prompt, n, eos=eos), (kind, b)
        assert batch[b].stats.accept_lengths == single.stats.accept_lengths, (kind, b)
        assert batch[b].stats.drafted_tokens == single.stats.drafted_tokens > 0, (kind, b)
    assert batch[0].token_ids == full.token_ids[: at + 1]  # stopped inside a path, the others went on
    assert all(max(r.stats.accept_lengths) > 1 for r in batch if len(r.token_ids) > 2)


@pytest.mark.parametrize("kind", KINDS)
def test_sampled_rows_keep_their_batch_of_one_draws(model, chatml_tokenizer, heads, kind):
    """Seeded sampling at B rows: each row's tokens and passes are its batch-of-one run's."""
    gen = SpeculativeGenerator(model, chatml_tokenizer, drafter(heads, kind), cache="static")
    gen.eos = set()
    kw = {"temperature": 0.8, "top_k": 30}
    batch = gen.generate_batch(input_ids=PROMPTS, max_new_tokens=MAX_NEW, seed=[3, 4, 5, 6], **kw)
    for b, (prompt, n) in enumerate(zip(PROMPTS, MAX_NEW)):
        single = gen.generate(input_ids=prompt, max_new_tokens=n, seed=3 + b, **kw)
        assert batch[b].token_ids == single.token_ids, (kind, b)
        assert batch[b].stats.accept_lengths == single.stats.accept_lengths, (kind, b)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("fitted", [True, False])
def test_row_b_proposes_its_batch_of_one_trees_pass_by_pass(model, heads, kind, fitted):
    """Through mixed prompt lengths, accepts of different lengths (one longer than any tree) and rows
    leaving in another order, down to one row: every pass's trees equal a batch of one per row."""
    if fitted:
        head = heads[kind.split("_")[0]]
    else:
        head = peagle_head(model, None) if kind.startswith("peagle") else dflash_head(model, None)
        g = torch.Generator().manual_seed(5)
        with torch.no_grad():  # weights at 1/sqrt(fan_in): every input moves the drafts
            for weight in head.parameters():
                if weight.dim() == 2:
                    weight.copy_(torch.randn(weight.shape, generator=g) / weight.shape[1] ** 0.5)
    propose_alike(model, parallel_drafter(head, kind), OneRowEach(parallel_drafter(head, kind)))


class ProposesTwice(OneRowEach):
    """A drafter over B rows (not clones) whose every pass proposes twice (as calibration times drafts):
    the second draft must equal the first and leave what follows as a single propose does."""

    def start(self, prompts, hidden, roots) -> None:
        self.drafter.start(prompts, hidden, roots)

    def propose(self, roots, sampling, generators):
        first = self.drafter.propose(roots, sampling, generators)
        second = self.drafter.propose(roots, sampling, generators)
        assert torch.equal(first.tokens, second.tokens) and torch.equal(first.parents, second.parents)
        return second

    def accept(self, tokens, lengths, hidden, next_roots) -> None:
        self.drafter.accept(tokens, lengths, hidden, next_roots)

    def keep(self, rows) -> None:
        self.drafter.keep(rows)


@pytest.mark.parametrize("kind", ["peagle_tree", "dflash_tree"])
def test_a_propose_again_without_an_accept_drafts_the_same_trees(model, heads, kind):
    head = heads[kind.split("_")[0]]
    propose_alike(
        model, ProposesTwice(parallel_drafter(head, kind)), OneRowEach(parallel_drafter(head, kind))
    )


@pytest.mark.parametrize("kind", KINDS)
def test_sampled_decoding_follows_the_targets_distribution(model, chatml_tokenizer, heads, kind):
    """Rule A over each slot's top-k children: the first two sampled tokens' law is the target's (TV of
    1500 seeds), with drafts accepted along the way."""
    gen = SpeculativeGenerator(model, chatml_tokenizer, drafter(heads, kind))
    tv = sampling_tv(gen, PROMPT, PARAMS, trials=1500)
    # 9 outcomes, 1500 samples: sampling noise gives TV around 0.03; a biased rule is far above.
    assert tv < 0.07, f"{kind}: TV {tv:.3f}"
    kw = {"temperature": PARAMS.temperature, "top_k": PARAMS.top_k}
    accepted = sum(gen.generate(input_ids=PROMPT, max_new_tokens=3, seed=s, **kw).stats.accepted_tokens
                   for s in range(40))  # fmt: skip
    assert accepted > 10, accepted  # (the second token is a draft accepted by rule A, 40 seeds)


@torch.no_grad()
def test_a_dflash_block_from_its_context_buffers_is_the_block_over_the_whole_prefix(model, heads):
    """After passes and accepts (rows of other lengths), row b's tree equals the block the head predicts
    from every committed position at once (`predict_blocks`, no buffers): a wrong slot, position or
    committed length differs."""
    head = heads["dflash"]
    layers = head.config.target_layers
    seqs = [torch.tensor(PROMPTS[b] + plain_greedy(model, PROMPTS[b], 12)) for b in (0, 2)]
    out = [model(s[None], output_hidden_states=True).hidden_states for s in seqs]
    states = [{layer: o[layer][0] for layer in layers} for o in out]  # [T_b, H]
    d = drafter(heads, "dflash_tree")
    starts = [len(PROMPTS[b]) for b in (0, 2)]
    d.start([s[:n] for s, n in zip(seqs, starts)], [{k: v[:n] for k, v in h.items()} for h, n in zip(states, starts)],
            [int(s[n]) for s, n in zip(seqs, starts)])  # fmt: skip
    done = list(starts)
    for ks in ([3, 1], [2, 4]):  # accepted path lengths per row (root included)
        d.propose([int(s[n]) for s, n in zip(seqs, done)], [SamplingParams()] * 2, [None] * 2)
        k = max(ks)
        tokens = torch.stack([s[n : n + k] for s, n in zip(seqs, done)])  # [2, K]
        hidden = {layer: torch.stack([h[layer][n : n + k] for h, n in zip(states, done)]) for layer in layers}
        done = [n + c for n, c in zip(done, ks)]
        d.accept(tokens, ks, hidden, [int(s[n]) for s, n in zip(seqs, done)])
    draft = d.propose([int(s[n]) for s, n in zip(seqs, done)], [SamplingParams()] * 2, [None] * 2)
    assert d.lengths == done == d.lengths_t.tolist()
    for b, (seq, n) in enumerate(zip(seqs, done)):
        context = head.fuse([states[b][layer][None, :n] for layer in layers])  # [1, n, H]
        block = head.predict_blocks(context, seq[None, : n + 1], torch.tensor([[n - 1]]))[0, 0]  # [bs, H]
        top = head.logits(block[None, 1:]).topk(d.tree.width, dim=-1).indices  # [1, bs - 1, width]
        assert draft.tokens[b].tolist() == d.tree.tokens(seq[n : n + 1], top)[0].tolist(), b


@pytest.mark.parametrize("compile", [False, "graphs"])
def test_a_peagle_pass_writes_every_row_at_slots_of_its_own(model, heads, monkeypatch, compile):
    """Rows of other pending counts: each row's real entries, block and padding go to distinct slots (two
    entries scattered to one slot keep either on a GPU), the real ones at L_b.., the block after them;
    compiled, the second pass's pending positions padded to P = commit_width (the fixed shape)."""
    d = drafter(heads, "peagle_tree")
    d.use_compile(compile)
    seen = []
    step = d.head_step  # (the head's step as the drafter runs it: heads/fused.py's chain)
    d.head_step = lambda *a, **kw: (seen.append(a[3].clone()), step(*a, **kw))[1]
    h = model.config.hidden_size
    prompts = [torch.arange(5, 5 + n) for n in (6, 2, 4)]
    d.start(
        prompts, [{layer: torch.randn(p.numel(), h) for layer in d.hidden_layers} for p in prompts], [1, 2, 3]
    )
    d.propose([1, 2, 3], [SamplingParams()] * 3, [None] * 3)
    d.accept(torch.ones(3, 4, dtype=torch.long), [4, 1, 2], {layer: torch.randn(3, 4, h) for layer in d.hidden_layers},
             [4, 5, 6])  # fmt: skip
    d.propose([4, 5, 6], [SamplingParams()] * 3, [None] * 3)
    k = d.head.block_size
    assert seen[1].shape[1] == (d.commit_width if compile else 4) + k - 1
    for slots, (lengths, counts) in zip(seen, [([0, 0, 0], [6, 2, 4]), ([6, 2, 4], [4, 1, 2])]):
        for b, (length, count) in enumerate(zip(lengths, counts)):
            row = slots[b].tolist()
            assert len(set(row)) == len(row), row
            width = slots.shape[1] - (k - 1)
            assert row[:count] == list(range(length, length + count))  # real entries
            assert row[width:] == list(range(length + count, length + count + k - 1))  # the block after them
