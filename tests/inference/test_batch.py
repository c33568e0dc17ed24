"""Batch > 1 decoding is lossless: every row equals its batch-1 output (== HF greedy) with mixed prompt
lengths, per-row max_new_tokens, a row stopping at EOS inside an accepted tree while others go on;
seeded sampling rows equal their batch-1 draws; bad input gets one clear line."""

from __future__ import annotations

import pytest

from spechead.inference.drafters.draft_model import DraftModelDrafter
from spechead.inference.generator import SpeculativeGenerator

from .test_generator import eagle_drafter, medusa_drafter, plain_greedy

PROMPTS = [
    [7, 9, 11, 13, 15, 17, 19, 21, 23],
    [40],
    [5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18],
    [33, 34, 35],
]
MAX_NEW = [14, 9, 20, 5]


@pytest.fixture(scope="module")
def setup(tiny_llama, chatml_tokenizer):
    model = tiny_llama(len(chatml_tokenizer), layers=2, hidden=32, seed=3)
    model.generation_config.eos_token_id = None
    return model, chatml_tokenizer


def make_drafter(model, kind):
    if kind == "plain":
        return None
    if kind == "medusa":
        return medusa_drafter(model)
    if kind == "draft_model_self":  # drafts the target's own argmax: whole trees accepted
        return DraftModelDrafter(model, num_draft=4)
    if kind == "eagle_dynamic":
        return eagle_drafter(model, "eagle", top_k=4, depth=4, total_tokens=12)
    return eagle_drafter(model, "eagle3", tree=[[0], [1], [0, 0], [0, 1], [0, 0, 0]])


@pytest.mark.parametrize("kind", ["plain", "medusa", "draft_model_self", "eagle_dynamic", "eagle3_static"])
def test_greedy_batch_equals_batch1_and_hf(setup, kind):
    model, tok = setup
    gen = SpeculativeGenerator(model, tok, make_drafter(model, kind), cache="static")
    # row 0 stops at an EOS in the middle of its output (inside a tree when drafts are accepted)
    eos = plain_greedy(model, PROMPTS[0], MAX_NEW[0])[6]
    gen.eos = {eos}
    batch = gen.generate_batch(input_ids=PROMPTS, max_new_tokens=MAX_NEW)
    for b, (prompt, n) in enumerate(zip(PROMPTS, MAX_NEW)):
        hf = plain_greedy(model, prompt, n, eos=eos)
        single = gen.generate(input_ids=prompt, max_new_tokens=n).token_ids
        assert batch[b].token_ids == single == hf, (kind, b)
        assert batch[b].stats.new_tokens == len(hf)
    assert len(batch[0].token_ids) == 7 and batch[0].token_ids[-1] == eos  # stopped early, others went on
    assert len(batch[2].token_ids) == 20 or eos in batch[2].token_ids
    if kind == "draft_model_self":
        assert max(batch[0].stats.accept_lengths) > 1  # the EOS row accepted whole trees


@pytest.mark.parametrize("compile", [False, "eager"])  # "eager": the compiled batch passes, traced
@pytest.mark.parametrize("kind", ["plain", "eagle3_static"])
def test_batch_positions_on_a_position_sensitive_target(positional, kind, compile):
    """Rows of different lengths at positions length_b (+ depth): on a target whose argmaxes follow the
    rotary positions, an off-by-one position or a wrong prefix column breaks equality with HF greedy
    (compiled: the positions and mask come from the device lengths inside the graph, batch_graphs.py)."""
    model, tok = positional
    gen = SpeculativeGenerator(model, tok, make_drafter(model, kind), cache="static", compile=compile)
    gen.eos = set()
    batch = gen.generate_batch(input_ids=PROMPTS, max_new_tokens=MAX_NEW)
    for b, (prompt, n) in enumerate(zip(PROMPTS, MAX_NEW)):
        assert batch[b].token_ids == plain_greedy(model, prompt, n), (kind, b)


@pytest.mark.parametrize("kind", ["plain", "medusa", "eagle_dynamic"])
@pytest.mark.parametrize("compile", [False, "eager"])
def test_sampling_rows_equal_their_batch1_draws(setup, kind, compile):
    model, tok = setup
    gen = SpeculativeGenerator(model, tok, make_drafter(model, kind), cache="static", compile=compile)
    seeds = [11, 12, 13, 14]
    kw = {"temperature": 0.9, "top_k": 20}
    batch = gen.generate_batch(input_ids=PROMPTS, max_new_tokens=MAX_NEW, seed=seeds, **kw)
    for b, (prompt, n) in enumerate(zip(PROMPTS, MAX_NEW)):
        single = gen.generate(input_ids=prompt, max_new_tokens=n, seed=seeds[b], **kw).token_ids
        assert batch[b].token_ids == single, (kind, b)


@pytest.mark.parametrize("kind", ["plain", "medusa", "eagle_dynamic", "prompt_lookup"])
def test_sampling_rows_accepted_on_the_device_equal_their_batch1_draws(setup, kind, monkeypatch):
    """The accelerator's path (`device_accept`) on the CPU: rows of a padded batch accepted by rule A as
    one set of tensor ops draw what each row draws alone (its coins, then its token), never walked.
    Prompt lookup's trees differ in size from row to row: padded batches."""
    from spechead.inference.drafters.prompt_lookup import PromptLookupDrafter
    from spechead.inference.engine import accept as accept_module

    def no_walk(*args, **kwargs):
        raise AssertionError("a sampled tree was walked on the device path")

    monkeypatch.setattr(accept_module, "sample_accept", no_walk)
    sizes, accept = [], accept_module.accept_queued

    def recorded(draft, *args, **kwargs):  # (the device's rule A, read at once)
        sizes.append(tuple(draft.sizes))
        return accept(draft, *args, **kwargs)

    monkeypatch.setattr(accept_module, "accept_queued", recorded)
    model, tok = setup
    drafter = (
        PromptLookupDrafter(num_draft=3, max_ngram=1)
        if kind == "prompt_lookup"
        else make_drafter(model, kind)
    )
    gen = SpeculativeGenerator(model, tok, drafter, cache="static")
    gen.device_accept = True
    seeds, kw = [11, 12, 13, 14], {"temperature": 0.9, "top_k": 20}
    batch = gen.generate_batch(input_ids=PROMPTS, max_new_tokens=MAX_NEW, seed=seeds, **kw)
    for b, (prompt, n) in enumerate(zip(PROMPTS, MAX_NEW)):
        single = gen.generate(input_ids=prompt, max_new_tokens=n, seed=seeds[b], **kw)
        assert batch[b].token_ids == single.token_ids, (kind, b)
        # each row's own passes: its accept lengths, and the drafts of ITS tree (sizes differ by row)
        assert batch[b].stats.accept_lengths == single.stats.accept_lengths, (kind, b)
        assert batch[b].stats.drafted_tokens == single.stats.drafted_tokens, (kind, b)
    if kind == "prompt_lookup":
        assert any(len(set(s)) > 1 for s in sizes)  # some pass padded a row's tree


def test_batch_of_strings_and_single_row(setup, monkeypatch):
    model, tok = setup
    gen = SpeculativeGenerator(model, tok, medusa_drafter(model), cache="static")
    out = gen.generate_batch(["hello there", "a"], max_new_tokens=6)
    assert [r.token_ids for r in out] == [
        gen.generate("hello there", max_new_tokens=6).token_ids,
        gen.generate("a", max_new_tokens=6).token_ids,
    ]
    # one row: a batch of one through the same engine, its very passes
    one = gen.generate_batch(input_ids=[PROMPTS[2]], max_new_tokens=8)
    assert one[0].token_ids == plain_greedy(model, PROMPTS[2], 8)
    single = gen.generate(input_ids=PROMPTS[2], max_new_tokens=8)
    assert one[0].stats.accept_lengths == single.stats.accept_lengths
    pieces = list(gen.stream_batch(input_ids=[PROMPTS[2]], max_new_tokens=8))
    assert {row for row, _ in pieces} == {0} and gen.last_batch_stats[0].new_tokens == 8


def test_bad_input_lines(setup):
    model, tok = setup
    gen = SpeculativeGenerator(model, tok, None, cache="static")
    with pytest.raises(ValueError, match=r"row 1: the prompt is empty"):
        gen.generate_batch(input_ids=[[5, 6], [], [7]], max_new_tokens=4)
    with pytest.raises(ValueError, match=r"max_new_tokens has 2 values for 3 prompts"):
        gen.generate_batch(input_ids=[[5], [6], [7]], max_new_tokens=[4, 4])
    with pytest.raises(ValueError, match=r"non-empty list"):
        gen.generate_batch(input_ids=[], max_new_tokens=4)
    small = SpeculativeGenerator(model, tok, None, cache="static", max_cache_len=16)
    with pytest.raises(
        ValueError, match=r"too small for row 1: prompt \(14 tokens\) \+ max_new_tokens \(8\)"
    ):
        small.generate_batch(input_ids=[[5], PROMPTS[2]], max_new_tokens=8)
    with pytest.raises(ValueError, match=r"cache='dynamic': the engine's one KV cache is preallocated"):
        SpeculativeGenerator(model, tok, None, cache="dynamic")


def test_fixed_cache_near_its_end_still_lossless(setup):
    model, tok = setup
    gen = SpeculativeGenerator(model, tok, medusa_drafter(model), cache="static", max_cache_len=40)
    out = gen.generate_batch(input_ids=PROMPTS[:3], max_new_tokens=[20, 30, 24])
    for b, n in enumerate([20, 30, 24]):
        assert out[b].token_ids == plain_greedy(model, PROMPTS[b], n)


def test_row_drafters_share_the_head_weights(setup):
    from spechead.inference.drafters.per_row import clone_drafter

    model, _ = setup
    drafter = eagle_drafter(model, "eagle3", tree=[[0], [1], [0, 0]])
    twin = clone_drafter(drafter)
    assert twin is not drafter and twin.head is drafter.head  # own state, same modules
    assert twin.head._target_modules["embed_tokens"] is model.get_input_embeddings()


@pytest.mark.parametrize("compile", [False, "eager"])
@pytest.mark.parametrize("kind", ["plain", "eagle3_static"])
def test_stream_batch_pieces_join_to_each_rows_text(setup, kind, compile):
    """stream_batch yields (row, piece) pass by pass: each row's pieces join to its generate_batch text, a
    row that stops at EOS stops yielding while the others go on, and the rows' stats come afterwards."""
    model, tok = setup
    gen = SpeculativeGenerator(model, tok, make_drafter(model, kind), cache="static", compile=compile)
    gen.eos = {plain_greedy(model, PROMPTS[0], MAX_NEW[0])[6]}  # row 0 stops after 7 tokens
    whole = gen.generate_batch(input_ids=PROMPTS, max_new_tokens=MAX_NEW)
    events = list(gen.stream_batch(input_ids=PROMPTS, max_new_tokens=MAX_NEW))
    for b, result in enumerate(whole):
        assert "".join(p for row, p in events if row == b) == result.text, (kind, b)
        assert gen.last_batch_stats[b].new_tokens == result.stats.new_tokens
        assert gen.last_batch_stats[b].accept_lengths == result.stats.accept_lengths
    order = [row for row, _ in events]
    assert len(events) > len(PROMPTS) and order[:2] == [0, 1]  # pass by pass, not row after row
    last = {row: i for i, row in enumerate(order)}
    assert last[0] < last[2]  # the stopped row went quiet while row 2 went on


@pytest.mark.parametrize("compile", [False, "graphs"])  # graphs: the kept fixed-row runner (eager on a CPU)
def test_stream_batch_is_lazy_and_checks_its_rows(setup, compile):
    model, tok = setup
    gen = SpeculativeGenerator(model, tok, None, cache="static", compile=compile)
    forwards = []
    hook = model.register_forward_pre_hook(lambda *_: forwards.append(1))
    try:
        stream = gen.stream_batch(input_ids=[[5, 6], [7]], max_new_tokens=50)
        next(stream)
        assert len(forwards) <= 3  # a piece after the prefill and a pass or two, not after 50 passes
        stream.close()  # a consumer that stops early: nothing runs on
        assert len(forwards) <= 3
    finally:
        hook.remove()
    # ... and the next call starts afresh (a kept runner's rows are prefilled again)
    out = gen.generate_batch(input_ids=[[5, 6], [7]], max_new_tokens=[9, 5])
    assert [r.token_ids for r in out] == [plain_greedy(model, [5, 6], 9), plain_greedy(model, [7], 5)]
    with pytest.raises(ValueError, match=r"row 1: the prompt is empty"):
        next(gen.stream_batch(input_ids=[[5, 6], []], max_new_tokens=4))
    with pytest.raises(TypeError, match="max_new"):  # generate_batch's arguments, checked by name
        next(gen.stream_batch(input_ids=[[5, 6]], max_new=4))
