"""evaluation.py's decoding of a prompt set on a short-context sliding-window target: a training run's
decode eval and tree tuning end each answer at the context (plain and drafted alike, both past the
window), where a plain call refuses; the sampling seeds per turn, and the tallies and summary numbers
worked by hand."""

from __future__ import annotations

import pytest
import torch
from transformers import MistralConfig, MistralForCausalLM

from spechead.data.prompt_sets import EvalPrompt
from spechead.inference.drafters.prompt_lookup import PromptLookupDrafter
from spechead.inference.evaluation.measure import (
    DecodeSettings,
    PromptSetRun,
    Tally,
    acceptance_by_depth,
    answer_room,
    decode_prompts,
    summarize,
)
from spechead.inference.generator import SpeculativeGenerator
from spechead.inference.stats import GenerationStats

CONTEXT = 70
PROMPTS = [
    EvalPrompt("a", "qa", ["Hello there"]),
    EvalPrompt("b", "mt_bench", ["Add 2 and 3.", "And 4 and 5?", "And 6 and 7?"]),  # outgrows the context
]


@pytest.fixture(scope="module")
def windowed(chatml_tokenizer):
    torch.manual_seed(0)
    config = MistralConfig(
        vocab_size=len(chatml_tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, sliding_window=8, max_position_embeddings=CONTEXT,
    )  # fmt: skip
    model = MistralForCausalLM(config).eval()
    model.config.eos_token_id = None  # (random weights: answers run to their budget)
    return model, chatml_tokenizer


def test_answer_room_ends_at_the_context(windowed):
    model, tok = windowed
    gen = SpeculativeGenerator(model, tok, None)
    assert gen.context == CONTEXT
    assert answer_room(gen, 10, 12) == 12 and answer_room(gen, CONTEXT - 10, 12) == 10
    assert answer_room(gen, CONTEXT, 12) == 0 and answer_room(gen, CONTEXT + 5, 12) == 0
    assert answer_room(SpeculativeGenerator(model, tok, None, cache="static"), 10, 80) == CONTEXT - 10


def test_decode_eval_fits_the_context_and_plain_calls_still_refuse(windowed):
    model, tok = windowed
    settings = DecodeSettings(max_new_tokens=12)
    with pytest.raises(ValueError, match="exceeds the target's context of 70 tokens"):
        decode_prompts(SpeculativeGenerator(model, tok, None), PROMPTS, settings)
    fit = DecodeSettings(max_new_tokens=12, fit_context=True)
    plain = decode_prompts(SpeculativeGenerator(model, tok, None), PROMPTS, fit)
    drafted = decode_prompts(SpeculativeGenerator(model, tok, PromptLookupDrafter()), PROMPTS, fit)
    assert drafted.outputs == plain.outputs  # greedy, the same room per turn (far past the window of 8)
    # prompt b's second turn (62 tokens with the first answer) ends at the context; its third is not decoded
    assert [len(ids) for ids in plain.outputs] == [12, 12, 8]
    assert [len(p) for p in plain.prompt_ids] == [18, 20, 62]  # each turn's, the earlier answers in them


def test_the_trainers_decode_eval_fits_the_context(chatml_tokenizer, medusa_for):
    """decode_eval_hook (what train.py wires in) on a target whose context a prompt nearly fills: it
    decodes what fits instead of stopping the run (past its sliding window, losslessly)."""
    from spechead.inference.evaluation.measure import decode_eval_hook

    torch.manual_seed(0)
    config = MistralConfig(
        vocab_size=len(chatml_tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, sliding_window=16, max_position_embeddings=220,
    )  # fmt: skip
    model = MistralForCausalLM(config).eval()
    head = medusa_for(model, num_heads=2)
    head.attach_target_modules(lm_head=model.lm_head, embed_tokens=model.get_input_embeddings())
    long = [EvalPrompt("c", "summarization", ["x" * 200])]  # 208 prompt tokens: 12 fit
    metrics, _ = decode_eval_hook(model, chatml_tokenizer, head, long, 16, None)
    assert metrics["greedy_mismatches"] == 0 and metrics["tokens_per_s"] > 0


def test_sampled_turns_are_seeded_seed_plus_turn_index(tiny_llama, chatml_tokenizer):
    """Sampling seeds are `seed + turn index` over the whole prompt set: the same turn asked twice is
    sampled with two seeds, each answer the one a single generate() call with that seed gives."""
    model = tiny_llama(len(chatml_tokenizer), layers=2)
    model.config.eos_token_id = None
    gen = SpeculativeGenerator(model, chatml_tokenizer, None)
    prompts = [EvalPrompt("a", "qa", ["Hello there"]), EvalPrompt("b", "qa", ["Hello there"])]
    settings = DecodeSettings(max_new_tokens=8, temperature=1.0, seed=5)
    run = decode_prompts(gen, prompts, settings)
    ids = chatml_tokenizer.apply_chat_template(
        [{"role": "user", "content": "Hello there"}], add_generation_prompt=True, return_dict=False
    )
    alone = [
        gen.generate(input_ids=ids, max_new_tokens=8, temperature=1.0, seed=seed).token_ids for seed in (5, 6)
    ]
    assert run.outputs == alone and alone[0] != alone[1]


def test_tallies_acceptance_and_summary_by_hand():
    """A tally's wall time leaves out the prefill; acceptance_by_depth[d - 1] = share of passes that
    accepted at least d drafts (accept length - 1 >= d), reported up to the longest accepted run; the
    step time is PLAIN decoding's verify time per pass, the ideal speedup tau * step / (verify + draft)."""
    stats = GenerationStats(new_tokens=9, accept_lengths=[1, 2, 4, 1])
    stats.take_times({"prefill": 1.0, "draft": 0.5, "verify": 2.0})
    assert stats.wall_time == 3.5 and stats.prefill_time == 1.0
    drafted = Tally()
    drafted.add(stats)
    assert drafted.wall == 2.5 and drafted.tau == 2.0 and drafted.tokens_per_s == 9 / 2.5
    assert acceptance_by_depth([1, 2, 4, 1], 3) == [0.5, 0.25, 0.25]
    plain_stats = GenerationStats(new_tokens=9, accept_lengths=[1] * 8)
    plain_stats.take_times({"prefill": 1.0, "draft": 0.0, "verify": 6.0})
    plain = Tally()
    plain.add(plain_stats)
    row = summarize(
        [PromptSetRun(drafted, {"qa": drafted}, [[1, 2]])],
        [PromptSetRun(plain, {"qa": plain}, [[1, 2]])],
        DecodeSettings(),
    )
    assert row["acceptance_by_depth"] == [0.5, 0.25, 0.25]  # the longest pass accepted 3 drafts
    assert row["t_step_ms"] == pytest.approx(750.0)  # plain: 6 s over 8 passes
    assert row["t_verify_ms"] == pytest.approx(500.0) and row["t_draft_ms"] == pytest.approx(125.0)
    assert row["ideal_speedup"] == pytest.approx(2.0 * 750.0 / 625.0)
    assert row["speedup"] == pytest.approx((9 / 2.5) / (9 / 6.0)) and row["greedy_mismatches"] == 0


def test_repeats_and_categories_are_each_divided_by_their_own_plain_run():
    """Speedup i is run i's tokens/s over plain run i's (not the first plain run's), reported as the
    median [min, max] of the repeats; tau, acceptance and the time split come from the LAST run and
    the last plain run; passes per token = passes / tokens; t_other = wall per pass less verify and
    draft; a category's speedup divides by THAT category's plain tokens/s, not the whole set's."""
    plain_speeds, run_speeds = [10.0, 5.0, 20.0], [20.0, 15.0, 26.0]  # speedups 2, 3 and 1.3
    plains = [
        PromptSetRun(
            Tally(new_tokens=int(s), wall_time=1.0, verify_time=0.5, accept_lengths=[1] * 10), {}, []
        )
        for s in plain_speeds
    ]
    runs = [
        PromptSetRun(Tally(new_tokens=int(s), wall_time=1.0, accept_lengths=[1, 1]), {}, [])
        for s in run_speeds
    ]
    # the last repeats: two categories whose plain speeds differ (qa 12.5, math 50 tokens/s)
    plains[-1] = PromptSetRun(
        Tally(new_tokens=20, wall_time=1.0, verify_time=0.8, accept_lengths=[1] * 20),
        {"qa": Tally(new_tokens=10, wall_time=0.8), "math": Tally(new_tokens=10, wall_time=0.2)},
        [],
    )
    runs[-1] = PromptSetRun(
        Tally(new_tokens=26, wall_time=1.0, draft_time=0.2, verify_time=0.6, accept_lengths=[2, 4]),
        {
            "qa": Tally(new_tokens=10, wall_time=0.5, accept_lengths=[2]),
            "math": Tally(new_tokens=16, wall_time=0.5, accept_lengths=[4]),
        },
        [],
    )
    row = summarize(runs, plains, DecodeSettings(temperature=1.0))
    assert row["speedups"] == pytest.approx([2.0, 3.0, 1.3])
    assert row["speedup"] == pytest.approx(2.0)  # the median (the mean would be 2.1)
    assert (row["speedup_min"], row["speedup_max"]) == pytest.approx((1.3, 3.0))
    assert row["tau"] == 3.0 and row["passes_per_token"] == pytest.approx(2 / 26)
    assert row["t_step_ms"] == pytest.approx(40.0)  # the last plain run: 0.8 s over 20 passes
    assert (row["t_verify_ms"], row["t_draft_ms"]) == pytest.approx((300.0, 100.0))
    assert row["t_other_ms"] == pytest.approx(100.0)  # 500 ms per pass - 300 - 100
    assert row["speedup_by_category"] == pytest.approx({"qa": 20 / 12.5, "math": 32 / 50})
    assert row["tau_by_category"] == {"qa": 2.0, "math": 4.0} and row["greedy_mismatches"] is None


def test_the_decode_eval_drafts_as_loading_will(
    chatml_tokenizer, medusa_for, tiny_llama, monkeypatch, int8_cpu
):
    """On a CPU a Medusa head decodes its eval with int8 projections, as from_pretrained's default does
    (the speedup a run prints is the one its head decodes at), from a copy: the trained head stays."""
    import spechead.inference.evaluation.measure as evaluation

    model = tiny_llama(len(chatml_tokenizer)).eval()
    head = medusa_for(model, num_heads=2)
    head.attach_target_modules(lm_head=model.lm_head, embed_tokens=model.get_input_embeddings())
    used, real = [], evaluation.calibrated_drafter
    monkeypatch.setattr(
        evaluation,
        "calibrated_drafter",
        lambda t, drafter, *a: used.append(drafter.head) or real(t, drafter, *a),
    )
    metrics, _ = evaluation.decode_eval_hook(model, chatml_tokenizer, head, PROMPTS[:1], 8, None)
    assert metrics["greedy_mismatches"] == 0
    assert len(used) == 1 and {type(block[-1]).__name__ for block in used[0].heads} == {"Int8Linear"}
    assert {type(block[-1]).__name__ for block in head.heads} == {"Linear"}
