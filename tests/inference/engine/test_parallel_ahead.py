"""The parallel drafters (P-EAGLE, DFlash) one draft ahead (engine/loop.py depth 1), forced on a CPU: their
queued accept and draft from device tensors (`accept_queued`, `propose_queued`, `settle`) equal
`accept_paths` and `propose` read first, over several rounds of rows accepting paths of different lengths
(off the main path too); decoding ahead on a compiled target equals plain decoding with the passes of the
loop that reads first, at a batch of one and of several rows, greedy and sampled (rule A)."""

from __future__ import annotations

import pytest
import torch

from spechead.inference.generator import SpeculativeGenerator
from spechead.inference.sampling import SamplingParams

from ..drafters.parallel_heads import KINDS, dflash_head, parallel_drafter, peagle_head
from ..test_batch import MAX_NEW, PROMPTS
from ..test_generator import plain_greedy

# one worker fits the module's heads (`--dist loadgroup`), not every worker that runs one of its tests
pytestmark = pytest.mark.xdist_group("parallel_ahead")


@pytest.fixture(scope="module")
def model(tiny_llama, chatml_tokenizer):
    model = tiny_llama(len(chatml_tokenizer), layers=2, hidden=32, seed=3)
    model.generation_config.eos_token_id = None
    return model


@pytest.fixture(scope="module")
def heads(model):
    """{"peagle": head, "dflash": head} fitted to the target's greedy continuations of PROMPTS."""
    return {"peagle": peagle_head(model, PROMPTS), "dflash": dflash_head(model, PROMPTS)}


def random_head(model, family: str):
    head = peagle_head(model, None) if family == "peagle" else dflash_head(model, None)
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():  # weights at 1/sqrt(fan_in): every input moves the drafts
        for weight in head.parameters():
            if weight.dim() == 2:
                weight.copy_(torch.randn(weight.shape, generator=g) / weight.shape[1] ** 0.5)
    return head


# each round: every row's accepted path (node indices, ascending; off the main path too; the drafters read
# only the nodes' states and tokens, so a path need not be one of the tree's)
ROUNDS = [
    [[0, 2, 5], [0], [0, 1, 2, 3]],
    [[0], [0, 1], [0, 4]],
    [[0, 1, 2, 3, 4], [0, 2, 5], [0]],  # (P-EAGLE's deepest: 5 nodes)
    [[0, 4], [0, 1, 2], [0, 1]],
]


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("compile", [False, "graphs"])
def test_the_queued_accept_and_draft_equal_accept_paths_and_propose(model, kind, compile):
    """Two drafters over one head, three rows of mixed prompt lengths: one hears paths on the host, the
    other from device tensors (paths padded to >= P, K and the next tokens; eager, or its draft compiled:
    the fixed-shape function); the same trees, every round, and the same host lengths once settled."""
    head = random_head(model, kind.split("_")[0])
    host, queued = parallel_drafter(head, kind), parallel_drafter(head, kind)
    queued.use_compile(compile)
    assert queued.queues(1) and queued.queues(3)
    g = torch.Generator().manual_seed(2)
    h, vocab = model.config.hidden_size, model.config.vocab_size
    prompts = [torch.randint(5, vocab, (n,), generator=g) for n in (12, 3, 7)]
    states = [
        {layer: torch.randn(p.numel(), h, generator=g) for layer in host.hidden_layers} for p in prompts
    ]
    roots = [7, 8, 9]
    greedy = [SamplingParams()] * 3
    for d in (host, queued):
        d.start(prompts, states, roots)
    drafts = [d.propose(roots, greedy, [None] * 3) for d in (host, queued)]  # the first: from the host
    n = drafts[0].tokens.shape[1]
    for paths in ROUNDS:
        longest = int(host.tree.depth) + 1  # a path of the tree: at most its depth + 1 nodes
        paths = [[i for i in p if i < n][:longest] for p in paths]  # (a chain: its nodes only)
        assert drafts[1].tokens.tolist() == drafts[0].tokens.tolist(), paths
        assert drafts[1].parents.tolist() == drafts[0].parents.tolist()
        hidden = {layer: torch.randn(3, n, h, generator=g) for layer in host.hidden_layers}
        tokens = torch.randint(0, vocab, (3, n), generator=g)
        nexts = [int(x) for x in torch.randint(0, vocab, (3,), generator=g)]
        host.accept_paths([tokens[b, p].tolist() for b, p in enumerate(paths)], hidden, paths, nexts)
        width = max(n, queued.commit_width)
        padded = torch.tensor([p + [p[-1]] * (width - len(p)) for p in paths])  # [B, >= P]
        ks = [len(p) for p in paths]
        queued.accept_queued(hidden, tokens, padded, torch.tensor(ks), torch.tensor(nexts))
        drafts = [host.propose(nexts, greedy, [None] * 3), queued.propose_queued(torch.tensor(nexts))]
        queued.settle(ks)  # (after the draft, as the engine reads the acceptance)
        assert queued.lengths == host.lengths == queued.lengths_t.tolist()  # device = host
    assert drafts[1].tokens.tolist() == drafts[0].tokens.tolist()
    for d in (host, queued):  # rows leave; a propose again: the kept rows' last trees
        d.keep([2, 0])
    again = [d.propose(nexts[::-2], greedy[:2], [None] * 2) for d in (host, queued)]
    assert again[1].tokens.tolist() == again[0].tokens.tolist() == drafts[0].tokens[[2, 0]].tolist()
    assert queued.lengths == host.lengths == queued.lengths_t.tolist()


def generators(model, chatml_tokenizer, heads, kind):
    """(ahead, read first): compiled targets accepting on the device, the first one a draft ahead."""
    gens = [
        SpeculativeGenerator(model, chatml_tokenizer, parallel_drafter(heads[kind.split("_")[0]], kind),
                             compile="graphs")
        for _ in "ab"
    ]  # fmt: skip
    for g in gens:
        g.device_accept = True
    gens[0].ahead = True
    return gens


@pytest.mark.parametrize("kind", KINDS)
def test_decoding_ahead_equals_plain_decoding_with_the_same_passes(model, chatml_tokenizer, heads, kind,
                                                                   monkeypatch):  # fmt: skip
    """A batch of one, budgets of 1 to 30 tokens, then four rows (rows leave as they finish): the tokens
    of plain decoding, the accept lengths and drafts of the loop that reads first; every pass committed
    from the device; paths of several tokens accepted."""
    ahead, first = generators(model, chatml_tokenizer, heads, kind)
    for g in (ahead, first):
        g.eos = set()
    queued, passes = [], 0
    runner_class = type(ahead.runner)  # (every row capacity's runner is a TargetRunner)
    commit = runner_class.commit_queued
    monkeypatch.setattr(
        runner_class, "commit_queued", lambda self, path: (queued.append(path.shape[0]), commit(self, path))
    )
    longest = 0
    for i, n in enumerate((1, 2, 9, 30)):
        prompt = PROMPTS[i % len(PROMPTS)]
        out, ref = (g.generate(input_ids=prompt, max_new_tokens=n) for g in (ahead, first))
        assert out.token_ids == ref.token_ids == plain_greedy(model, prompt, n), (kind, n)
        assert out.stats.accept_lengths == ref.stats.accept_lengths and out.stats.new_tokens == n
        assert out.stats.drafted_tokens == ref.stats.drafted_tokens
        passes += len(out.stats.accept_lengths)
        longest = max([longest, *out.stats.accept_lengths])
    assert len(queued) == passes > 0 and longest > 2  # every pass committed from the device
    rows, refs = (g.generate_batch(input_ids=PROMPTS, max_new_tokens=MAX_NEW) for g in (ahead, first))
    for b, (prompt, n) in enumerate(zip(PROMPTS, MAX_NEW)):
        assert rows[b].token_ids == refs[b].token_ids == plain_greedy(model, prompt, n), (kind, b)
        assert rows[b].stats.accept_lengths == refs[b].stats.accept_lengths, (kind, b)


@pytest.mark.parametrize("kind", ["peagle_tree", "dflash_tree"])
def test_sampling_ahead_draws_what_the_loop_that_reads_first_draws(model, chatml_tokenizer, heads, kind):
    ahead, first = generators(model, chatml_tokenizer, heads, kind)
    for seed in range(3):
        kw = {"input_ids": PROMPTS[seed], "max_new_tokens": 20, "seed": seed, "temperature": 0.9, "top_k": 20}
        out, ref = ahead.generate(**kw), first.generate(**kw)
        assert out.token_ids == ref.token_ids and out.stats.accept_lengths == ref.stats.accept_lengths


def test_an_eos_inside_an_accepted_path_stops_ahead_at_it(model, chatml_tokenizer, heads):
    ahead, _ = generators(model, chatml_tokenizer, heads, "dflash_tree")
    full = plain_greedy(model, PROMPTS[2], 20)
    for at in (0, 3, 11):
        ahead.eos = {full[at]}
        out = ahead.generate(input_ids=PROMPTS[2], max_new_tokens=20).token_ids
        assert out == full[: full.index(full[at]) + 1]
