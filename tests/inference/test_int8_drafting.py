"""Drafting with int8 layers (`from_pretrained(..., draft_int8=...)`, heads/int8.py): on by default for a
Medusa head on a CPU, asked for an EAGLE head; the head really drafts through its int8 weights, and
decoding stays lossless: greedy output equals the target's own, at batch 1 and batch 3."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from transformers import AutoModelForCausalLM

from spechead.heads import Eagle3Config, Eagle3Head, MedusaConfig, MedusaHead
from spechead.heads.fused import fused_step
from spechead.heads.int8 import Int8Linear
from spechead.inference.draft_weights import check_draft_settings
from spechead.inference.generator import SpeculativeGenerator
from spechead.inference.sampling import SamplingParams

from .hf_reference import decodes_as_references, hf_greedy

PROMPTS = [[5, 9, 11, 7], [3, 4, 5, 6, 7, 8, 9], [12, 13]]
pytestmark = pytest.mark.usefixtures("int8_cpu")  # (the default's CPUs, on any machine)


@pytest.mark.parametrize("family, option", [("medusa", {}), ("eagle3", {"draft_int8": True})])
def test_int8_drafting_is_lossless(tiny_target_dir, lm_head_heads, family, option):
    gen = SpeculativeGenerator.from_pretrained(str(tiny_target_dir), lm_head_heads[family], **option)
    assert gen.draft_weights == "int8"
    assert any(type(m) is Int8Linear for m in gen.drafter.head.modules())
    gen.eos = set()
    refs = [hf_greedy(tiny_target_dir, p, 16) for p in PROMPTS]
    drafted, accepted = decodes_as_references(gen, PROMPTS, refs, 16)
    assert drafted > 0 and (accepted > 0 or family == "eagle3")  # (an untrained EAGLE-3 layer: none taken)
    batch = gen.generate_batch(input_ids=PROMPTS, max_new_tokens=16, tree_for_batch=False)
    assert [r.token_ids for r in batch] == refs


def test_auto_quantizes_a_medusa_head_on_a_cpu_only(tiny_target_dir, lm_head_heads):
    """The default: a Medusa head's projections in int8 on a CPU (there its draft is bound by the bytes
    it reads); an EAGLE-3 head as it was trained; draft_int8=False keeps a Medusa head's too."""
    medusa = SpeculativeGenerator.from_pretrained(
        str(tiny_target_dir), lm_head_heads["medusa"], calibrate=False
    )
    assert medusa.draft_weights == "int8"
    assert all(type(block[-1]) is Int8Linear for block in medusa.drafter.head.heads)
    off = SpeculativeGenerator.from_pretrained(
        str(tiny_target_dir), lm_head_heads["medusa"], draft_int8=False
    )
    assert off.draft_weights is None and all(type(block[-1]) is nn.Linear for block in off.drafter.head.heads)
    eagle3 = SpeculativeGenerator.from_pretrained(
        str(tiny_target_dir), lm_head_heads["eagle3"], calibrate=False
    )
    assert eagle3.draft_weights is None and type(eagle3.drafter.head.lm_head) is nn.Linear
    plain = SpeculativeGenerator.from_pretrained(str(tiny_target_dir))  # no head: nothing to quantize
    assert plain.draft_weights is None


def test_the_draft_runs_the_int8_weights(tiny_target_dir, lm_head_heads):
    """The drafters' (fused) forwards on the same inputs: int8 moves them by rounding, not more; the
    fused EAGLE step takes int8 layers (not the module-by-module fallback)."""
    load = SpeculativeGenerator.from_pretrained
    gens = [
        load(str(tiny_target_dir), lm_head_heads["medusa"], calibrate=False, draft_int8=q)
        for q in (False, True)
    ]
    state = torch.randn(1, 1, gens[0].target.config.hidden_size)
    with torch.no_grad():
        exact, coarse = (g.drafter.head_logits(1, state) for g in gens)
    error = float((coarse - exact).norm() / exact.norm())
    assert 1e-5 < error < 0.02, error
    gens = [
        load(str(tiny_target_dir), lm_head_heads["eagle3"], calibrate=False, draft_int8=q)
        for q in (False, True)
    ]
    assert fused_step(gens[1].drafter.head) is not None
    hidden = gens[0].target.config.hidden_size
    features, ids = torch.randn(1, 3, hidden), torch.tensor([[5, 6, 7]])
    outs = [g.drafter.head_step(features, ids, None, torch.arange(3)[None], None) for g in gens]
    error = float((outs[1] - outs[0]).norm() / outs[0].norm())
    assert 1e-5 < error < 0.02, error


@pytest.mark.parametrize(
    "drafter, options, message",
    [
        ("prompt_lookup", {"draft_int8": True}, "draft_int8 needs an EAGLE / EAGLE-3 head or a Medusa head"),
        (
            "eagle3",
            {"draft_int8": True, "draft_fp8": True},
            "draft_int8 and draft_fp8 both quantize the draft",
        ),
        ("eagle3", {"draft_int8": "yes"}, "draft_int8 takes auto, True or False, got 'yes'"),
    ],
)
def test_bad_int8_settings_are_one_line(tiny_target_dir, lm_head_heads, drafter, options, message):
    with pytest.raises(ValueError, match=message):
        SpeculativeGenerator.from_pretrained(
            str(tiny_target_dir), lm_head_heads.get(drafter, drafter), **options
        )


def test_int8_drafting_is_for_cpus():
    check_draft_settings("auto", True, "cpu")
    check_draft_settings("auto", "auto", "cuda")  # (the default: nothing asked for)
    with pytest.raises(ValueError, match="draft_int8 runs on a CPU, not cuda: on a GPU use draft_fp8"):
        check_draft_settings(False, True, "cuda")


def test_as_drafted_is_an_int8_copy_on_a_cpu_only(tiny_llama, medusa_for):
    """What decode evals and tree tuning draft with: on a CPU a Medusa head's copy with int8 projections,
    sharing the target's modules, the trained head untouched; elsewhere, or another family, the head."""
    from spechead.inference.draft_weights import as_drafted

    model = tiny_llama(64, layers=4, hidden=32)
    head = medusa_for(model, num_heads=2)
    head.attach_target_modules(lm_head=model.lm_head, embed_tokens=model.get_input_embeddings())
    drafted = as_drafted(head, torch.device("cpu"))
    assert drafted is not head and all(type(block[-1]) is Int8Linear for block in drafted.heads)
    assert all(type(block[-1]) is nn.Linear for block in head.heads)  # (the one being trained)
    assert drafted._target_modules["lm_head"] is model.lm_head  # shared, not copied
    assert drafted.heads[0][0].linear.weight is not head.heads[0][0].linear.weight  # its own weights
    assert as_drafted(head, torch.device("cuda")) is head and as_drafted(head, torch.device("meta")) is head
    eagle3 = Eagle3Head(Eagle3Config.from_target(model.config))
    assert as_drafted(eagle3, torch.device("cpu")) is eagle3


def test_a_medusa_head_without_resblocks_drafts_in_int8(tiny_target_dir, tmp_path):
    """num_layers=0: with its projections in int8 the head has no parameter left. Its drafter anchors
    its device and dtype on a buffer still in the head (not the swapped-out float projection, which would
    stay alive), from from_pretrained and from a copy (decode evals), and decodes losslessly."""
    from spechead.inference.draft_weights import as_drafted
    from spechead.inference.drafter_specs import drafter_for_head

    model = AutoModelForCausalLM.from_pretrained(tiny_target_dir, dtype=torch.float32)
    config = model.config
    head = MedusaHead(MedusaConfig(hidden_size=config.hidden_size, vocab_size=config.vocab_size, num_heads=2,
                                   num_layers=0, target_num_layers=config.num_hidden_layers))  # fmt: skip
    head.init_from_lm_head_(model.lm_head.weight)
    gen = SpeculativeGenerator.from_pretrained(
        str(tiny_target_dir), str(head.save_pretrained(tmp_path / "m"))
    )
    kept = [*gen.drafter.head.parameters(), *gen.drafter.head.buffers()]
    assert gen.draft_weights == "int8" and not list(gen.drafter.head.parameters())
    assert any(gen.drafter._weight is t for t in kept)
    gen.eos = set()
    assert gen.generate(input_ids=PROMPTS[0], max_new_tokens=12).token_ids == hf_greedy(
        tiny_target_dir, PROMPTS[0], 12
    )
    head.attach_target_modules(lm_head=model.lm_head)
    drafter = drafter_for_head(as_drafted(head, torch.device("cpu")))
    drafter.start(
        [torch.tensor(PROMPTS[0])], [{config.num_hidden_layers: torch.randn(4, config.hidden_size)}], [3]
    )
    draft = drafter.propose([3], [SamplingParams()], [None])  # a batch of one
    assert draft.tokens.shape == draft.parents.shape == (1, drafter.tree.size)


def test_auto_is_off_on_cpus_it_was_not_measured_on(tiny_llama, medusa_for, monkeypatch):
    """The int8 default holds where it was measured (x86 AVX512 kernels); on an AVX2 or ARM build of
    torch's kernels a Medusa head stays as trained unless asked."""
    from spechead.inference.draft_weights import int8_by_default

    head = medusa_for(tiny_llama(64, layers=4, hidden=32), num_heads=2)
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "AVX512")
    assert int8_by_default(head, torch.device("cpu"))
    for other in ("AVX2", "DEFAULT", "SVE256"):
        monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda other=other: other)
        assert not int8_by_default(head, torch.device("cpu"))
