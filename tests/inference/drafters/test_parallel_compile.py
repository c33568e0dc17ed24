"""A compiled parallel drafter (P-EAGLE, DFlash; `use_compile`: its propose as ONE fixed-shape function
through `compiling.compile_function`) drafts what the eager one drafts: on a CPU "graphs" runs the
fixed-shape function as it is (what a CUDA graph captures), "replayed" replays it as a recorded CUDA graph
would (test_graph_replay.py: whatever the function read from Python is baked in), "eager" traces it with
dynamo (one graph a shape, no break), True compiles it with inductor; decoding with it equals plain
decoding, greedy and sampled, read first and one draft ahead."""

from __future__ import annotations

import pytest
import torch
from torch._dynamo.utils import counters

from spechead.inference.generator import SpeculativeGenerator

from ..test_batch import MAX_NEW, PROMPTS
from ..test_generator import plain_greedy
from ..test_graph_replay import replayed_graphs  # noqa: F401 - the fixture
from .parallel_heads import KINDS, dflash_head, parallel_drafter, peagle_head
from .test_batch_drafters import OneRowEach, propose_alike
from .test_parallel_lossless import ProposesTwice

# one worker fits the module's heads (`--dist loadgroup`), not every worker that runs one of its tests
pytestmark = pytest.mark.xdist_group("parallel_compile")

TREES = ["peagle_tree", "dflash_tree"]


@pytest.fixture(scope="module")
def model(tiny_llama, chatml_tokenizer):
    model = tiny_llama(len(chatml_tokenizer), layers=2, hidden=32, seed=3)
    model.generation_config.eos_token_id = None
    return model


@pytest.fixture(scope="module")
def heads(model):
    """{"peagle": head, "dflash": head} fitted to the target's greedy continuations of PROMPTS."""
    return {"peagle": peagle_head(model, PROMPTS), "dflash": dflash_head(model, PROMPTS)}


def drafter(heads, kind: str, compile: bool | str = False):
    made = parallel_drafter(heads[kind.split("_")[0]], kind)
    made.use_compile(compile)
    return made


def counted(d) -> list[int]:
    """The calls of `d`'s compiled draft from now on (one entry a call)."""
    calls, run = [], d._draft_fn
    d._draft_fn = lambda *args: (calls.append(1), run(*args))[1]
    return calls


def compiled_drafts_equal_eager_drafts(model, heads, kind, compile) -> None:
    """Pass by pass through mixed prompt lengths, accepts and rows leaving (`propose_alike`): the compiled
    drafter's B rows = the eager drafter's batches of one, most passes through the compiled function."""
    compiled = drafter(heads, kind, compile)
    assert compiled._draft_fn != compiled._tokens or compile == "graphs"
    calls = counted(compiled)
    propose_alike(model, compiled, OneRowEach(drafter(heads, kind)))
    # 6 passes; P-EAGLE's first (the prompts: no buffers yet) and one after an accept of 18 run eagerly
    assert len(calls) == (4 if kind.startswith("peagle") else 6), len(calls)
    assert compiled.with_tree([[0]])._compile == compile


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("compile", ["graphs", "eager"])
def test_compiled_drafts_equal_eager_drafts(model, heads, kind, compile):
    """Compiled "eager": dynamo traced the draft, graphs and no break, one per (rows, slots) shape."""
    torch._dynamo.reset()
    counters.clear()
    compiled_drafts_equal_eager_drafts(model, heads, kind, compile)
    graphs = counters["stats"]["unique_graphs"]
    if compile == "eager":
        assert 1 <= graphs <= 8 and not counters["graph_break"], (graphs, dict(counters["graph_break"]))
    else:
        assert graphs == 0


@pytest.mark.parametrize("kind", TREES)
def test_replayed_draft_graphs_draft_the_eager_trees(model, heads, kind, replayed_graphs):  # noqa: F811
    """The draft as a replayed CUDA graph, every pass proposed twice (the second a replay of the first's
    graph over the same buffers: a pass again, as calibration times it): the eager drafter's trees."""
    compiled = drafter(heads, kind, "graphs")
    propose_alike(model, ProposesTwice(compiled), OneRowEach(drafter(heads, kind)))
    (draft,) = replayed_graphs
    assert draft.fn.__name__ == "_tokens" and draft.replays >= draft.captures >= 1


@pytest.mark.slow
def test_inductor_drafts_equal_eager_drafts(model, heads):
    """compile=True: inductor's generated code, P-EAGLE's (a C++ compile a shape on a CPU: about a minute
    with a cold inductor cache, seconds with a warm one; slow, so `-m "not slow"` leaves it out)."""
    torch._dynamo.reset()
    compiled_drafts_equal_eager_drafts(model, heads, "peagle_tree", True)


@pytest.mark.parametrize("kind", TREES)
@pytest.mark.parametrize("compile", ["graphs", "eager"])
def test_decoding_with_a_compiled_draft_equals_plain_decoding(model, chatml_tokenizer, heads, kind, compile):
    """Greedy at a batch of one and of rows of mixed prompt lengths: plain greedy decoding, the passes of
    the eager drafter; seeded sampling: the eager drafter's draws (its law: test_parallel_lossless.py)."""
    eager, compiled = (
        SpeculativeGenerator(model, chatml_tokenizer, drafter(heads, kind), draft_compile=c)
        for c in (False, compile)
    )
    assert compiled.drafter._compile == compile and eager.drafter._compile is False
    calls = counted(compiled.drafter)
    for gen in (eager, compiled):
        gen.eos = set()
    single = compiled.generate(input_ids=PROMPTS[1], max_new_tokens=MAX_NEW[1])
    assert single.token_ids == plain_greedy(model, PROMPTS[1], MAX_NEW[1])
    rows, refs = (g.generate_batch(input_ids=PROMPTS, max_new_tokens=MAX_NEW) for g in (compiled, eager))
    for b, (prompt, n) in enumerate(zip(PROMPTS, MAX_NEW)):
        assert rows[b].token_ids == plain_greedy(model, prompt, n), b
        assert rows[b].stats.accept_lengths == refs[b].stats.accept_lengths, b
    assert max(max(r.stats.accept_lengths) for r in rows) > 2
    kw = {"temperature": 0.8, "top_k": 30, "seed": [3, 4, 5, 6]}
    rows, refs = (
        g.generate_batch(input_ids=PROMPTS, max_new_tokens=MAX_NEW, **kw) for g in (compiled, eager)
    )
    for b in range(len(PROMPTS)):
        assert rows[b].token_ids == refs[b].token_ids, b
        assert rows[b].stats.accept_lengths == refs[b].stats.accept_lengths, b
    assert len(calls) > 10


@pytest.mark.parametrize("kind", TREES)
def test_replayed_graphs_decode_ahead_like_plain_decoding(model, chatml_tokenizer, heads, kind,
                                                          replayed_graphs):  # noqa: F811  # fmt: skip
    """The target's passes and the draft as replayed graphs, one draft ahead (the queued accept: paths
    padded to P on the device): a batch of one and a batch of rows equal plain decoding."""
    gen = SpeculativeGenerator(model, chatml_tokenizer, drafter(heads, kind), compile=True)
    gen.device_accept = gen.ahead = True
    gen.eos = set()
    out = gen.generate(input_ids=PROMPTS[2], max_new_tokens=MAX_NEW[2])
    assert out.token_ids == plain_greedy(model, PROMPTS[2], MAX_NEW[2])
    rows = gen.generate_batch(input_ids=PROMPTS, max_new_tokens=MAX_NEW, tree_for_batch=False)
    for b, (prompt, n) in enumerate(zip(PROMPTS, MAX_NEW)):
        assert rows[b].token_ids == plain_greedy(model, prompt, n), (kind, b)
    assert max(max(r.stats.accept_lengths) for r in rows) > 2
    draft = [g for g in replayed_graphs if g.fn.__name__ == "_tokens"]
    assert len(draft) == 1 and draft[0].replays >= 1 and draft[0].captures >= 1


@pytest.mark.parametrize("ahead", [False, True], ids=["read-first", "ahead"])
@pytest.mark.parametrize("kind", TREES)
def test_rows_leaving_replay_the_batchs_draft_graph(model, chatml_tokenizer, heads, kind, ahead,
                                                    replayed_graphs):  # noqa: F811  # fmt: skip
    """Compiled, the draft's buffers keep the batch's capacity of rows: rows that finish go idle, so the
    graph captured for the batch replays while it shrinks (a capture per batch size would hold a CUDA
    graph's memory each and pay its capture every pass), and a second batch of that capacity replays it
    too; the output stays plain greedy decoding."""
    d = drafter(heads, kind)  # (compiled by the generator)
    gen = SpeculativeGenerator(model, chatml_tokenizer, d, compile=True)
    gen.device_accept = gen.ahead = ahead
    gen.eos = set()
    sizes, draft = [], d._draft
    d._draft = lambda roots: (sizes.append(roots.shape[0]), draft(roots))[1]
    rows = gen.generate_batch(input_ids=PROMPTS, max_new_tokens=MAX_NEW, tree_for_batch=False)
    for b, (prompt, n) in enumerate(zip(PROMPTS, MAX_NEW)):
        assert rows[b].token_ids == plain_greedy(model, prompt, n), b
    (graph,) = [g for g in replayed_graphs if g.fn.__name__ == "_tokens"]
    first = graph.captures  # (P-EAGLE: its cache may grow once as the longest row decodes)
    assert len(set(sizes)) >= 3 and 1 <= first <= 2, (sizes, first)
    replays = graph.replays
    again = gen.generate_batch(input_ids=PROMPTS, max_new_tokens=MAX_NEW, tree_for_batch=False)
    assert [r.token_ids for r in again] == [r.token_ids for r in rows]
    assert graph.captures == first and graph.replays > replays
