"""Hybrid targets (layers with recurrent state: heads/hybrid.py) never decode wrong: tree passes would
fold siblings and rejected drafts into their Mamba / linear-attention states (Falcon-H1 with the dynamic
cache gave prompt lookup, lookahead and self-drafting output different from `generate`, silently), so
every drafter is refused on them in one line: at the generator's construction (and so before
`generate_batch`), at `from_pretrained` before the weights load, and by every target runner. Tiny
Qwen3-Next (4 layers, width 64), Falcon-H1 and Jamba built from their transformers configs."""

from __future__ import annotations

import pytest
import torch
import transformers

from spechead.heads import EagleConfig, EagleHead, MedusaConfig, MedusaHead
from spechead.heads.eagle3 import Eagle3Config, Eagle3Head
from spechead.inference.drafters.cascade import CascadeDrafter
from spechead.inference.drafters.draft_model import DraftModelDrafter
from spechead.inference.drafters.eagle import EagleDrafter
from spechead.inference.drafters.layer_skip import LayerSkipDrafter
from spechead.inference.drafters.lookahead import LookaheadDrafter
from spechead.inference.drafters.medusa import MedusaDrafter
from spechead.inference.drafters.prompt_lookup import PromptLookupDrafter
from spechead.inference.generator import SpeculativeGenerator
from spechead.inference.target.runner import TargetRunner

VOCAB = 96
SHAPE = dict(
    vocab_size=VOCAB, hidden_size=64, intermediate_size=64, num_attention_heads=4, num_key_value_heads=2,
    head_dim=16,
)  # fmt: skip
HYBRIDS = {
    "qwen3_next": lambda: transformers.Qwen3NextForCausalLM(
        transformers.Qwen3NextConfig(
            num_hidden_layers=4,
            layer_types=["linear_attention", "full_attention"] * 2,
            linear_num_value_heads=4,
            linear_num_key_heads=2,
            linear_key_head_dim=16,
            linear_value_head_dim=16,
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=32,
            shared_expert_intermediate_size=32,
            **SHAPE,
        )  # fmt: skip
    ),
    "falcon_h1": lambda: transformers.FalconH1ForCausalLM(
        transformers.FalconH1Config(
            num_hidden_layers=2,
            mamba_d_ssm=64,
            mamba_n_heads=4,
            mamba_d_head=16,
            mamba_d_state=16,
            mamba_chunk_size=16,
            mamba_n_groups=1,
            **SHAPE,
        )  # fmt: skip
    ),
    "jamba": lambda: transformers.JambaForCausalLM(
        transformers.JambaConfig(
            num_hidden_layers=4,
            attn_layer_period=2,
            attn_layer_offset=1,
            expert_layer_period=2,
            expert_layer_offset=1,
            num_experts=2,
            mamba_d_state=8,
            mamba_dt_rank=8,
            **{k: v for k, v in SHAPE.items() if k != "head_dim"},
        )  # fmt: skip
    ),
}
REFUSED = r"^\S+ is a hybrid model \(.*layers keep a recurrent state.*\): .* is not supported for it; "


@pytest.fixture(scope="module")
def hybrids():
    out = {}
    for kind, build in HYBRIDS.items():
        torch.manual_seed(0)
        out[kind] = build().eval()
    return out


def _llama(tiny_llama):
    return tiny_llama(VOCAB, layers=2, hidden=32, seed=1)


def drafters(target, tiny_llama) -> dict:
    """{name: a function making that drafter for `target`} (attention-only draft models where one is
    needed: the refusal is the target's)."""
    cfg = target.config

    def eagle(kind: str):
        head = (
            Eagle3Head(Eagle3Config.from_target(cfg, target_layers=[0, 1, 2]))
            if kind == "eagle3"
            else EagleHead(EagleConfig.from_target(cfg))
        )
        head.attach_target_modules(lm_head=target.lm_head, embed_tokens=target.get_input_embeddings())
        return EagleDrafter(head.eval())

    def medusa():
        config = MedusaConfig(hidden_size=cfg.hidden_size, vocab_size=VOCAB, num_heads=2,
                              target_num_layers=cfg.num_hidden_layers)  # fmt: skip
        return MedusaDrafter(MedusaHead(config).eval())

    return {
        "eagle": lambda: eagle("eagle"),
        "eagle3": lambda: eagle("eagle3"),
        "medusa": medusa,
        "prompt_lookup": PromptLookupDrafter,
        "lookahead": LookaheadDrafter,
        "layer_skip": lambda: LayerSkipDrafter(target, [1]),
        "draft_model": lambda: DraftModelDrafter(_llama(tiny_llama), num_draft=3),
        "cascade": lambda: CascadeDrafter(_llama(tiny_llama), _llama(tiny_llama)),
        "plain": lambda: None,
    }


def assert_refused(make) -> None:
    """`make()` raises ValueError in one line naming a hybrid model and what to do."""
    with pytest.raises(ValueError, match=REFUSED) as err:
        make()
    assert "\n" not in str(err.value)


@pytest.mark.parametrize(
    "name",
    [
        "eagle",
        "eagle3",
        "medusa",
        "prompt_lookup",
        "lookahead",
        "layer_skip",
        "draft_model",
        "cascade",
        "plain",
    ],
)
def test_every_drafter_is_refused_on_a_hybrid_target(name, hybrids, tiny_llama):
    """Qwen3-Next: the generator refuses every drafter (and plain decoding); the layer-skip
    drafter, a view of the hybrid target, refuses itself first."""
    target = hybrids["qwen3_next"]
    make = drafters(target, tiny_llama)[name]
    assert_refused(lambda: SpeculativeGenerator(target, None, make()))


@pytest.mark.parametrize("kind", ["falcon_h1", "jamba"])
@pytest.mark.parametrize("name", ["prompt_lookup", "lookahead", "layer_skip", "eagle3"])
def test_falcon_h1_and_jamba_are_refused(kind, name, hybrids, tiny_llama):
    """The drafters that ran silently wrong on Falcon-H1 (prompt lookup, lookahead, self-drafting) and a
    head."""
    target = hybrids[kind]
    make = drafters(target, tiny_llama)[name]
    assert_refused(lambda: SpeculativeGenerator(target, None, make()))


def test_the_target_runner_refuses_a_hybrid(hybrids):
    """The runner refuses too (a generator is not the only way in): eager, with rows, compiled."""
    target = hybrids["falcon_h1"]
    assert_refused(lambda: TargetRunner(target))
    assert_refused(lambda: TargetRunner(target, max_length=32))
    assert_refused(lambda: TargetRunner(target, capacity=2, compile="graphs"))


def test_a_hybrid_draft_model_is_refused(hybrids, tiny_llama):
    """A hybrid as the draft (or the cascade's medium) on an attention-only target: its tree drafts and
    crops would corrupt its own state; refused in one line."""
    assert_refused(lambda: DraftModelDrafter(hybrids["jamba"]))
    assert_refused(lambda: CascadeDrafter(_llama(tiny_llama), hybrids["qwen3_next"]))


def test_from_pretrained_refuses_before_loading(hybrids, tmp_path, chatml_tokenizer, monkeypatch):
    """The saved config is enough: one line before the weights load (loading them fails this test)."""
    from spechead.inference import loading

    hybrids["qwen3_next"].save_pretrained(tmp_path)
    chatml_tokenizer.save_pretrained(tmp_path)
    monkeypatch.setattr(
        loading.AutoModelForCausalLM, "from_pretrained", lambda *a, **k: pytest.fail("loaded")
    )
    for drafter in ("prompt_lookup", None):
        assert_refused(lambda d=drafter: SpeculativeGenerator.from_pretrained(str(tmp_path), d))
