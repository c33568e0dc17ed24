"""EAGLE and Medusa decoding with the next draft queued before the host reads the acceptance
(engine/loop.py depth 1), forced on a CPU (the default on CUDA only): the acceptance computed on the device
is the greedy rule, or rule A's draws; the drafters' queued accept and draft (`accept_queued`,
`propose_queued`, `settle`: a compiled EAGLE drafter's graphs, Medusa's own) equal `accept_paths` and
`propose` read first; decoding equals plain decoding with the same accepted lengths as the loop that reads
first, also as replayed graphs."""

from __future__ import annotations

import pytest
import torch

from spechead.inference.acceptance import greedy_accept
from spechead.inference.drafters.medusa import MedusaDrafter
from spechead.inference.engine import loop as loop_module
from spechead.inference.generator import SpeculativeGenerator
from spechead.inference.queued_acceptance import QueuedAcceptance
from spechead.inference.sampling import SamplingParams
from spechead.inference.tree import TokenTree, ancestors_on_device, tree_from_choices

from ..test_generator import eagle_drafter, medusa_drafter, plain_greedy
from ..test_graph_replay import replayed_graphs  # noqa: F401 - the fixture

CHOICES = [[0], [1], [2], [0, 0], [0, 1], [1, 0], [0, 0, 0], [0, 1, 0], [1, 0, 0], [0, 0, 0, 0]]
TREES = {
    "eagle_static": ("eagle", {"tree": CHOICES}),
    "eagle_dynamic": ("eagle", {"top_k": 3, "depth": 4, "total_tokens": 12}),
    "eagle3_static": ("eagle3", {"tree": CHOICES}),
}
MEDUSA_CHOICES = [[0], [1], [0, 0], [0, 1], [1, 0], [0, 0, 0], [0, 1, 0]]


def drafter(model, kind: str):
    """A fresh drafter of one of TREES' kinds, or "medusa" (three heads on MEDUSA_CHOICES)."""
    if kind == "medusa":
        return medusa_drafter(model, MEDUSA_CHOICES)
    family, options = TREES[kind]
    return eagle_drafter(model, family, **options)


@pytest.fixture(scope="module")
def model(tiny_llama, chatml_tokenizer):
    m = tiny_llama(len(chatml_tokenizer), layers=2, hidden=64, seed=1)
    m.generation_config.eos_token_id = None
    return m


def test_the_queued_acceptance_is_the_greedy_rule():
    """Trees whose target argmaxes accept a chosen node (off the main path too): the host form equals
    the host walk's `greedy_accept`, and the device path is its nodes ascending, then the deepest
    repeated."""
    gen = torch.Generator().manual_seed(0)
    tree = tree_from_choices(CHOICES)
    parents = tree.parents  # [N]
    n, vocab = parents.shape[0], 50
    anc = ancestors_on_device(parents[None])[0]  # [N, N]
    for target in range(n):
        tokens = torch.randint(0, vocab, (n,), generator=gen)
        logits = torch.randn(n, vocab, generator=gen)
        for node in anc[target].nonzero().flatten().tolist()[1:]:  # the target node's path is the argmax
            logits[parents[node], tokens[node]] = 10.0
        queued = QueuedAcceptance.greedy(tokens[None], parents[None], anc[None], logits[None], size=16)
        expected = greedy_accept(TokenTree(tokens, parents), logits)
        (got,) = queued.result()
        assert got == expected and got.path_tokens == expected.path_tokens
        k = len(expected.path)
        assert queued.k.tolist() == [k] and queued.next_token.tolist() == [expected.next_token]
        assert queued.path.shape == (1, 16)
        assert queued.path[0].tolist() == expected.path + [expected.path[-1]] * (16 - k)


def test_the_queued_sampled_acceptance_draws_what_rule_a_draws():
    """Rule A's device path (its draws are the host walk's coin for coin: test_queued_acceptance.py):
    its nodes ascending, then the deepest repeated, as the host form reads it; probs without mass are
    refused when read."""
    tree = tree_from_choices(CHOICES)
    parents, n = tree.parents, tree.parents.shape[0]
    anc = ancestors_on_device(parents[None])[0]  # [N, N]
    for seed in range(20):
        gen = torch.Generator().manual_seed(seed)
        tokens = torch.randint(0, 6, (n,), generator=gen)  # a small vocab: many children accepted
        probs = torch.softmax(torch.randn(n, 6, generator=gen) * 2, -1)
        queued = QueuedAcceptance.sampled(
            tokens[None], parents[None], anc[None], probs[None], [torch.Generator().manual_seed(seed)], 16
        )
        (got,) = queued.result()
        k = len(got.path)
        assert got.path_tokens == tokens[got.path].tolist() and int(queued.next_token) == got.next_token
        assert queued.path[0].tolist() == got.path + [got.path[-1]] * (16 - k) and int(queued.k) == k
    empty = QueuedAcceptance.sampled(
        tokens[None], parents[None], anc[None], torch.zeros(1, n, 6), [torch.Generator()], 16
    )
    assert 0 <= int(empty.next_token) < 6  # (clamped for the queued ops)
    with pytest.raises(ValueError, match="no positive finite mass"):
        empty.result()


@pytest.mark.parametrize("kind", list(TREES))
def test_the_queued_head_commit_and_draft_equal_accept_path_and_propose(model, kind):
    """Two drafters of one head, a batch of one: one eager, hearing paths on the host (`accept_paths`,
    `propose`), the other compiled, from device tensors (`accept_queued`, `propose_queued`, `settle`: its
    graphs); off-main-path nodes, several rounds: the same trees, features and counts."""
    family, options = TREES[kind]
    host, queued = eagle_drafter(model, family, **options), eagle_drafter(model, family, **options)
    queued.use_compile("graphs")  # (a CPU: the fixed-shape graph functions, eager)
    assert queued.queues(1) and queued.commit_width == 8  # paths of at most 5 nodes
    assert not host.queues(1)  # eager: no fixed-shape commit
    gen = torch.Generator().manual_seed(1)
    h = model.config.hidden_size
    prompt = torch.arange(5, 17)
    states = {layer: torch.randn(1, 12, h, generator=gen) for layer in host.hidden_layers}
    for d in (host, queued):
        d.start([prompt], [{k: v[0] for k, v in states.items()}], [7])
    greedy = [SamplingParams()]
    drafts = [d.propose([7], greedy, [None]) for d in (host, queued)]  # the first: from the host
    rows = queued._graphs._capacity  # the compiled rows' state: features [1, H], host lengths [1]
    for path in ([0, 2, 5], [0], [0, 1, 4, 7, 10], [0, 3], [0, 1, 3, 6, 9]):
        assert drafts[1].tokens.tolist() == drafts[0].tokens.tolist(), path
        assert drafts[1].parents.tolist() == drafts[0].parents.tolist(), path
        n = drafts[0].tokens.shape[1]
        hidden = {layer: torch.randn(1, n, h, generator=gen) for layer in host.hidden_layers}
        tokens = torch.randint(0, model.config.vocab_size, (1, n), generator=gen)
        nxt = int(torch.randint(0, model.config.vocab_size, (1,), generator=gen))
        host.accept_paths([[int(t) for t in tokens[0, path]]], hidden, [path], [nxt])
        padded = torch.tensor([path + [path[-1]] * (max(n, 8) - len(path))])  # [1, >= P]
        queued.accept_queued(hidden, tokens, padded, torch.tensor([len(path)]), torch.tensor([nxt]))
        torch.testing.assert_close(rows.feature, host._rows.feature, atol=1e-5, rtol=1e-5)
        drafts = [host.propose([nxt], greedy, [None]), queued.propose_queued(torch.tensor([nxt]))]
        queued.settle([len(path)])  # (after the draft, as the engine reads the acceptance)
        assert rows.lengths.tolist() == host._rows.lengths
    assert drafts[1].tokens.tolist() == drafts[0].tokens.tolist()


@pytest.mark.parametrize(
    "choices", [MEDUSA_CHOICES, [[0], [1], [2], [0, 0], [1, 0], [0, 0, 0]], [[0]], [[0, 0, 0, 0]]]
)  # (the last: deeper than the 3 heads, a root-only tree)
def test_the_queued_medusa_accept_and_draft_equal_accept_path_and_propose(model, choices):
    """Two batches of one over one set of heads: one hears paths on the host (`accept_paths`, `propose`),
    the other from device tensors (`accept_queued`, `propose_queued`); paths off the main path, several
    rounds."""
    host, queued = medusa_drafter(model, choices), medusa_drafter(model, choices)
    assert queued.queues(1) and queued.commit_width == 1
    gen = torch.Generator().manual_seed(2)
    h, vocab = model.config.hidden_size, model.config.vocab_size
    states = {host.hidden_layers[0]: torch.randn(1, 12, h, generator=gen)}
    for d in (host, queued):
        d.start([torch.arange(5, 17)], [{k: v[0] for k, v in states.items()}], [7])
    greedy = [SamplingParams()]
    drafts = [d.propose([7], greedy, [None]) for d in (host, queued)]  # the first: from the host
    n, kept = drafts[0].tokens.shape[1], drafts[1].parents
    paths = [p for p in ([0, 2, 4], [0], [0, 1, 3, 5], [0, 2], [0, 1], [0, 1, 3]) if p[-1] < n]
    for path in paths:
        assert drafts[1].tokens.tolist() == drafts[0].tokens.tolist(), path
        hidden = {host.hidden_layers[0]: torch.randn(1, n, h, generator=gen)}
        tokens = torch.randint(0, vocab, (1, n), generator=gen)
        nxt = int(torch.randint(0, vocab, (1,), generator=gen))
        host.accept_paths([[int(t) for t in tokens[0, path]]], hidden, [path], [nxt])
        padded = torch.tensor([path + [path[-1]] * (n - len(path))])  # [1, N]
        queued.accept_queued(hidden, tokens, padded, torch.tensor([len(path)]), torch.tensor([nxt]))
        torch.testing.assert_close(queued.last_hidden, host.last_hidden)
        drafts = [host.propose([nxt], greedy, [None]), queued.propose_queued(torch.tensor([nxt]))]
        queued.settle([len(path)])
        assert drafts[1].parents.tolist() == drafts[0].parents.tolist()
        assert drafts[1].parents is kept  # read first or queued: the one kept [1, N]
    assert drafts[1].tokens.tolist() == drafts[0].tokens.tolist()
    assert drafts[1].tokens[0, 0] == nxt


@pytest.mark.parametrize("kind", [*TREES, "medusa"])
def test_decoding_ahead_equals_plain_decoding_with_the_same_passes(
    model, chatml_tokenizer, kind, monkeypatch
):
    ahead = SpeculativeGenerator(model, chatml_tokenizer, drafter(model, kind), compile="graphs")
    first = SpeculativeGenerator(model, chatml_tokenizer, drafter(model, kind), compile="graphs")
    assert not ahead.ahead  # a CPU's default: the loop that reads first
    for g in (ahead, first):
        g.device_accept = True
    ahead.ahead = True
    queued, passes = [], 0
    runner_class = type(ahead.runner)  # (every row capacity's runner is a TargetRunner)
    commit = runner_class.commit_queued
    monkeypatch.setattr(
        runner_class, "commit_queued", lambda self, path: (queued.append(path.shape[0]), commit(self, path))
    )
    for i, n in enumerate((1, 2, 9, 30)):
        prompt = list(range(5 + i, 15 + 3 * i))
        out, ref = (g.generate(input_ids=prompt, max_new_tokens=n) for g in (ahead, first))
        assert out.token_ids == ref.token_ids == plain_greedy(model, prompt, n), (kind, n)
        assert out.stats.accept_lengths == ref.stats.accept_lengths and out.stats.new_tokens == n
        assert out.stats.drafted_tokens == ref.stats.drafted_tokens
        assert n < 9 or (out.stats.draft_time > 0 and out.stats.verify_time > 0)  # the phases are timed
        passes += len(out.stats.accept_lengths)
    assert len(queued) == passes > 0  # every pass committed from the device


@pytest.mark.parametrize("kind", [*TREES, "medusa"])
def test_trees_cut_at_a_fixed_caches_end_count_and_commit_as_the_loop_that_reads_first(
    model, chatml_tokenizer, kind
):
    """A fixed cache of exactly prompt + max_new_tokens: the last passes' trees are cut to the room left
    (the first nodes, lossless); ahead, the cut tree is what is counted as drafted and committed."""
    prompt, n = list(range(7, 19)), 20
    gens = [
        SpeculativeGenerator(model, chatml_tokenizer, drafter(model, kind), compile="graphs",
                             max_cache_len=len(prompt) + n)
        for _ in range(2)
    ]  # fmt: skip
    ahead, first = gens
    for g in gens:
        g.device_accept = True
    ahead.ahead = True
    out, ref = (g.generate(input_ids=prompt, max_new_tokens=n) for g in gens)
    assert out.token_ids == ref.token_ids == plain_greedy(model, prompt, n), kind
    assert out.stats.accept_lengths == ref.stats.accept_lengths
    assert out.stats.drafted_tokens == ref.stats.drafted_tokens


@pytest.mark.parametrize("kind", ["eagle_static", "eagle_dynamic", "medusa"])
def test_sampling_ahead_draws_what_the_loop_that_reads_first_draws(model, chatml_tokenizer, kind):
    ahead, first = (
        SpeculativeGenerator(model, chatml_tokenizer, drafter(model, kind), compile="graphs")
        for _ in range(2)
    )
    for g in (ahead, first):
        g.device_accept = True
    ahead.ahead = True
    for seed in range(3):
        kw = {"input_ids": list(range(5 + seed, 17)), "max_new_tokens": 24, "seed": seed, "temperature": 0.9,
              "top_k": 20}  # fmt: skip
        out, ref = ahead.generate(**kw), first.generate(**kw)
        assert out.token_ids == ref.token_ids and out.stats.accept_lengths == ref.stats.accept_lengths


def test_an_eos_inside_an_accepted_path_stops_ahead_at_it(model, chatml_tokenizer):
    ahead = SpeculativeGenerator(
        model, chatml_tokenizer, eagle_drafter(model, "eagle", tree=CHOICES), compile="graphs"
    )
    ahead.device_accept = ahead.ahead = True
    prompt = list(range(9, 21))
    full = plain_greedy(model, prompt, 30)
    for at in (0, 3, 11):
        ahead.eos = {full[at]}
        out = ahead.generate(input_ids=prompt, max_new_tokens=30).token_ids
        assert out == full[: full.index(full[at]) + 1]


def test_ahead_only_where_it_can_run(model, chatml_tokenizer, monkeypatch):
    """Drawn children, an eager drafter, an eager target, a Medusa subclass: the loop that reads first."""

    def no_ahead(*args, **kwargs):
        raise AssertionError("the loop queued the next draft")

    monkeypatch.setattr(loop_module, "accept_queued", no_ahead)
    prompt = list(range(5, 15))
    for compile, draft_compile, kw, rule in (
        ("graphs", None, {"temperature": 0.8, "seed": 1}, "without_replacement"),
        (False, False, {}, "deterministic"),
        (False, "graphs", {}, "deterministic"),
    ):
        drafter = eagle_drafter(model, "eagle", tree=CHOICES, rule=rule)
        gen = SpeculativeGenerator(
            model, chatml_tokenizer, drafter, compile=compile, draft_compile=draft_compile
        )
        gen.device_accept = gen.ahead = True
        gen.generate(input_ids=prompt, max_new_tokens=8, **kw)

    class HearsMore(MedusaDrafter):  # a subclass may hear paths its own way
        pass

    medusa = medusa_drafter(model, MEDUSA_CHOICES)
    assert not HearsMore(medusa.head, MEDUSA_CHOICES).queues(1) and medusa.queues(1)
    for compile, d in (("graphs", HearsMore(medusa.head, MEDUSA_CHOICES)), (False, medusa)):
        gen = SpeculativeGenerator(model, chatml_tokenizer, d, compile=compile)
        gen.device_accept = gen.ahead = True
        gen.generate(input_ids=prompt, max_new_tokens=8)


@pytest.mark.parametrize("kind", ["eagle_static", "medusa"])
def test_replayed_graphs_decode_ahead_like_plain_decoding(model, chatml_tokenizer, replayed_graphs, kind):  # noqa: F811
    """The target's verify and commit and the head's commit and draft as replayed graphs (what CUDA would
    capture; Medusa's heads run eager): decoding ahead still equals plain decoding, the graphs replayed."""
    gen = SpeculativeGenerator(model, chatml_tokenizer, drafter(model, kind), compile=True)
    gen.device_accept = gen.ahead = True
    for i in range(3):
        prompt = list(range(5 + i, 15 + 2 * i))
        assert gen.generate(input_ids=prompt, max_new_tokens=20).token_ids == plain_greedy(model, prompt, 20)
    assert all(g.replays > g.captures >= 1 for g in replayed_graphs)


def test_a_budget_ending_inside_an_accepted_path_cuts_it_as_the_loop_that_reads_first(
    model, chatml_tokenizer
):
    """max_new_tokens reached in the middle of a pass's accepted tokens: only the budget's share is
    emitted, counted and recorded as that pass's length (Medusa here accepts 2-token paths now and then)."""
    gens = [
        SpeculativeGenerator(model, chatml_tokenizer, drafter(model, "medusa"), compile="graphs")
        for _ in "ab"
    ]
    ahead, first = gens
    for g in gens:
        g.device_accept = True
    ahead.ahead = True
    prompt = list(range(6, 19))
    lengths = ahead.generate(input_ids=prompt, max_new_tokens=40).stats.accept_lengths
    long = next(i for i, k in enumerate(lengths) if k >= 2)  # the first pass accepting a drafted token
    n = 1 + sum(lengths[:long]) + 1  # the root, the passes before it, then one of its tokens
    out, ref = (g.generate(input_ids=prompt, max_new_tokens=n) for g in gens)
    assert out.token_ids == ref.token_ids == plain_greedy(model, prompt, n)
    assert out.stats.new_tokens == ref.stats.new_tokens == n
    assert out.stats.accept_lengths == ref.stats.accept_lengths == [*lengths[:long], 1]  # that pass: 1


def test_only_a_compiled_eagle_drafter_itself_with_paths_up_to_graph_commit_runs_ahead(model):
    """P = the power of two above the tree's depth: up to GRAPH_COMMIT (16: depth 15) the head's commit
    is a graph and the drafter runs ahead; deeper trees, eager drafters, B > 1 rows drafted eagerly (a
    CPU's default) and subclasses (which may hear paths their own way) keep the loop that reads first."""
    from spechead.inference.drafters.eagle import EagleDrafter
    from spechead.inference.drafters.eagle.graphs import GRAPH_COMMIT

    head = eagle_drafter(model, "eagle").head

    class HearsMore(EagleDrafter):
        pass

    for depth, ahead in ((15, True), (16, False)):
        d = EagleDrafter(head, top_k=2, depth=depth, total_tokens=8)
        d.use_compile("graphs")
        assert (d.commit_width <= GRAPH_COMMIT) == d.queues(1) == ahead, depth
        assert not d.queues(2)  # (a CPU: B > 1 rows draft eagerly)
        d.batch_graphs = True
        assert d.queues(2) == ahead
    sub = HearsMore(head, tree=CHOICES)
    sub.use_compile("graphs")
    assert not sub.queues(1)
    assert not EagleDrafter(head, tree=CHOICES).queues(1)  # eager: no fixed-shape commit


def test_after_settle_the_drafter_goes_on_from_the_host_as_one_that_heard_the_path_there(model):
    """`settle` leaves the host's bookkeeping as `accept_paths` would (the counts), so the drafter can be
    driven from the host again (the loop that reads first, a later decode)."""
    host, queued = (eagle_drafter(model, "eagle", tree=CHOICES) for _ in range(2))
    for d in (host, queued):
        d.use_compile("graphs")
    gen, h = torch.Generator().manual_seed(2), model.config.hidden_size
    states = {layer: torch.randn(12, h, generator=gen) for layer in host.hidden_layers}
    greedy = [SamplingParams()]
    for d in (host, queued):
        d.start([torch.arange(5, 17)], [states], [7])
        d.propose([7], greedy, [None])
    n, path, nxt = len(CHOICES) + 1, [0, 1, 4], 11
    hidden = {layer: torch.randn(1, n, h, generator=gen) for layer in host.hidden_layers}
    tokens = torch.randint(0, model.config.vocab_size, (1, n), generator=gen)
    host.accept_paths([[int(t) for t in tokens[0, path]]], hidden, [path], [nxt])
    queued.accept_queued(
        hidden, tokens, torch.tensor([path + [path[-1]] * 8]), torch.tensor([3]), torch.tensor([nxt])
    )
    queued.propose_queued(torch.tensor([nxt]))
    queued.settle([3])
    drafts = [d.propose([nxt], greedy, [None]) for d in (host, queued)]  # from the host now
    assert drafts[1].tokens.tolist() == drafts[0].tokens.tolist()
    assert queued._graphs._capacity.lengths.tolist() == host._graphs._capacity.lengths.tolist() == [12 + 3]
