"""pass_timing.py: candidate trees decoded in situ, scored by expected accept length x plain pass / pass."""

from __future__ import annotations

import json
import warnings
from types import SimpleNamespace

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from spechead.heads import Eagle3Config, Eagle3Head
from spechead.inference.drafters.eagle import EagleDrafter
from spechead.inference.generator import SpeculativeGenerator
from spechead.inference.tuning.calibrate import TimedAs
from spechead.inference.tuning.pass_timing import pass_ms_by_drafter, self_written_prompt


def test_the_best_expected_speedup_wins_unless_the_kept_tree_is_close(tiny_llama, monkeypatch):
    """expected speedup = expected accept length x plain pass / the tree's pass (the table makes the accept
    lengths 2, 3 and 4; the decoded passes are planted: plain 5 ms, then 6, 7.5 and 12 ms)."""
    import spechead.inference.tuning.pass_timing as pass_timing

    target = tiny_llama(64, layers=2, hidden=32).eval()
    accuracy = torch.ones(2, 2)
    candidates = [[[0]], [[0], [1]], [[0], [1], [0, 0]]]
    planted = [5.0, 6.0, 7.5, 12.0]  # plain, then each candidate: speedups 1.667, 2.0, 1.667
    monkeypatch.setattr(pass_timing, "pass_ms_by_drafter", lambda *a, **kw: planted)
    unused = SimpleNamespace(with_tree=lambda choices: None)  # (the passes are planted)

    def choose(**kw):
        best, costs = pass_timing.decoded_choice(
            target, unused, accuracy, {"ranked": candidates, "expected_speedup": 0}, **kw
        )
        return best, costs["in_situ"]

    best, info = choose()
    assert best == candidates[1] and info["expected_speedup"] == pytest.approx(2.0)
    assert info["expected_speedups"] == pytest.approx([5 / 3, 2.0, 5 / 3])
    assert (info["plain_pass_ms"], info["pass_ms"]) == (5.0, planted[1:]) and "kept_saved_tree" not in info
    # a kept tree within the margin stays (1.667 * 1.25 >= 2.0); beyond it, the best wins
    kept, info = choose(keep=candidates[0], keep_margin=0.25)
    assert (
        kept == candidates[0] and info["kept_saved_tree"] and info["expected_speedup"] == pytest.approx(5 / 3)
    )
    best, info = choose(keep=candidates[0], keep_margin=0.10)
    assert best == candidates[1] and not info["kept_saved_tree"]
    planted[1:] = [6.0, 9.0, 12.0]  # every speedup 5/3
    assert choose()[0] == candidates[0]  # ties: the earlier candidate


def test_the_timing_prompt_is_the_target_writing_on(tiny_llama):
    target = tiny_llama(64, layers=2, hidden=32).eval()
    target.generation_config.eos_token_id = None
    prompt = self_written_prompt(target, length=24)
    assert prompt.shape == (24,)
    plain = target.generate(prompt[None, :8], max_new_tokens=16, do_sample=False, pad_token_id=0)[0]
    assert prompt.tolist() == plain.tolist()  # 8 random tokens, then the target's own greedy text


def test_passes_are_timed_per_drafter(tiny_llama):
    target = tiny_llama(64, layers=2, hidden=32).eval()
    head = Eagle3Head(Eagle3Config.from_target(target.config, target_layers=[0, 1, 2]))
    head.attach_target_modules(lm_head=target.lm_head, embed_tokens=target.get_input_embeddings())
    chain = EagleDrafter(head.eval(), tree=[[0], [0, 0]])
    plain, drafted = pass_ms_by_drafter(target, [None, chain], torch.arange(1, 20), new_tokens=8, rounds=2)
    assert plain > 0 and drafted > 0
    rows = pass_ms_by_drafter(target, [None, chain], torch.arange(1, 20), new_tokens=8, rounds=1, batch=3)
    assert len(rows) == 2 and min(rows) > 0  # batched passes of 3 rows (the engine)


def test_passes_are_timed_as_the_generator_compiles_them(tiny_llama, monkeypatch):
    """timed_as: the in-situ generator's target and every drafter compiled ("graphs": fixed shapes)."""
    from spechead.inference.target import runner as runner_module

    target = tiny_llama(64, layers=2, hidden=32).eval()
    head = Eagle3Head(Eagle3Config.from_target(target.config, target_layers=[0, 1, 2]))
    head.attach_target_modules(lm_head=target.lm_head, embed_tokens=target.get_input_embeddings())
    chain = EagleDrafter(head.eval(), tree=[[0], [0, 0]])
    built = []
    init = runner_module.TargetRunner.__init__
    monkeypatch.setattr(
        runner_module.TargetRunner,
        "__init__",
        lambda self, *a, **kw: (built.append(kw.get("compile", False)), init(self, *a, **kw))[1],
    )
    timed = pass_ms_by_drafter(
        target,
        [None, chain],
        torch.arange(1, 20),
        new_tokens=8,
        rounds=1,
        timed_as=TimedAs("graphs", "graphs"),
    )
    assert min(timed) > 0 and built == ["graphs"] and chain._compile == "graphs"
    assert chain._rows is chain._graphs is not None  # it drafted as graphs
    other = EagleDrafter(head.eval(), tree=[[0], [0, 0]])
    pass_ms_by_drafter(target, [None, other], torch.arange(1, 20), new_tokens=8, rounds=1)  # eager
    assert built == ["graphs", False] and other._compile is False and other._graphs is None


def test_from_pretrained_decodes_the_candidate_trees(tiny_target_dir, tmp_path):
    config = AutoConfig.from_pretrained(tiny_target_dir)
    torch.manual_seed(0)
    head = Eagle3Head(Eagle3Config.from_target(config, target_layers=[1, 2, config.num_hidden_layers]))
    head.save_pretrained(tmp_path / "head")
    saved = {"choices": [[0], [0, 0]], "accuracy": [[0.7, 0.2], [0.6, 0.2], [0.5, 0.1]], "device": "cpu"}
    (tmp_path / "head" / "tree.json").write_text(json.dumps(saved))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # an untrained head may be expected to lose: not what this tests
        gen = SpeculativeGenerator.from_pretrained(str(tiny_target_dir), str(tmp_path / "head"))
    info = gen.calibration
    measured = info["in_situ"]
    assert measured["candidates"][0] == saved["choices"]  # the tuned tree is decoded first, then the model's
    assert len(measured["candidates"]) == len(measured["pass_ms"]) >= 2
    assert measured["plain_pass_ms"] > 0 and min(measured["pass_ms"]) > 0
    assert info["choices"] in measured["candidates"] and "kept_saved_tree" in info
    assert info["expected_speedup"] == pytest.approx(
        measured["expected_speedups"][measured["candidates"].index(info["choices"])]
    )
    assert gen.drafter.choices == info["choices"]  # the drafter decodes with the chosen tree
    prompt, reference = [5, 9, 11, 7], AutoModelForCausalLM.from_pretrained(tiny_target_dir)
    greedy = reference.generate(  # Hugging Face greedy decoding (test_generator.plain_greedy's)
        torch.tensor([prompt]), max_new_tokens=10, do_sample=False, eos_token_id=None, pad_token_id=0
    )[0, len(prompt) :].tolist()
    gen.eos = set()
    assert gen.generate(input_ids=prompt, max_new_tokens=10).token_ids == greedy


def test_the_tree_decoded_fastest_here_is_the_one_used(tiny_target_dir, tmp_path, monkeypatch):
    """Whatever the part-by-part model ranked first, the candidate whose decoded passes pay best wins
    (the timings are fixed here: the last candidate's pass is made 10x cheaper than the others')."""
    import spechead.inference.tuning.pass_timing as pass_timing

    config = AutoConfig.from_pretrained(tiny_target_dir)
    Eagle3Head(Eagle3Config.from_target(config, target_layers=[1, 2, 3])).save_pretrained(tmp_path / "h")
    table = {"choices": [[0]], "accuracy": [[0.7, 0.2], [0.6, 0.2], [0.5, 0.1]], "device": "cpu"}
    (tmp_path / "h" / "tree.json").write_text(json.dumps(table))

    def timed(target, drafters, prompt, new_tokens=32, batch=1, timed_as=None):
        return [5.0] * (len(drafters) - 1) + [0.5]

    monkeypatch.setattr(pass_timing, "pass_ms_by_drafter", timed)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        gen = SpeculativeGenerator.from_pretrained(str(tiny_target_dir), str(tmp_path / "h"))
    candidates = gen.calibration["in_situ"]["candidates"]
    assert len(candidates) >= 2 and gen.calibration["choices"] == candidates[-1] != candidates[0]
    assert gen.drafter.choices == candidates[-1] and not gen.calibration["kept_saved_tree"]


@pytest.mark.parametrize(("faster", "kept"), [(0.015, True), (0.03, False)])
def test_the_tuned_tree_gives_way_only_to_a_tree_decoded_clearly_faster(
    tiny_target_dir, tmp_path, monkeypatch, faster, kept
):
    """In situ the tree tuned with the head (decoded first) stays unless another is expected more than
    IN_SITU_KEEP_MARGIN (2%) faster: a challenger 1.5% faster leaves it, one 3% faster replaces it. Every
    candidate's accept length is made 1 and its pass fixed, so the expected speedups are plain / pass."""
    import spechead.inference.tuning.pass_timing as pass_timing

    config = AutoConfig.from_pretrained(tiny_target_dir)
    Eagle3Head(Eagle3Config.from_target(config, target_layers=[1, 2, 3])).save_pretrained(tmp_path / "h")
    table = {"choices": [[0]], "accuracy": [[0.7, 0.2], [0.6, 0.2], [0.5, 0.1]], "device": "cpu"}
    (tmp_path / "h" / "tree.json").write_text(json.dumps(table))

    def timed(
        target, drafters, prompt, new_tokens=32, batch=1, timed_as=None
    ):  # plain, the tuned tree, the others
        others = [2.0] * (len(drafters) - 3) + [1 / (1 + faster)]  # the last one the fastest
        return [1.0, 1.0, *others]

    monkeypatch.setattr(pass_timing, "pass_ms_by_drafter", timed)
    monkeypatch.setattr(pass_timing, "expected_accept_length", lambda accuracy, choices: 1.0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        gen = SpeculativeGenerator.from_pretrained(str(tiny_target_dir), str(tmp_path / "h"))
    candidates = gen.calibration["in_situ"]["candidates"]
    assert len(candidates) >= 2 and candidates[0] == [[0]]  # the tuned tree, decoded first
    assert gen.calibration["kept_saved_tree"] == kept
    assert gen.drafter.choices == (candidates[0] if kept else candidates[-1])


def test_a_short_context_target_is_timed_within_its_context(tiny_llama):
    """prompt + new tokens fit max_position_embeddings (the generator refuses more)."""
    from spechead.inference.tuning.pass_timing import decoded_choice

    target = tiny_llama(64, layers=2, hidden=32).eval()
    target.config.max_position_embeddings = 40
    head = Eagle3Head(Eagle3Config.from_target(target.config, target_layers=[0, 1, 2]))
    head.attach_target_modules(lm_head=target.lm_head, embed_tokens=target.get_input_embeddings())
    accuracy = torch.tensor([[0.7, 0.2], [0.6, 0.2]], dtype=torch.float64)
    costs = {"ranked": [[[0]], [[0], [0, 0]]], "expected_speedup": 1.0}
    chosen, costs = decoded_choice(target, EagleDrafter(head.eval(), tree=[[0]]), accuracy, costs)
    assert chosen in costs["in_situ"]["candidates"] and min(costs["in_situ"]["pass_ms"]) > 0


def test_a_pass_leaves_out_the_prefill(tiny_llama, monkeypatch):
    """ms per pass = (wall - prefill) / passes: a prefill made 10 s dearer changes no pass's time."""
    from spechead.inference.generator import SpeculativeGenerator

    target = tiny_llama(64, layers=2, hidden=32).eval()
    generate_batch = SpeculativeGenerator.generate_batch

    def dear_prefill(self, *args, **kwargs):
        results = generate_batch(self, *args, **kwargs)
        for result in results:
            result.stats.prefill_time += 10.0
            result.stats.wall_time += 10.0
        return results

    monkeypatch.setattr(SpeculativeGenerator, "generate_batch", dear_prefill)
    (plain,) = pass_ms_by_drafter(target, [None], torch.arange(1, 20), new_tokens=8, rounds=1)
    assert 0 < plain < 1000


def test_every_drafter_decodes_the_same_tokens_past_an_eos(tiny_llama, monkeypatch):
    """Timed decodes ignore the target's EOS: each runs `new_tokens`, even when the first token emitted
    is the EOS (a drafter that stopped sooner would be timed on other passes)."""
    from spechead.inference.generator import SpeculativeGenerator

    target = tiny_llama(64, layers=2, hidden=32).eval()
    prompt = torch.arange(1, 20)
    with torch.no_grad():
        first = int(target(prompt[None]).logits[0, -1].argmax())
    target.generation_config.eos_token_id = first
    generate_batch, emitted = SpeculativeGenerator.generate_batch, []

    def counted(self, *args, **kwargs):
        results = generate_batch(self, *args, **kwargs)
        emitted.extend(result.stats.new_tokens for result in results)
        return results

    monkeypatch.setattr(SpeculativeGenerator, "generate_batch", counted)
    pass_ms_by_drafter(target, [None], prompt, new_tokens=8, rounds=2)
    assert emitted == [8, 8]
