"""Batched speculative decoding one draft ahead (engine/loop.py, depth 1), forced on a CPU (the default on CUDA
only): the acceptance of B rows on the device is each row's host `greedy_accept`, or its rule A as alone; the
batch drafters' queued accept and draft equal `accept` and `propose` (paths off the main path, rows of
different K, rows leaving); decoding equals the loop that reads first row by row (tokens, accepted lengths,
drafted counts), greedy and sampled, with mixed prompt lengths, per-row budgets and a row stopping at an
EOS while the others go on."""

from __future__ import annotations

import pytest
import torch

from spechead.inference.acceptance import greedy_accept
from spechead.inference.drafters.per_row import rows_drafter
from spechead.inference.engine import loop as loop_module
from spechead.inference.generator import SpeculativeGenerator
from spechead.inference.queued_acceptance import QueuedAcceptance
from spechead.inference.target.runner import TargetRunner
from spechead.inference.tree import TokenTree, ancestors_on_device, tree_from_choices

from ..drafters.test_batch_drafters import build, fitted_medusa
from ..test_batch import MAX_NEW, PROMPTS
from ..test_generator import plain_greedy
from ..test_graph_replay import replayed_graphs  # noqa: F401 - the fixture

CHOICES = [[0], [1], [2], [0, 0], [0, 1], [1, 0], [0, 0, 0], [0, 1, 0], [1, 0, 0], [0, 0, 0, 0]]


@pytest.fixture(scope="module")
def model(tiny_llama, chatml_tokenizer):
    model = tiny_llama(len(chatml_tokenizer), layers=2, hidden=32, seed=3)
    model.generation_config.eos_token_id = None
    return model


def rows_of_trees(seed: int, batch: int = 3):
    """Random tokens of B copies of CHOICES' tree, row b with its first sizes[b] nodes real (-1 after)."""
    gen = torch.Generator().manual_seed(seed)
    parents = tree_from_choices(CHOICES).parents  # [N]
    n = parents.shape[0]
    sizes = [n, 5, 8][:batch]
    tokens = torch.randint(0, 6, (batch, n), generator=gen)  # a small vocab: many children accepted
    parents = parents.expand(batch, n).clone()
    for b, size in enumerate(sizes):
        tokens[b, size:], parents[b, size:] = -1, 0  # padding: never accepted
    return tokens, parents, ancestors_on_device(parents), sizes, gen


def test_the_queued_rows_acceptance_is_the_host_rules():
    for seed in range(12):
        tokens, parents, anc, sizes, gen = rows_of_trees(seed)
        logits = torch.randn(*tokens.shape, 6, generator=gen) * 3
        queued = QueuedAcceptance.greedy(tokens, parents, anc, logits, size=16)
        expected = [
            greedy_accept(TokenTree(t[:size], p[:size]), x[:size])
            for t, p, x, size in zip(tokens, parents, logits, sizes)
        ]  # each row's host walk over its real nodes
        got = queued.result()
        assert got == expected and [a.path_tokens for a in got] == [a.path_tokens for a in expected]
        assert queued.k.tolist() == [len(a.path) for a in expected] and queued.path.shape == (3, 16)
        for row, acc in zip(queued.path.tolist(), expected):
            assert row == acc.path + [acc.path[-1]] * (16 - len(acc.path))
        probs = torch.softmax(logits, -1)
        gens = [torch.Generator().manual_seed(seed + b) for b in range(3)]
        sampled = QueuedAcceptance.sampled(tokens, parents, anc, probs, gens, 16, sizes).result()
        for b, size in enumerate(sizes):  # each row as it draws alone
            t, p = tokens[b : b + 1, :size], parents[b : b + 1, :size]
            gen = torch.Generator().manual_seed(seed + b)
            alone = QueuedAcceptance.sampled(t, p, ancestors_on_device(p), probs[b : b + 1, :size], [gen])
            assert [sampled[b]] == alone.result()


def test_the_queued_greedy_rule_takes_each_rows_own_tree():
    """Rows of one size but different shapes (a chain, a star, a branching tree: dynamic trees differ
    row by row): each row's queued path, length and next token are its own tree's greedy_accept's."""
    shapes = [[-1, 0, 1, 2, 3], [-1, 0, 0, 0, 0], [-1, 0, 0, 2, 1]]
    gen = torch.Generator().manual_seed(0)
    for trial in range(20):
        parents = torch.tensor(shapes[trial % 3 :] + shapes[: trial % 3])  # [B, N], row 0 varies
        logits = torch.randn(3, 5, 6, generator=gen)  # [B, N, V]
        tokens = logits.argmax(-1).gather(1, parents.clamp(min=0))  # each node its parent's argmax
        tokens[:, 0] = 1
        tokens[torch.rand(3, 5, generator=gen) < 0.25] = 5  # some misses (unless it is the argmax)
        queued = QueuedAcceptance.greedy(tokens, parents, ancestors_on_device(parents), logits, size=8)
        got = queued.result()
        for b in range(3):
            want = greedy_accept(TokenTree(tokens[b], parents[b]), logits[b])
            assert got[b] == want and got[b].path_tokens == want.path_tokens, f"trial {trial}, row {b}"
            assert queued.path[b].tolist() == want.path + [want.path[-1]] * (8 - len(want.path))


def queued_and_host(model, kind: str):
    """Two drafters of equal heads on 3 rows, started alike: (queued, host)."""
    made = []
    for _ in range(2):  # (a compiled drafter keeps ONE set of graphs: two drafters)
        drafter = build(model, kind)  # (seeded: the same weights)
        if kind != "medusa":
            drafter.batch_graphs = True  # (a CPU: the fixed-shape batch draft, as CUDA runs it)
            drafter.use_compile("graphs")
        made.append(rows_drafter(drafter))  # (EAGLE, Medusa: the drafter itself)
    queued, host = made
    gen = torch.Generator().manual_seed(4)
    h = model.config.hidden_size
    prompts = [torch.arange(5, 5 + n) for n in (9, 4, 12)]
    states = [
        {layer: torch.randn(p.numel(), h, generator=gen) for layer in drafter.hidden_layers} for p in prompts
    ]
    for d in (queued, host):
        d.start(prompts, states, [7, 8, 9])
    return queued, host, gen


@pytest.mark.parametrize("kind", ["eagle3_static", "eagle_dynamic", "medusa"])
def test_the_queued_batch_accept_and_draft_equal_accept_and_propose(model, kind):
    """Per round, each row's path (off the main path, K from 1 to 4, different per row): the queued
    drafter hears it as device tensors, the other as `accept` hears it; their next trees are equal, the
    committed lengths too; a row leaves between rounds."""
    queued, host, gen = queued_and_host(model, kind)
    sampling = [None] * 3
    drafts = [d.propose([7, 8, 9], sampling, sampling) for d in (queued, host)]
    # 3 rows, then 2, then 1 (Medusa: its batch-of-one path)
    rounds = ([[0, 2, 5], [0], [0, 1, 4, 7]], [[0, 3], [0, 1, 3]], [[0, 1], [0, 2, 5]], [[0, 1, 3]])
    h, vocab = model.config.hidden_size, model.config.vocab_size
    for r, paths in enumerate(rounds):
        assert torch.equal(drafts[0].tokens, drafts[1].tokens) and torch.equal(
            drafts[0].parents, drafts[1].parents
        )
        batch, n = drafts[0].tokens.shape
        paths = [[p for p in path if p < n] for path in paths]  # (a small tree: its nodes only)
        layers = getattr(host, "drafter", host).hidden_layers  # (EAGLE's batch drafter: its drafter's)
        hidden = {layer: torch.randn(batch, n, h, generator=gen) for layer in layers}
        tokens = torch.randint(0, vocab, (batch, n), generator=gen)
        nexts = torch.randint(0, vocab, (batch,), generator=gen)
        width = max(n, queued.commit_width)
        padded = torch.tensor([p + p[-1:] * (width - len(p)) for p in paths])  # [B, W]
        k = max(map(len, paths))
        host_tokens = tokens.gather(1, padded[:, :k])  # [B, K] root first, padded
        gathered = {layer: x.gather(1, padded[:, :k, None].expand(-1, -1, h)) for layer, x in hidden.items()}
        host.accept(host_tokens, [len(p) for p in paths], gathered, nexts.tolist())
        queued.accept_queued(hidden, tokens, padded, torch.tensor([len(p) for p in paths]), nexts)
        drafts = [queued.propose_queued(nexts), host.propose(nexts.tolist(), sampling, sampling)]
        queued.settle([len(p) for p in paths])
        if kind != "medusa":
            assert torch.equal(queued._graphs._capacity.lengths, host._graphs._capacity.lengths)
        if r in (0, 2):  # the middle row leaves, then the first
            keep = [0, 2] if r == 0 else [1]
            for d in (queued, host):
                d.keep(keep)
            drafts = [d.rows(keep) for d in drafts]
    assert torch.equal(drafts[0].tokens, drafts[1].tokens)


def generators(model, tok, drafter_of, **options):
    """(one draft ahead, the loop that reads first): compiled batch passes, accepted on the device."""
    out = []
    for ahead in (True, False):
        gen = SpeculativeGenerator(model, tok, drafter_of(), compile="graphs", **options)
        gen.device_accept, gen.ahead = True, ahead
        out.append(gen)
    return out


def drafter_maker(model, kind):
    if kind == "medusa_fitted":
        return lambda: fitted_medusa(model, PROMPTS)

    def make():
        drafter = build(model, kind)
        drafter.batch_graphs = True  # (a CPU: the compiled batch drafter, as CUDA runs it)
        return drafter

    return make


@pytest.mark.parametrize("kind", ["eagle3_static", "eagle_dynamic", "medusa_fitted"])
def test_batch_decoding_ahead_equals_the_loop_that_reads_first(model, chatml_tokenizer, kind, monkeypatch):
    ahead, first = generators(model, chatml_tokenizer, drafter_maker(model, kind))
    assert not SpeculativeGenerator(model, chatml_tokenizer, None).ahead  # a CPU's default
    queued = []
    runner_class = type(ahead.runner)  # (every row capacity's runner is a TargetRunner)
    commit = runner_class.commit_queued
    monkeypatch.setattr(
        runner_class, "commit_queued", lambda self, p: (queued.append(p.shape[0]), commit(self, p))
    )
    eos = plain_greedy(model, PROMPTS[0], MAX_NEW[0])[6]  # row 0 stops there; the others go on
    for g in (ahead, first):
        g.eos = {eos}
    greedy = None
    budgets = (MAX_NEW, MAX_NEW, [14, 1, 20, 2])  # (the last: a row done at its prefill's token)
    for kw, max_new in zip(({}, {"temperature": 0.8, "top_k": 30, "seed": [3, 4, 5, 6]}, {}), budgets):
        out = ahead.generate_batch(input_ids=PROMPTS, max_new_tokens=max_new, tree_for_batch=False, **kw)
        ref = first.generate_batch(input_ids=PROMPTS, max_new_tokens=max_new, tree_for_batch=False, **kw)
        for b, (prompt, n) in enumerate(zip(PROMPTS, max_new)):
            assert out[b].token_ids == ref[b].token_ids, (kind, b, kw)
            assert out[b].stats.accept_lengths == ref[b].stats.accept_lengths, (kind, b, kw)
            assert out[b].stats.drafted_tokens == ref[b].stats.drafted_tokens, (kind, b, kw)
            if not kw:
                assert out[b].token_ids == plain_greedy(model, prompt, n, eos=eos), (kind, b)
        passes = max(len(r.stats.accept_lengths) for r in out)
        assert len(queued) == passes > 0, kw  # every pass committed from the device
        queued.clear()
        greedy = greedy or out
    if kind == "medusa_fitted":  # whole paths accepted (and row 0 stopped at its EOS)
        assert all(max(r.stats.accept_lengths) > 2 for r in greedy) and greedy[0].token_ids[-1] == eos


def test_ahead_only_where_it_can_run(model, chatml_tokenizer, monkeypatch):
    """An eager target, children drawn from the head when sampling, rows both greedy and sampled: the
    loop that reads first."""
    from spechead.inference.engine.loop import depth_for
    from spechead.inference.engine.rows import Row
    from spechead.inference.sampling import SamplingParams
    from spechead.inference.stats import GenerationStats

    def no_ahead(*args, **kwargs):
        raise AssertionError("the loop queued the next draft")

    monkeypatch.setattr(loop_module, "accept_queued", no_ahead)
    eager = SpeculativeGenerator(model, chatml_tokenizer, build(model, "eagle3_static"))
    eager.device_accept = eager.ahead = True
    eager.generate_batch(input_ids=PROMPTS, max_new_tokens=MAX_NEW, tree_for_batch=False)
    drawn = build(model, "eagle3_static")
    drawn.rule, drawn.batch_graphs = "without_replacement", True
    gen = SpeculativeGenerator(model, chatml_tokenizer, drawn, compile="graphs")
    gen.device_accept = gen.ahead = True
    gen.generate_batch(
        input_ids=PROMPTS, max_new_tokens=MAX_NEW, tree_for_batch=False, temperature=0.8, seed=1
    )
    runner = TargetRunner(model, (), max_length=64, capacity=2, compile="graphs")
    rows = [
        Row(b, torch.arange(3), 4, SamplingParams(t), None, GenerationStats()) for b, t in enumerate((0, 0.8))
    ]
    batched = build(model, "medusa")  # (batched itself)
    assert depth_for(runner, batched, rows, True, True) == 0  # one greedy row, one sampled
    assert depth_for(runner, batched, rows[1:], True, True) == 1  # sampled over top-k children
    batched.rule = "without_replacement"
    assert depth_for(runner, batched, rows[:1], True, True) == 1  # greedy: not read
    assert depth_for(runner, batched, rows[1:], True, True) == 0  # drawn children
    assert depth_for(runner, batched, rows[1:], True, False) == 0  # accepted on the host: read first
    assert depth_for(runner, batched, rows[1:], False, True) == 0  # not asked to queue
    assert depth_for(runner, None, rows, True, False) == 2  # plain decoding: the next step queued


def test_padding_nodes_are_never_accepted_ahead():
    """A row whose tree has fewer real nodes than the batch's width: its padding never joins its path,
    even where the target's argmax would accept it (greedy), nor is it drawn (sampled)."""
    from spechead.inference.drafters.base import BatchDraft
    from spechead.inference.engine.accept import accept_queued
    from spechead.inference.engine.rows import Row
    from spechead.inference.sampling import SamplingParams
    from spechead.inference.stats import GenerationStats

    tokens = torch.tensor([[5, 1, 2, 3], [5, 1, 2, 3]])  # chains; row 1 holds 2 real nodes
    parents = torch.tensor([[-1, 0, 1, 2], [-1, 0, 1, 2]])
    draft = BatchDraft(tokens, parents, [4, 2])
    logits = torch.full((2, 4, 6), -10.0)
    for i, nxt in enumerate([1, 2, 3, 4]):  # the target agrees with every node
        logits[:, i, nxt] = 10.0
    anc = ancestors_on_device(parents)
    for temperature in (0.0, 1.0):
        rows = [Row(b, tokens[b], 9, SamplingParams(temperature, seed=b), torch.Generator().manual_seed(b),
                     GenerationStats()) for b in range(2)]  # fmt: skip
        accs = accept_queued(draft, logits, anc, rows, size=4).result()
        assert [a.path for a in accs] == [[0, 1, 2, 3], [0, 1]] and accs[1].next_token == 2, temperature


@pytest.mark.parametrize("kind", ["eagle3_static", "medusa_fitted"])
def test_replayed_graphs_decode_a_batch_ahead_like_plain_decoding(
    model,
    chatml_tokenizer,
    replayed_graphs,  # noqa: F811
    kind,
):
    """The target's batch passes and the EAGLE batch draft and accept as replayed graphs (what CUDA would
    capture: every output a buffer the next replay overwrites): a batch decoded ahead still equals plain
    decoding row by row, the graphs replayed."""
    gen = SpeculativeGenerator(model, chatml_tokenizer, drafter_maker(model, kind)(), compile=True)
    gen.device_accept = gen.ahead = True
    gen.eos = set()
    out = gen.generate_batch(input_ids=PROMPTS, max_new_tokens=MAX_NEW, tree_for_batch=False)
    for b, (prompt, n) in enumerate(zip(PROMPTS, MAX_NEW)):
        assert out[b].token_ids == plain_greedy(model, prompt, n), (kind, b)
    used = [g for g in replayed_graphs if g.captures]  # (not the batch-1 runner's: unused here)
    assert len(used) >= (4 if kind == "eagle3_static" else 2)  # verify, commit; the draft, its accept
    assert all(g.replays > g.captures for g in used)
