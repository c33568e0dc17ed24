"""Decoding with few-query attention as matmuls (heads/attention.py `grouped_attention`), the default on a
GPU (`GROUPED_DEVICES`) for the target's tree passes ("spechead_sdpa", what `from_pretrained` loads) and for
the EAGLE draft step (heads/fused.py, attention="auto"). Here the CPU is put in a GPU's place: decoding
runs that path end to end and stays lossless, greedy output equal to the target's own at batch 1 and 3."""

from __future__ import annotations

import pytest

from spechead.heads import attention
from spechead.inference.generator import SpeculativeGenerator

from .hf_reference import decodes_as_references, hf_greedy

PROMPTS = [[5, 9, 11, 7], [3, 4, 5, 6, 7, 8, 9], [12, 13]]


@pytest.mark.parametrize("family", ["medusa", "eagle3"])
def test_decoding_through_grouped_attention_is_lossless(tiny_target_dir, lm_head_heads, monkeypatch, family):
    refs = [hf_greedy(tiny_target_dir, p, 16) for p in PROMPTS]
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
    gen = SpeculativeGenerator.from_pretrained(str(tiny_target_dir), lm_head_heads[family], calibrate=False)
    gen.eos = set()
    assert gen.target.config._attn_implementation == attention.NAME
    drafted, accepted = decodes_as_references(gen, PROMPTS, refs, 16)
    assert drafted > 0 and (accepted > 0 or family == "eagle3")  # (an untrained EAGLE-3 layer: none taken)
    assert any(n > 1 for n in queries)  # the target's tree passes
    assert (family == "eagle3") == any(n < 0 for n in queries)  # the EAGLE draft's steps
    batch = gen.generate_batch(input_ids=PROMPTS, max_new_tokens=16)
    assert [r.token_ids for r in batch] == refs
