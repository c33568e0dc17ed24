"""The defaults a GPU decodes with since the H200 run of 2026-11-28: a target's "spechead_sdpa" attention
runs tree passes as matrix products and packs one query's heads (compiled too), the EAGLE draft step
attends as matrix products (heads/attention.py, heads/fused.py), and an EAGLE head drafts in FP8 on a GPU
with FP8 tensor cores (inference/draft_weights.py). Greedy output stays plain decoding's, and a pass still
waits for the GPU once. Skipped where there is no GPU (CI has none)."""

from __future__ import annotations

import pytest
import torch

from spechead.heads import Eagle3Config, Eagle3Head, EagleConfig, EagleHead, attention, fused
from spechead.inference.drafters.eagle import EagleDrafter
from spechead.inference.evaluation.profiling import count_syncs
from spechead.inference.generator import SpeculativeGenerator

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]
FP8 = torch.cuda.is_available() and torch.cuda.get_device_capability() >= (8, 9)


def spied(monkeypatch) -> list[str]:
    """Where `grouped_attention` runs from: "target" (a tree pass) or "draft" (a draft step)."""
    calls: list[str] = []
    grouped = attention.grouped_attention
    monkeypatch.setattr(attention, "grouped_attention", lambda *a: calls.append("target") or grouped(*a))
    monkeypatch.setattr(fused, "grouped_attention", lambda *a: calls.append("draft") or grouped(*a))
    return calls


@pytest.mark.parametrize("compile", [False, "graphs", True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_gpu_attention_defaults_decode_as_plain_decoding(
    tiny_llama, chatml_tokenizer, monkeypatch, dtype, compile
):
    """The target on "spechead_sdpa" (tree passes as matmuls, one query packed), the EAGLE draft step's
    attention "auto" (matmuls): greedy equals plain decoding on transformers' "sdpa", eager, as our CUDA
    graphs and compiled by inductor; the matmuls really ran for both."""
    model = tiny_llama(len(chatml_tokenizer), layers=2, hidden=64, seed=1).to("cuda", dtype)
    plain = SpeculativeGenerator(model, chatml_tokenizer, None)
    plain.eos = set()
    prompts = [list(range(5 + i, 15 + i)) for i in range(4)]
    refs = [plain.generate(input_ids=p, max_new_tokens=24).token_ids for p in prompts]
    calls = spied(monkeypatch)
    model.set_attn_implementation(attention.NAME)
    head = EagleHead(EagleConfig.from_target(model.config)).to("cuda", dtype)
    head.attach_target_modules(
        lm_head=model.get_output_embeddings(), embed_tokens=model.get_input_embeddings()
    )
    drafter = EagleDrafter(head.eval(), top_k=4, depth=4, total_tokens=16)
    assert drafter.head_step.attention == "auto" and drafter.head_step.attends_as_matmuls(model.device)
    gen = SpeculativeGenerator(model, chatml_tokenizer, drafter, compile=compile)
    gen.eos = set()
    for prompt, ref in zip(prompts, refs):
        assert gen.generate(input_ids=prompt, max_new_tokens=24).token_ids == ref
    assert {"target", "draft"} <= set(calls)
    batch = gen.generate_batch(input_ids=prompts, max_new_tokens=24)
    assert [r.token_ids for r in batch] == refs


def test_one_query_under_compile_matches_eager_on_cuda():
    """A decode step's single query, packed (`_one_query`) and compiled by inductor, gives transformers'
    eager sdpa output (which packs it too, eagerly) in bf16 with a static cache's mask."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    class Grouped(torch.nn.Module):
        num_key_value_groups = 4
        is_causal = True

    g = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(2, 32, 1, 128, device="cuda", generator=g, dtype=torch.bfloat16)  # (B, nh, 1, D)
    k, v = (torch.randn(2, 8, 512, 128, device="cuda", generator=g, dtype=torch.bfloat16) for _ in range(2))
    mask = (
        torch.arange(512, device="cuda")[None, None, None]
        < torch.tensor([300, 512], device="cuda")[:, None, None, None]
    )
    module = Grouped()
    ours = torch.compile(lambda *a: attention.tree_sdpa(module, *a, scaling=0.088)[0])(q, k, v, mask)
    theirs, _ = sdpa_attention_forward(module, q, k, v, mask, scaling=0.088)
    torch.testing.assert_close(ours, theirs, atol=2e-2, rtol=2e-2)


@pytest.mark.skipif(not FP8, reason="needs FP8 tensor cores (compute capability >= 8.9)")
def test_from_pretrained_drafts_eagle_in_fp8_on_such_a_gpu(tiny_target_dir, tmp_path):
    """draft_fp8's default on a GPU with FP8 tensor cores: an EAGLE-3 head's per-depth layers in FP8, the
    target on "spechead_sdpa", graphs by default; greedy equals the eager plain load's, and a pass waits
    for the GPU once. draft_fp8=False keeps the head as trained."""
    from transformers import AutoConfig

    from spechead.heads.fp8 import Fp8Linear

    config = AutoConfig.from_pretrained(tiny_target_dir)
    torch.manual_seed(0)
    head = Eagle3Head(Eagle3Config.from_target(config, target_layers=[1, 2, config.num_hidden_layers]))
    path = str(head.save_pretrained(tmp_path / "eagle3"))
    gen = SpeculativeGenerator.from_pretrained(str(tiny_target_dir), path, device="cuda")
    assert gen.draft_weights == "fp8" and isinstance(gen.drafter.head.midlayer.mlp.down_proj, Fp8Linear)
    assert gen.target.config._attn_implementation == attention.NAME and gen.compile == "graphs"
    off = SpeculativeGenerator.from_pretrained(str(tiny_target_dir), path, device="cuda", draft_fp8=False)
    assert off.draft_weights is None
    eager = SpeculativeGenerator.from_pretrained(str(tiny_target_dir), device="cuda", compile=False)
    gen.eos = eager.eos = set()
    prompt = list(range(5, 25))
    ref = eager.generate(input_ids=prompt, max_new_tokens=40).token_ids
    assert gen.generate(input_ids=prompt, max_new_tokens=40).token_ids == ref
    short, syncs_short = count_syncs(
        torch.device("cuda"), lambda: gen.generate(input_ids=prompt, max_new_tokens=10)
    )
    long, syncs_long = count_syncs(
        torch.device("cuda"), lambda: gen.generate(input_ids=prompt, max_new_tokens=40)
    )
    passes = long.stats.target_passes - short.stats.target_passes
    assert (syncs_long - syncs_short) / passes <= 1.0, (syncs_long, syncs_short, passes)
