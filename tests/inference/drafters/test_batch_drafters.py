"""Drafters over B rows (one head call per depth over all rows: EAGLE, Medusa) propose exactly each row's
batch-1 tree: compared pass by pass with a batch of one per row (`OneRowEach`: a clone each) through
mixed prompt lengths, accepted paths of different lengths and rows leaving the batch; and decoding with
them keeps every row's batch-1 passes (accept lengths), not only its tokens."""

from __future__ import annotations

import pytest
import torch

from spechead.heads.fused import grouped_attention as fused_attention
from spechead.inference.drafters.base import BatchDraft, Drafter
from spechead.inference.drafters.eagle import graphs as eagle_graphs
from spechead.inference.drafters.eagle import rows as eagle_rows_module
from spechead.inference.drafters.eagle.graphs import GraphRows
from spechead.inference.drafters.eagle.rows import EagleRows
from spechead.inference.drafters.per_row import clone_drafter
from spechead.inference.drafters.topk import topk_rows
from spechead.inference.engine import loop as loop_module
from spechead.inference.generator import SpeculativeGenerator
from spechead.inference.sampling import SamplingParams

from ..test_batch import MAX_NEW, PROMPTS, make_drafter
from ..test_generator import eagle_drafter, medusa_drafter


@pytest.fixture(scope="module")
def model(tiny_llama, chatml_tokenizer):
    model = tiny_llama(len(chatml_tokenizer), layers=2, hidden=32, seed=3)
    model.generation_config.eos_token_id = None
    return model


def build(model, kind):
    if kind == "medusa":
        return medusa_drafter(model)
    if kind == "eagle_dynamic":
        drafter = eagle_drafter(model, "eagle", top_k=2, depth=4, total_tokens=14)  # keeps depth 3-4
    elif kind == "eagle3_dynamic":
        drafter = eagle_drafter(model, "eagle3", top_k=4, depth=3, total_tokens=12)
    elif kind == "eagle3_layers":  # 3 decoder layers: the head caches hold a layer each
        drafter = eagle_drafter(model, "eagle3", num_layers=3, tree=[[0], [1], [0, 0], [0, 1], [1, 0]])
    else:
        drafter = eagle_drafter(model, "eagle3", tree=[[0], [1], [0, 0], [0, 1], [1, 0], [0, 0, 0]])
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():  # weights at 1/sqrt(fan_in), not 0.02: every input (features too) moves the top-k
        for weight in drafter.head.parameters():
            if weight.dim() == 2:
                weight.copy_(torch.randn(weight.shape, generator=g) / weight.shape[1] ** 0.5)
    return drafter


def fitted_medusa(model, prompts, new_tokens: int = 24, choices=None, decoy: bool = False):
    """A Medusa drafter fitted (a few hundred Adam steps) to the target's own greedy continuations of
    `prompts`: it drafts them well, so decoding accepts whole paths (and stops inside trees). decoy: each
    head also learns, more strongly, the token after the right one, so the right one is its SECOND best
    (accepted paths then run through rank-1 children)."""
    from spechead.inference.target.runner import TargetRunner

    from ..test_generator import plain_greedy

    drafter = medusa_drafter(model, choices)
    head, layer = drafter.head, drafter.hidden_layers[0]
    seqs = [torch.tensor(p + plain_greedy(model, p, new_tokens)) for p in prompts]
    runner = TargetRunner(model, (layer,), max_length=max(s.numel() for s in seqs))
    _, hidden = runner.prefill(seqs)  # inference tensors: a clone trains (autograd saves it)
    hidden = [{k: v.clone() for k, v in states.items()} for states in hidden]
    torch.manual_seed(0)
    opt = torch.optim.Adam(head.parameters(), lr=1e-2)
    for _ in range(300):
        loss = 0.0
        for seq, states in zip(seqs, hidden):
            for k in range(head.num_heads):  # head k at position t predicts token t + 2 + k
                logits = head.head_logits(k, states[layer][None, : -(2 + k)])[0]  # [T - 2 - k, V]
                loss = loss + torch.nn.functional.cross_entropy(logits, seq[2 + k :])
                if decoy:
                    wrong = (seq[2 + k :] + 1) % logits.shape[-1]
                    loss = loss + 2 * torch.nn.functional.cross_entropy(logits, wrong)
        opt.zero_grad()
        loss.backward()
        opt.step()
    head.eval().requires_grad_(False)
    return drafter


class OneRowEach(Drafter):
    """The batch-1 reference of a drafter over B rows: a batch of one per row (a clone each: its own state
    over the same heads), so row b proposes the trees its batch of one does (EAGLE's eager or compiled
    batch of one, Medusa's)."""

    def __init__(self, drafter: Drafter) -> None:
        self.drafter = drafter
        self.rows: list[Drafter] = []

    def start(self, prompts, hidden, roots) -> None:
        self.rows = [clone_drafter(self.drafter) for _ in prompts]
        for row, prompt, states, root in zip(self.rows, prompts, hidden, roots):
            row.start([prompt], [states], [root])

    def propose(self, roots, sampling, generators) -> BatchDraft:
        drafts = [row.propose([r], [s], [g]) for row, r, s, g in zip(self.rows, roots, sampling, generators)]
        assert all(d.tokens.shape[0] == 1 for d in drafts)  # each a batch of one
        tokens = torch.cat([d.tokens for d in drafts])  # [B, N]
        return BatchDraft(tokens, torch.cat([d.parents for d in drafts]), [d.sizes[0] for d in drafts])

    def accept(self, tokens, lengths, hidden, next_roots) -> None:
        for b, row in enumerate(self.rows):
            states = {layer: h[b : b + 1] for layer, h in hidden.items()}
            row.accept(tokens[b : b + 1], [lengths[b]], states, [next_roots[b]])

    def keep(self, rows) -> None:
        self.rows = [self.rows[b] for b in rows]


def states(drafter, lengths, hidden, seed):
    g = torch.Generator().manual_seed(seed)
    return [{layer: torch.randn(n, hidden, generator=g) for layer in drafter.hidden_layers} for n in lengths]


def same(a: BatchDraft, b: BatchDraft) -> None:
    assert a.sizes == b.sizes
    assert torch.equal(a.tokens, b.tokens), (a.tokens, b.tokens)
    assert torch.equal(a.parents, b.parents)


def start_rows(drafter, batch: int) -> None:
    hidden = drafter.head.config.hidden_size
    prompts = [torch.arange(5, 9 + b) for b in range(batch)]
    drafter.start(prompts, states(drafter, [p.numel() for p in prompts], hidden, 0), [3] * batch)


def test_compiled_batch_drafting_is_for_cuda_by_default(model):
    """An eager drafter keeps any number of rows in `EagleRows` (a batch of one is a batch); a compiled
    one drafts a batch of one as graphs, B > 1 rows on a CPU eagerly, the faster there (see
    `EagleDrafter.batch_graphs`); the graphs' rows are kept with their graphs."""
    drafter = build(model, "eagle3_static")
    start_rows(drafter, 1)
    assert type(drafter._rows) is EagleRows
    start_rows(drafter, 2)
    assert type(drafter._rows) is EagleRows
    drafter.use_compile("graphs")
    start_rows(drafter, 2)
    assert type(drafter._rows) is EagleRows and not drafter.queues(2)
    start_rows(drafter, 1)
    assert isinstance(drafter._rows, GraphRows) and drafter.queues(1)
    graphs = drafter._rows
    drafter.batch_graphs = True
    start_rows(drafter, 3)
    assert drafter._rows is graphs and drafter.queues(3)  # kept, with its graphs
    assert drafter.with_tree([[0], [1]]).batch_graphs is True


KINDS = [("medusa", False), ("eagle_dynamic", False), ("eagle3_dynamic", False), ("eagle3_static", False),
         ("eagle3_layers", False)]  # fmt: skip
# compiled EAGLE drafting (drafters/eagle/graphs.py): "graphs" runs the fixed-shape functions as they
# are on a CPU (what a CUDA graph captures), "eager" traces them with dynamo (one graph each: no break)
COMPILED = [
    (kind, c) for kind in ("eagle_dynamic", "eagle3_dynamic", "eagle3_static") for c in ("graphs", "eager")
] + [("eagle3_layers", "graphs")]


@pytest.mark.parametrize(("kind", "compile"), KINDS + COMPILED)
def test_batched_drafter_proposes_every_rows_batch1_tree(model, kind, compile, monkeypatch):
    drafter, reference = build(model, kind), OneRowEach(build(model, kind))
    if compile:
        drafter.use_compile(compile)
        drafter.batch_graphs = True  # (a CPU: by default only on CUDA)
        # the prompts' pairs committed 4 positions at a time: rows end inside a block and sit out others
        monkeypatch.setattr(eagle_graphs, "PROMPT_BLOCK", 4)
    propose_alike(model, drafter, reference)
    if kind != "medusa":
        assert isinstance(drafter._rows, GraphRows if compile else EagleRows)


# a batch of one per row (clones: each compiles its own functions at its start)
CHUNKED = [(kind, c, True) for kind, c in [("eagle_dynamic", False), *COMPILED]] + [
    (kind, c, False) for kind, c in [("eagle_dynamic", False), *COMPILED] if c != "eager"
]


def graph_state(drafter):
    """What the drafter's graphs read besides their arguments (a change drops the captured ones)."""
    return GraphRows(drafter, "graphs")._graph_state()


@pytest.mark.parametrize(("kind", "compile", "batch"), CHUNKED)
def test_a_chunked_topk_proposes_the_same_trees(model, kind, compile, batch, monkeypatch):
    """`topk_chunk` (drafters/topk.py) at batch 1 and batched, eager and compiled: the trees of one topk."""
    drafter, reference = build(model, kind), OneRowEach(build(model, kind))
    before = graph_state(drafter)
    drafter.topk_chunk = 20  # (the tiny vocab: several chunks, the last one partial)
    assert graph_state(drafter) != before  # captured graphs baked the old top-k in: dropped
    assert drafter._vocab % 20 and drafter._vocab > drafter.top_k * 20  # chunked, not one topk
    if compile:
        drafter.use_compile(compile)
        drafter.batch_graphs = True
        monkeypatch.setattr(eagle_graphs, "PROMPT_BLOCK", 4)
    assert drafter.with_tree([[0]]).topk_chunk == 20
    chunks = []  # what every top-k was asked for (the reference: None)

    def counted(x, k, chunk=None):
        chunks.append(chunk)
        return topk_rows(x, k, chunk)

    monkeypatch.setattr(eagle_rows_module, "topk_rows", counted)
    propose_alike(model, drafter if batch else OneRowEach(drafter), reference)
    assert 20 in chunks


@pytest.mark.parametrize(
    ("kind", "compile", "batch"),
    [("eagle3_dynamic", False, False), ("eagle3_dynamic", "eager", True), ("eagle_dynamic", "graphs", True)],
)
def test_few_query_attention_as_matmuls_proposes_the_same_trees(model, kind, compile, batch, monkeypatch):
    """The fused step's attention="matmul" (heads/fused.py `grouped_attention`), at batch 1 and batched,
    eager and compiled: the trees of sdpa; a change of form drops the captured graphs."""
    from spechead.heads import fused

    drafter, reference = build(model, kind), OneRowEach(build(model, kind))
    before = graph_state(drafter)
    drafter.head_step.attention = "matmul"
    assert graph_state(drafter) != before  # captured graphs baked the old form in: dropped
    calls = []
    monkeypatch.setattr(fused, "grouped_attention", lambda *a: calls.append(1) or fused_attention(*a))
    if compile:
        drafter.use_compile(compile)
        drafter.batch_graphs = True
        monkeypatch.setattr(eagle_graphs, "PROMPT_BLOCK", 4)
    propose_alike(model, drafter if batch else OneRowEach(drafter), reference)
    assert calls


def propose_alike(model, batched, reference) -> None:
    """Both drafters (batched: the one tested) through the same mixed-length prompts, accepts and rows
    leaving; every pass proposes the same trees."""
    drafter = reference.drafter
    hidden, vocab = model.config.hidden_size, model.config.vocab_size
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(5, vocab, (n,), generator=g) for n in (9, 1, 14, 3)]
    roots = [11, 12, 13, 14]
    first = states(drafter, [p.numel() for p in prompts], hidden, 2)
    for d in (batched, reference):
        d.start(prompts, first, roots)
    rows = [0, 1, 2, 3]
    # (an accept longer than the compiled drafter's accept graph takes, 16, runs its function eagerly)
    plans = [([3, 1, 5, 2], None), ([1, 4, 2, 1], [2, 0, 3]), ([2, 18, 1], [1, 2]), ([5, 1], None)]
    for lengths, keep in plans:
        greedy = [SamplingParams()] * len(rows)
        same(
            batched.propose(roots, greedy, [None] * len(rows)),
            reference.propose(roots, greedy, [None] * len(rows)),
        )
        k = max(lengths)
        tokens = torch.randint(5, vocab, (len(rows), k), generator=g)  # [B, K] (padded after lengths[b])
        new = {layer: torch.randn(len(rows), k, hidden, generator=g) for layer in drafter.hidden_layers}
        roots = [int(x) for x in torch.randint(5, vocab, (len(rows),), generator=g)]
        for d in (batched, reference):
            d.accept(tokens, lengths, new, roots)
        if keep is not None:  # rows leave (and the order changes)
            for d in (batched, reference):
                d.keep(keep)
            rows, roots = [rows[i] for i in keep], [roots[i] for i in keep]
    same(
        batched.propose(roots, greedy[: len(rows)], [None] * len(rows)),
        reference.propose(roots, greedy[: len(rows)], [None] * len(rows)),
    )
    for d in (batched, reference):  # down to one row (of B: Medusa then takes its batch-of-one path)
        d.keep([1])
        d.accept(tokens[1:, :2], [2], {layer: h[1:, :2] for layer, h in new.items()}, roots[1:])
    same(batched.propose(roots[1:], greedy[:1], [None]), reference.propose(roots[1:], greedy[:1], [None]))


@pytest.mark.parametrize("kind", ["medusa_fitted", "medusa", "eagle_dynamic", "eagle3_static"])
def test_batched_drafting_keeps_every_rows_batch1_passes(model, chatml_tokenizer, kind):
    """Mixed prompt lengths, per-row max_new_tokens, a row stopping at EOS (inside an accepted tree
    with the fitted head): each row's tokens AND accept lengths / drafted counts equal its batch-1 run
    (so its trees were its batch-1 trees)."""
    from ..test_generator import plain_greedy

    drafter = fitted_medusa(model, PROMPTS) if kind == "medusa_fitted" else make_drafter(model, kind)
    gen = SpeculativeGenerator(model, chatml_tokenizer, drafter, cache="static")
    gen.eos = {plain_greedy(model, PROMPTS[0], MAX_NEW[0])[6]}
    for kw in ({}, {"temperature": 0.8, "top_k": 30, "seed": [3, 4, 5, 6]}):
        batch = gen.generate_batch(input_ids=PROMPTS, max_new_tokens=MAX_NEW, **kw)
        for b, (prompt, n) in enumerate(zip(PROMPTS, MAX_NEW)):
            one = {**kw, "seed": kw["seed"][b]} if kw else {}
            single = gen.generate(input_ids=prompt, max_new_tokens=n, **one)
            assert batch[b].token_ids == single.token_ids, (kind, b, kw)
            assert batch[b].stats.accept_lengths == single.stats.accept_lengths, (kind, b, kw)
            assert batch[b].stats.drafted_tokens == single.stats.drafted_tokens, (kind, b, kw)
        if kind == "medusa_fitted" and not kw:  # whole paths accepted; row 0 stopped inside a tree
            assert max(batch[0].stats.accept_lengths) > 2 and min(batch[0].stats.accept_lengths) < 4
            assert all(max(r.stats.accept_lengths) > 1 for r in batch)


def test_rows_accepting_off_the_main_path_keep_their_batch1_passes(model, chatml_tokenizer, monkeypatch):
    """Paths through a rank-1 child are not the tree's first nodes: the states the batch drafter gets
    for its next draft must be the path's rows (not the first K rows), or a row's next trees, and so
    its accept lengths, leave its batch-1 run's (its tokens cannot tell: the target checks them)."""
    bushy = [[0], [1], [0, 1], [1, 0], [1, 1], [1, 1, 0], [1, 1, 1]]
    drafter = fitted_medusa(model, PROMPTS, choices=bushy, decoy=True)
    gen = SpeculativeGenerator(model, chatml_tokenizer, drafter, cache="static")
    gen.eos = set()
    paths = []
    accept_rows = loop_module.accept_rows

    def spy(*args, **kwargs):
        accs = accept_rows(*args, **kwargs)
        paths.extend(a.path for a in accs)
        return accs

    monkeypatch.setattr(loop_module, "accept_rows", spy)
    batch = gen.generate_batch(input_ids=PROMPTS, max_new_tokens=MAX_NEW)
    off_main = sum(path[-1] != len(path) - 1 for path in paths)  # not nodes 0..K-1
    assert off_main >= 3, paths
    for b, (prompt, n) in enumerate(zip(PROMPTS, MAX_NEW)):
        single = gen.generate(input_ids=prompt, max_new_tokens=n)
        assert batch[b].token_ids == single.token_ids, b
        assert batch[b].stats.accept_lengths == single.stats.accept_lengths, b


def test_the_graphs_state_follows_the_steps_rotary_table(model):
    """Every capacity's graphs share the drafter's fused step; a longer head cache makes the step's rotary
    table again, larger (new memory): every graph reading the old one must be captured again, so the
    graphs' state names the table."""
    drafter = build(model, "eagle3_static")
    drafter.use_compile("graphs")
    drafter.batch_graphs = True
    hidden, layers = model.config.hidden_size, drafter.hidden_layers
    drafter.start([torch.arange(5, 15)], [{layer: torch.randn(10, hidden) for layer in layers}], [3])
    drafter.propose([3], [SamplingParams()], [None])
    graphs = drafter._graphs
    assert graphs is not None
    one, table = graphs._graph_state(), drafter.head_step.table
    assert table is not None and table[0].shape[0] == 1024  # the head cache's slots
    long = 1100
    drafter.start(
        [torch.arange(long) % 50 + 5] * 2,
        [{layer: torch.randn(long, hidden) for layer in layers}] * 2,
        [3, 3],
    )
    drafter.propose([3, 3], [SamplingParams()] * 2, [None] * 2)
    assert drafter.head_step.table[0].shape[0] == 2048  # made again for the longer cache's 2048 slots
    angles = (drafter.head_step.table[0].data_ptr(), 2048)
    assert drafter._graphs is graphs and one[-1] != angles and graphs._graph_state()[-1] == angles


def test_stacked_drafts_keep_their_q_on_its_device():
    """BatchDraft.of pads the rows' q [N_b, V] where they are (on a GPU: no copy to the host and back),
    zeros after each row's nodes; checked on the meta device (no data, another device than the trees')."""
    from spechead.inference.drafters.base import Draft
    from spechead.inference.tree import TokenTree

    drafts = [
        Draft(TokenTree(torch.tensor([5, 6, 7]), torch.tensor([-1, 0, 0])), "iid", torch.rand(3, 11)),
        Draft(TokenTree(torch.tensor([8, 9]), torch.tensor([-1, 0])), "iid", torch.rand(2, 11)),
    ]
    stacked = BatchDraft.of(drafts)
    assert stacked.q is not None and stacked.q.shape == (2, 3, 11) and stacked.sizes == [3, 2]
    assert torch.equal(stacked.q[1, :2], drafts[1].q) and not stacked.q[1, 2].any()
    for d in drafts:
        d.q = d.q.to("meta")
    assert BatchDraft.of(drafts).q.device.type == "meta"


def test_stacked_drafts_keep_each_rows_tree_in_its_row():
    """BatchDraft.of over trees of different shapes and sizes: row b holds row b's tokens and parents
    [B, N], padded after its nodes with the root's token and parent 0 (children of the root)."""
    from spechead.inference.drafters.base import Draft
    from spechead.inference.tree import TokenTree

    trees = [([5, 6, 7, 8], [-1, 0, 1, 2]), ([9, 10], [-1, 0]), ([11, 12, 13], [-1, 0, 0])]
    stacked = BatchDraft.of([Draft(TokenTree(torch.tensor(t), torch.tensor(p))) for t, p in trees])
    assert stacked.sizes == [4, 2, 3]
    assert stacked.tokens.tolist() == [[5, 6, 7, 8], [9, 10, 9, 9], [11, 12, 13, 11]]
    assert stacked.parents.tolist() == [[-1, 0, 1, 2], [-1, 0, 0, 0], [-1, 0, 0, 0]]
