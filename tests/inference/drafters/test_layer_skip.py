"""Self-speculative drafting (layer skip / early exit): the view of the target computes exactly the
target without the skipped layers (its own cache, the target untouched), greedy output equals plain
decoding on 20+ prompts (EOS and max_new_tokens inside a draft), sampled output follows the target's
exact distribution (rules A, B, C) while a wrong rule does not, batches, specs and drafter files."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import DynamicCache, LlamaForCausalLM

from spechead.inference.drafter_specs import drafter_options, is_self_spec
from spechead.inference.drafters.layer_skip import (
    LayerSkipDrafter,
    default_skip,
    parse_layers,
    save_drafter_file,
    skip_view,
)
from spechead.inference.generator import SpeculativeGenerator
from spechead.inference.sampling import SamplingParams
from spechead.inference.target.runner import TargetRunner

from ..distributions import sampling_tv
from ..test_batch import MAX_NEW, PROMPTS
from ..test_generator import TopChildrenClaimingIid
from .test_draft_model_tree import PARAMS, PROMPT, passes_per_token, plain_greedy, prompts, sharpened

DRAFTERS = {
    "skip_default": {},
    "skip_two": {"skip_layers": "1+2"},
    "early_exit": {"exit_layer": 2},
    "skip_tree": {"skip_layers": [2], "width": "2x2x1"},
    "skip_dynamic": {"skip_layers": [1], "tree": "dynamic", "top_k": 3, "depth": 3, "total_tokens": 8},
}


@pytest.fixture(scope="module")
def setup(tiny_llama, chatml_tokenizer):
    model = tiny_llama(len(chatml_tokenizer), layers=4, hidden=32, seed=3)
    model.generation_config.eos_token_id = None
    return model, chatml_tokenizer


def kept_layers_model(model: LlamaForCausalLM, kept: list[int]) -> LlamaForCausalLM:
    """An independent reference: a fresh Llama of len(kept) layers loaded with the kept layers' weights."""
    config = model.config.to_dict() | {"num_hidden_layers": len(kept)}
    other = LlamaForCausalLM(type(model.config)(**config)).eval()
    state = {}
    for key, value in model.state_dict().items():
        if key.startswith("model.layers."):
            index, rest = key.removeprefix("model.layers.").split(".", 1)
            if int(index) in kept:
                state[f"model.layers.{kept.index(int(index))}.{rest}"] = value
        else:
            state[key] = value
    other.load_state_dict(state)
    return other


# ---- the view ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("skip", [[], [1], [0, 2], [2, 3]])
def test_view_is_the_target_without_the_skipped_layers(setup, skip):
    """Whole sequence and incrementally through its own cache (layer_idx renumbered to the kept layers)."""
    model, _ = setup
    view = skip_view(model, skip)
    ids = torch.tensor([prompts(1, model.config.vocab_size, longest=30)[0] + list(range(20, 40))])  # [1, T]
    reference = kept_layers_model(model, [i for i in range(4) if i not in skip])
    with torch.no_grad():
        want = reference(ids).logits  # [1, T, V]
        torch.testing.assert_close(view(ids).logits, want, atol=1e-5, rtol=0)
        cache = DynamicCache(config=view.config)
        steps = [view(ids[:, :10], cache=cache, use_cache=True).logits]
        steps += [view(ids[:, t : t + 1], cache=cache, use_cache=True).logits for t in range(10, 14)]
        steps.append(view(ids[:, 14:], cache=cache, use_cache=True).logits)
    torch.testing.assert_close(torch.cat(steps, 1), want, atol=1e-5, rtol=0)
    assert len(cache.layers) == 4 - len(skip) and cache.get_seq_length() == ids.shape[1]


def test_early_exit_is_the_final_norm_and_lm_head_after_layer_k(setup):
    model, _ = setup
    ids = torch.tensor([list(range(5, 30))])
    with torch.no_grad():
        hidden = model(ids, output_hidden_states=True).hidden_states  # L + 1 of [1, T, H]
        drafter = LayerSkipDrafter(model, exit_layer=2)
        torch.testing.assert_close(drafter.model(ids).logits, model.lm_head(model.model.norm(hidden[2])))
    assert drafter.skip_layers == (2, 3) and drafter.kind == "early_exit"


def test_the_target_is_untouched(setup):
    """No module, index, config or hook of the target changes; the target's hooks never see a draft pass."""
    model, _ = setup
    ids = torch.tensor([list(range(5, 25))])
    with torch.no_grad():
        before = model(ids).logits
    calls = []
    handles = [layer.register_forward_hook(lambda *a: calls.append(1)) for layer in model.model.layers]
    handles.append(model.model.norm.register_forward_hook(lambda *a: calls.append(1)))
    TargetRunner(model)  # the target now carries the runner's capture (no hooks for no layers)
    try:
        drafter = LayerSkipDrafter(model, [1, 2], num_draft=3)
        drafter.start(ids[0, :-1], {}, int(ids[0, -1]))
        assert drafter.propose(int(ids[0, -1]), SamplingParams(), None).tree.size == 4
        assert calls == [], "the draft ran the target's own (hooked) modules"
    finally:
        for handle in handles:
            handle.remove()
    assert len(model.model.layers) == 4 and model.config.num_hidden_layers == 4
    assert [layer.self_attn.layer_idx for layer in model.model.layers] == [0, 1, 2, 3]
    assert all(p is q for p, q in zip(drafter.model.lm_head.parameters(), model.lm_head.parameters()))
    assert "_spechead_capture" in model.__dict__ and "_spechead_capture" not in drafter.model.__dict__
    with torch.no_grad():
        assert torch.equal(model(ids).logits, before)


def test_layer_options_and_bad_input(setup):
    model, _ = setup
    assert (
        parse_layers("1+4-6", 8) == [1, 4, 5, 6]
        and parse_layers(3, 8) == [3]
        and parse_layers([2, 1], 8) == [1, 2]
    )
    assert default_skip(8) == [1, 3, 5] and LayerSkipDrafter(model).skip_layers == (1,)
    for kwargs, needle in [
        ({"skip_layers": [4]}, "out of range"),
        ({"skip_layers": "0-3"}, "keep at least one"),
        ({"skip_layers": "1,2"}, "joined by \\+"),
        ({"skip_layers": [1], "exit_layer": 2}, "not both"),
        ({"exit_layer": 4}, "1..3"),
        ({"exit_layer": 0}, "1..3"),
        ({"skip_layers": [1], "width": "4x0"}, "width"),
    ]:
        with pytest.raises(ValueError, match=needle):
            LayerSkipDrafter(model, **kwargs)
    other = LayerSkipDrafter(model, [1])
    with pytest.raises(ValueError, match="4 layers, not 6"):
        other.check_target(32, model.config.vocab_size, 6)


# ---- greedy: exactly plain decoding ------------------------------------------------------------------


def test_greedy_equals_plain_decoding(setup):
    model, tok = setup
    taus = {name: [] for name in DRAFTERS}
    for i, prompt in enumerate(prompts(20, model.config.vocab_size)):
        n = 12 + i % 7
        reference = plain_greedy(model, prompt, n)
        for name, options in DRAFTERS.items():
            gen = SpeculativeGenerator(model, tok, LayerSkipDrafter(model, **options))
            gen.eos = set()
            result = gen.generate(input_ids=prompt, max_new_tokens=n)
            assert result.token_ids == reference, f"{name} on prompt {i}"
            taus[name].append(result.stats.tau)
    assert all(sum(v) / len(v) > 1.2 for v in taus.values()), taus  # drafts are accepted, not just bonus


def test_greedy_stops_at_eos_and_max_new_tokens_inside_a_draft(setup):
    model, tok = setup
    for i, prompt in enumerate(prompts(6, model.config.vocab_size)):
        reference = plain_greedy(model, prompt, 24)
        eos = reference[3 + i % 4]
        stop = reference.index(eos)
        # nothing skipped: the view IS the target, every draft is accepted, so EOS lands inside a draft
        gen = SpeculativeGenerator(model, tok, LayerSkipDrafter(model, [], num_draft=4))
        gen.eos = {eos}
        assert gen.generate(input_ids=prompt, max_new_tokens=24).token_ids == reference[: stop + 1]
        gen.eos = set()
        full = gen.generate(input_ids=prompt, max_new_tokens=24)
        assert all(a == 5 for a in full.stats.accept_lengths[:-1])
        for n in (1, 2, 3, 7):
            assert gen.generate(input_ids=prompt, max_new_tokens=n).token_ids == reference[:n], n


# ---- sampling: exactly the target's distribution -------------------------------------------------------


@pytest.fixture(scope="module")
def peaked(tiny_llama, chatml_tokenizer):
    """2 layers, sharpened lm_head: skipping layer 1 gives q ~ .18/.45/.37 on a support that shares two
    of the target's three tokens (p ~ .41/.34/.25)."""
    model = tiny_llama(len(chatml_tokenizer), layers=2, hidden=32, seed=3)
    return sharpened(model, 20.0), chatml_tokenizer


@pytest.mark.parametrize(
    ("options", "rule", "trials", "bound"),
    [
        ({"num_draft": 2}, "iid", 600, 0.09),  # B
        ({"width": "3x3"}, "without_replacement", 1200, 0.065),  # C
        ({"tree": "dynamic", "top_k": 3, "depth": 2, "total_tokens": 8}, "deterministic", 400, 0.1),  # A
    ],
)
def test_sampling_matches_the_target_distribution(peaked, options, rule, trials, bound):
    target, tok = peaked
    drafter = LayerSkipDrafter(target, [1], **options)
    assert drafter.rule == rule
    gen = SpeculativeGenerator(target, tok, drafter)
    assert passes_per_token(gen) < 0.8, "too few drafts accepted for the check to exercise the rule"
    tv = sampling_tv(gen, PROMPT, PARAMS, trials)
    assert tv < bound, f"{options}: TV {tv:.3f}"


class WrongRuleSkip(TopChildrenClaimingIid, LayerSkipDrafter):
    """Deliberately WRONG: the layer-skip draft's argmax children verified with q ratios (rule B)."""


def test_a_wrong_rule_fails_the_distribution_check(peaked):
    target, tok = peaked
    gen = SpeculativeGenerator(target, tok, WrongRuleSkip(target, [1], num_draft=2))
    tv = sampling_tv(gen, PROMPT, PARAMS, 600)
    assert tv > 0.1, f"the wrong rule went unnoticed (TV {tv:.3f})"


# ---- batches, specs, files ----------------------------------------------------------------------------


@pytest.mark.parametrize("options", [{"skip_layers": [1]}, {"exit_layer": 2, "width": "2x1"}])
def test_generate_batch_rows_equal_batch1(setup, options):
    model, tok = setup
    gen = SpeculativeGenerator(model, tok, LayerSkipDrafter(model, **options), cache="static")
    batch = gen.generate_batch(input_ids=PROMPTS, max_new_tokens=MAX_NEW)
    sampled = gen.generate_batch(
        input_ids=PROMPTS, max_new_tokens=MAX_NEW, seed=[1, 2, 3, 4], temperature=0.9
    )
    for b, (prompt, n) in enumerate(zip(PROMPTS, MAX_NEW)):
        assert batch[b].token_ids == plain_greedy(model, prompt, n), b
        single = gen.generate(input_ids=prompt, max_new_tokens=n, seed=b + 1, temperature=0.9)
        assert sampled[b].token_ids == single.token_ids, b
    assert sum(sum(r.stats.accept_lengths) for r in batch) > sum(len(r.stats.accept_lengths) for r in batch)


def test_specs_and_drafter_files(tiny_target_dir, tmp_path):
    """`--drafter` specs (benchmark's option parser, generate.py's whole string) and the drafter file."""
    target = str(tiny_target_dir)
    path, options = drafter_options("layer_skip@skip=1+2,num_draft=2")
    assert (path, options) == ("layer_skip", {"skip": "1+2", "num_draft": 2})
    gen = SpeculativeGenerator.from_pretrained(target, path, **options)
    assert gen.drafter.skip_layers == (1, 2) and gen.drafter.depth == 2
    plain = SpeculativeGenerator(gen.target, gen.tokenizer, None)
    assert (
        gen.generate("hello", max_new_tokens=8).token_ids
        == plain.generate("hello", max_new_tokens=8).token_ids
    )
    exit_gen = SpeculativeGenerator.from_pretrained(target, "early_exit@layer=3")  # generate.py: one string
    assert exit_gen.drafter.skip_layers == (3,) and exit_gen.drafter.exit_layer == 3
    assert SpeculativeGenerator.from_pretrained(target, "early_exit").drafter.exit_layer == 2  # L // 2
    file = save_drafter_file(tmp_path / "skip.json", gen.drafter, tau=2.0)
    assert json.loads(file.read_text()) == {
        "drafter": "layer_skip", "skip_layers": [1, 2], "num_layers": 4, "num_draft": 2, "tau": 2.0,
    }  # fmt: skip
    assert is_self_spec(str(file)) and not is_self_spec(target)
    loaded = SpeculativeGenerator.from_pretrained(target, str(file), num_draft=4)  # options override the file
    assert loaded.drafter.skip_layers == (1, 2) and loaded.drafter.depth == 4
    file.write_text(json.dumps({"drafter": "layer_skip", "skip_layers": [1], "num_layers": 32}))
    for drafter, needle in [
        (str(file), "32 layers, this one has 4"),
        ("layer_skip@skip=9", "out of range"),
        ("layer_skip@layer=2", "unknown option.*valid: skip, num_draft"),
        ("early_exit@skip=2", "unknown option.*valid: layer, num_draft"),
        ("layer_skip@skip", "key=value"),
    ]:
        with pytest.raises(ValueError, match=needle):
            SpeculativeGenerator.from_pretrained(target, drafter)
