"""Decoding with few-query attention as matmuls (heads/attention.py `grouped_attention`), the default on a
GPU (`GROUPED_DEVICES`) for the target's tree passes ("spechead_sdpa", what `from_pretrained` loads) and for
the EAGLE draft step (heads/fused.py, attention="auto"). Here the CPU is put in a GPU's place: decoding
runs that path end to end and stays lossless, greedy output equal to the target's own at batch 1 and 3."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from spechead.heads import Eagle3Config, Eagle3Head, MedusaConfig, MedusaHead, attention
from spechead.inference.generator import SpeculativeGenerator

PROMPTS = [[5, 9, 11, 7], [3, 4, 5, 6, 7, 8, 9], [12, 13]]


@pytest.fixture(scope="module")
def heads(tiny_target_dir, tmp_path_factory) -> dict[str, str]:
    """{"medusa": dir, "eagle3": dir}: heads whose drafts start as the target's lm_head (some accepted)."""
    model = AutoModelForCausalLM.from_pretrained(tiny_target_dir, dtype=torch.float32)
    config, root = model.config, tmp_path_factory.mktemp("grouped")
    torch.manual_seed(0)
    medusa = MedusaHead(MedusaConfig(hidden_size=config.hidden_size, vocab_size=config.vocab_size, num_heads=3,
                                     target_num_layers=config.num_hidden_layers))  # fmt: skip
    medusa.init_from_lm_head_(model.lm_head.weight)
    eagle3 = Eagle3Head(Eagle3Config.from_target(config, target_layers=[1, 2, config.num_hidden_layers]))
    eagle3.init_lm_head_from_target_(model.lm_head.weight)
    return {
        "medusa": str(medusa.save_pretrained(root / "medusa")),
        "eagle3": str(eagle3.save_pretrained(root / "e3")),
    }


@pytest.mark.parametrize("family", ["medusa", "eagle3"])
def test_decoding_through_grouped_attention_is_lossless(tiny_target_dir, heads, monkeypatch, family):
    model = AutoModelForCausalLM.from_pretrained(tiny_target_dir)
    refs = [
        model.generate(
            torch.tensor([p]), max_new_tokens=16, do_sample=False, eos_token_id=None, pad_token_id=0
        )[0, len(p) :].tolist()
        for p in PROMPTS
    ]
    monkeypatch.setattr(attention, "GROUPED_DEVICES", ("cpu",))
    queries = []  # the query count of each pass that ran as matmuls
    grouped = attention.grouped_attention
    monkeypatch.setattr(
        attention, "grouped_attention", lambda q, *a: queries.append(q.shape[2]) or grouped(q, *a)
    )
    from spechead.heads import fused

    monkeypatch.setattr(
        fused, "grouped_attention", lambda q, *a: queries.append(-q.shape[2]) or grouped(q, *a)
    )
    gen = SpeculativeGenerator.from_pretrained(str(tiny_target_dir), heads[family], calibrate=False)
    gen.eos = set()
    assert gen.target.config._attn_implementation == attention.NAME
    drafted = accepted = 0
    for prompt, ref in zip(PROMPTS, refs):
        result = gen.generate(input_ids=prompt, max_new_tokens=16)
        assert result.token_ids == ref
        drafted, accepted = drafted + result.stats.drafted_tokens, accepted + result.stats.accepted_tokens
    assert drafted > 0 and (accepted > 0 or family == "eagle3")  # (an untrained EAGLE-3 layer: none taken)
    assert any(n > 1 for n in queries)  # the target's tree passes
    assert (family == "eagle3") == any(n < 0 for n in queries)  # the EAGLE draft's steps
    batch = gen.generate_batch(input_ids=PROMPTS, max_new_tokens=16)
    assert [r.token_ids for r in batch] == refs
