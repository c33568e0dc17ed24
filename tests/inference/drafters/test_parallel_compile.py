"""A compiled DFlash drafter (`use_compile`: its propose as ONE fixed-shape function through
`compiling.compile_function`) drafts what the eager one drafts: on a CPU "graphs" runs the fixed-shape
function as it is (what a CUDA graph captures), "eager" traces it with dynamo (one graph a shape, no
break); decoding with it equals plain decoding."""

from __future__ import annotations

import pytest
import torch
from torch._dynamo.utils import counters

from spechead.inference.generator import SpeculativeGenerator

from ..test_batch import MAX_NEW, PROMPTS
from ..test_generator import plain_greedy
from .parallel_heads import dflash_head, parallel_drafter
from .test_batch_drafters import OneRowEach, propose_alike


@pytest.fixture(scope="module")
def model(tiny_llama, chatml_tokenizer):
    model = tiny_llama(len(chatml_tokenizer), layers=2, hidden=32, seed=3)
    model.generation_config.eos_token_id = None
    return model


@pytest.fixture(scope="module")
def head(model):
    return dflash_head(model, PROMPTS)


@pytest.mark.parametrize("kind", ["dflash_chain", "dflash_tree"])
@pytest.mark.parametrize("compile", ["graphs", "eager"])
def test_compiled_drafts_equal_eager_drafts(model, head, kind, compile):
    """Pass by pass through mixed prompt lengths, accepts and rows leaving (`propose_alike`): the compiled
    drafter's B rows = the eager drafter's batches of one; "eager" traced the draft, graphs and no break."""
    compiled = parallel_drafter(head, kind)
    compiled.use_compile(compile)
    assert compiled._draft_fn != compiled._tokens or compile == "graphs"
    torch._dynamo.reset()
    counters.clear()
    propose_alike(model, compiled, OneRowEach(parallel_drafter(head, kind)))
    graphs = counters["stats"]["unique_graphs"]
    if compile == "eager":  # one graph per (rows, buffer slots) shape: a few, never one per pass
        assert 1 <= graphs <= 8 and not counters["graph_break"], (graphs, dict(counters["graph_break"]))
    else:
        assert graphs == 0
    assert compiled.with_tree([[0]])._compile == compile


@pytest.mark.parametrize("compile", ["graphs", "eager"])
def test_decoding_with_a_compiled_draft_equals_plain_decoding(model, chatml_tokenizer, head, compile):
    drafter = parallel_drafter(head, "dflash_tree")
    gen = SpeculativeGenerator(model, chatml_tokenizer, drafter, draft_compile=compile)
    assert drafter._compile == compile
    gen.eos = set()
    rows = gen.generate_batch(input_ids=PROMPTS, max_new_tokens=MAX_NEW)
    for b, (prompt, n) in enumerate(zip(PROMPTS, MAX_NEW)):
        assert rows[b].token_ids == plain_greedy(model, prompt, n), b
    assert max(max(r.stats.accept_lengths) for r in rows) > 2
