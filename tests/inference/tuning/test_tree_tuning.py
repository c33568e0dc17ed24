"""tune_tree: the tree a head gets for this device, from accuracy measured on the target's own answers."""

from __future__ import annotations

import pytest
import torch

from spechead.data.prompt_sets import EvalPrompt
from spechead.heads import Eagle3Config, Eagle3Head, directory
from spechead.heads.families import family_of
from spechead.inference.drafter_specs import drafter_for_head
from spechead.inference.evaluation.measure import DecodeSettings, decode_prompts
from spechead.inference.generator import SpeculativeGenerator
from spechead.inference.tuning.calibrate import saved_accuracy
from spechead.inference.tuning.tree_search import expected_accept_length
from spechead.inference.tuning.tree_tuning import measure_accuracy, tune_tree

PROMPTS = [
    EvalPrompt("a", "qa", ["Hello there"]),
    EvalPrompt("b", "mt_bench", ["Add 2 and 3.", "And 4 and 5?"]),  # two turns: the answer is fed back
]


@pytest.fixture(scope="module")
def target(tiny_llama, chatml_tokenizer):
    model = tiny_llama(len(chatml_tokenizer))
    model.config.eos_token_id = chatml_tokenizer.convert_tokens_to_ids("<|im_end|>")
    return model, chatml_tokenizer


def _head(kind: str, model, medusa_for):
    if kind == "medusa":
        head = medusa_for(model, num_heads=3)
    else:
        head = Eagle3Head(Eagle3Config.from_target(model.config))
        head.init_lm_head_from_target_(model.lm_head.weight)
    head.attach_target_modules(lm_head=model.lm_head, embed_tokens=model.get_input_embeddings())
    return head.eval()


def _answers(gen: SpeculativeGenerator, max_new_tokens: int):
    return decode_prompts(gen, PROMPTS, DecodeSettings(max_new_tokens=max_new_tokens, fit_context=True))


def test_answers_are_decoded_turn_by_turn(target):
    model, tok = target
    answers = _answers(SpeculativeGenerator(model, tok, None), 12)
    assert len(answers.outputs) == len(answers.prompt_ids) == 3  # every turn of every prompt
    first_answer = tok.decode(answers.outputs[1], skip_special_tokens=True)
    second_prompt = tok.decode(answers.prompt_ids[2])
    assert (
        "Add 2 and 3." in second_prompt and first_answer in second_prompt and "And 4 and 5?" in second_prompt
    )
    assert answers.total.new_tokens == sum(map(len, answers.outputs))
    assert answers.total.tau == 1.0  # plain decoding: one token per pass


def test_without_a_chat_template_every_turn_is_a_prompt_of_its_own(target):
    model, tok = target
    template, tok.chat_template = tok.chat_template, None  # (a session's tokenizer: restored after)
    try:
        answers = _answers(SpeculativeGenerator(model, tok, None), 6)
    finally:
        tok.chat_template = template
    turns = [t for p in PROMPTS for t in p.turns]
    assert answers.prompt_ids == [tok(t, add_special_tokens=True)["input_ids"] for t in turns]


@pytest.mark.parametrize("kind", ["medusa", "eagle3"])
def test_tune_tree_measures_chooses_and_decodes_its_tree(target, medusa_for, tmp_path, kind):
    model, tok = target
    head = _head(kind, model, medusa_for)
    head.train()  # tuning puts the head in eval mode and back
    fields = tune_tree(model, tok, head, PROMPTS, max_new_tokens=16, depth=3, topk=4)
    assert head.training

    # the accuracy is the family's measure on the target's own (plain greedy) answers to every turn
    answers = _answers(SpeculativeGenerator(model, tok, None), 16)
    accuracy = measure_accuracy(model, head, answers, depth=3, topk=4)
    assert fields["accuracy"] == [[round(x, 6) for x in row] for row in accuracy.tolist()]
    assert fields["measured_on"] == {"prompts": 2, "turns": 3, "max_new_tokens": 16,
                                     "generated_tokens": answers.total.new_tokens, "topk": 4}  # fmt: skip
    choices = fields["choices"]
    assert choices and all(len(c) <= 3 and max(c) < 4 for c in choices)
    assert fields["expected_accept_length"] == pytest.approx(expected_accept_length(accuracy, choices))
    assert fields["family"] == head.config.family and fields["expected_speedup"] > 0
    assert fields["costs_ms"]["step_ms"] > 0 and fields["costs_ms"]["pass_ms"] > 0

    # measured_tau is the chosen tree's own tau on the same prompts (not the plain run's 1.0)
    tree = drafter_for_head(head, **{family_of(head.config).tree_option: choices})
    tuned = _answers(SpeculativeGenerator(model, tok, tree), 16)
    assert fields["measured_tau"] == round(tuned.total.tau, 4)
    assert (tuned.prompt_ids, tuned.outputs) == (answers.prompt_ids, answers.outputs)  # lossless

    # saved, it is what loading calibrates from: the table scaled to the measured tau
    directory.write_tree(tmp_path, **fields)
    fitted = saved_accuracy(tmp_path)
    assert fitted is not None and fitted.shape == (3, 4)
    assert expected_accept_length(fitted, choices) == pytest.approx(fields["measured_tau"], abs=1e-3)
    assert torch.equal(saved_accuracy(fields), fitted)  # the fields themselves read the same


def test_tuning_takes_the_tree_whose_decoded_passes_pay_best(target, medusa_for, monkeypatch):
    """The part-by-part costs only rank the trees: the one decoded fastest here is saved (timings fixed:
    the last candidate's pass 10x cheaper than the others', so it wins both choices)."""
    import spechead.inference.tuning.pass_timing as pass_timing

    model, tok = target
    head = _head("medusa", model, medusa_for)
    offered: list[list] = []

    def timed(target, drafters, prompt, new_tokens=32, batch=1, timed_as=None):
        offered.append([d.choices for d in drafters[1:]])  # the candidates, plain decoding first
        return [5.0] * (len(drafters) - 1) + [0.5]

    monkeypatch.setattr(pass_timing, "pass_ms_by_drafter", timed)
    fields = tune_tree(model, tok, head, PROMPTS, max_new_tokens=8, depth=3, topk=4)
    assert len(offered) == 2 and len(offered[0]) >= 2  # before and after fitting the table to the tau
    assert offered[1][0] == offered[0][-1]  # the first pick is decoded for its tau, then offered to keep
    assert fields["choices"] == offered[-1][-1] and fields["expected_speedup"] > 1


def test_the_second_choice_ranks_trees_by_the_fitted_table(target, medusa_for, monkeypatch):
    """After the first tree's decode, the table is scaled to its tau and the candidates decoded again are
    the best trees FOR THAT TABLE at the costs timed once (each decoded_choice gets the table it ranks;
    the table and the in-situ pass times are planted, the rest is real)."""
    import spechead.inference.tuning.pass_timing as pass_timing
    import spechead.inference.tuning.tree_tuning as tree_tuning
    from spechead.inference.tuning.calibrate import best_for_costs

    model, tok = target
    head = _head("medusa", model, medusa_for)
    timed, offers = [], []
    calibrated, decoded = tree_tuning.calibrated_choices, tree_tuning.decoded_choice

    def calibrated_kept(*args, **kwargs):
        choices, info = calibrated(*args, **kwargs)
        timed.append({k: v for k, v in info.items() if k != "ranked"})
        return choices, info

    def decoded_kept(target, drafter, accuracy, costs, keep=None):
        offers.append((accuracy.clone(), costs["ranked"]))
        return decoded(target, drafter, accuracy, costs, keep=keep)

    monkeypatch.setattr(tree_tuning, "calibrated_choices", calibrated_kept)
    monkeypatch.setattr(tree_tuning, "decoded_choice", decoded_kept)
    monkeypatch.setattr(
        pass_timing, "pass_ms_by_drafter", lambda target, drafters, *a, **kw: [1.0] * len(drafters)
    )
    # a table far more hopeful than this head decodes: the fitted one favours other trees
    hopeful = torch.tensor([[0.9, 0.6, 0.3, 0.2], [0.9, 0.6, 0.3, 0.2], [0.9, 0.6, 0.3, 0.2]])
    monkeypatch.setattr(tree_tuning, "measure_accuracy", lambda *a, **kw: hopeful)
    tune_tree(model, tok, head, PROMPTS, max_new_tokens=8, depth=3, topk=4, max_nodes=16)
    assert len(timed) == 1 and len(offers) == 2
    assert not torch.equal(offers[0][0], offers[1][0])  # the fitted table
    for accuracy, ranked in offers:
        info = dict(timed[0])
        best_for_costs(accuracy, info, 16)
        assert info["ranked"] == ranked


def test_tuning_times_and_decodes_the_draft_loading_will_run(target, medusa_for, monkeypatch, int8_cpu):
    """On a CPU loading drafts a Medusa head with int8 projections (draft_int8="auto"): tuning times and
    decodes that draft (a copy), measures the accuracy of the head as trained and leaves it as it was."""
    import spechead.inference.tuning.tree_tuning as tree_tuning

    model, tok = target
    head = _head("medusa", model, medusa_for)
    timed, real = [], tree_tuning.calibrated_choices
    monkeypatch.setattr(
        tree_tuning,
        "calibrated_choices",
        lambda t, drafter, *a, **k: timed.append(drafter.head) or real(t, drafter, *a, **k),
    )
    measured, measure = [], tree_tuning.measure_accuracy
    monkeypatch.setattr(
        tree_tuning, "measure_accuracy", lambda t, h, *a, **k: measured.append(h) or measure(t, h, *a, **k)
    )
    tune_tree(model, tok, head, PROMPTS, max_new_tokens=8, depth=3, topk=4)
    assert len(timed) == 1 and timed[0] is not head
    assert {type(block[-1]).__name__ for block in timed[0].heads} == {"Int8Linear"}
    assert measured == [head] and {type(block[-1]).__name__ for block in head.heads} == {"Linear"}
