"""Fixtures shared by the decoding tests (the engine has one target cache: no back-end parametrization)."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(scope="module")
def positional(tiny_llama, chatml_tokenizer):
    """A target whose argmaxes depend on rotary positions: a small rope_theta and sharp attention (q/k
    weights x8). With the default tiny target, wrong tree position ids still reproduce greedy decoding."""
    model = tiny_llama(len(chatml_tokenizer), layers=2, hidden=32, seed=3, rope_theta=10.0)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.q_proj.weight.mul_(8.0)
            layer.self_attn.k_proj.weight.mul_(8.0)
    model.generation_config.eos_token_id = None
    return model, chatml_tokenizer


@pytest.fixture(scope="module")
def lm_head_heads(tiny_target_dir, tmp_path_factory) -> dict[str, str]:
    """{"medusa": dir, "eagle3": dir}: heads for the tiny target whose drafts start as its lm_head (a Medusa
    head's are accepted; an untrained EAGLE-3 layer's mostly not), saved as head directories."""
    from transformers import AutoModelForCausalLM

    from spechead.heads import Eagle3Config, Eagle3Head, MedusaConfig, MedusaHead

    model = AutoModelForCausalLM.from_pretrained(tiny_target_dir, dtype=torch.float32)
    config, root = model.config, tmp_path_factory.mktemp("lm_head_heads")
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
