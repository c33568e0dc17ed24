"""Hidden-state capture: HF `output_hidden_states` indices, the final norm found whatever its name."""

from __future__ import annotations

import pytest
import torch
import transformers

from spechead.heads.capture import capture_hidden, final_norm
from spechead.heads.errors import HeadError

SHAPE = dict(
    vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4,
    num_key_value_heads=2,
)  # fmt: skip
MODELS = {  # final norm: norm, final_layernorm, norm_f
    "llama": lambda: transformers.LlamaConfig(**SHAPE),
    "falcon_h1": lambda: transformers.FalconH1Config(
        mamba_d_ssm=32,
        mamba_n_heads=4,
        mamba_d_head=8,
        mamba_n_groups=1,
        mamba_d_state=8,
        mamba_chunk_size=16,
        **SHAPE,
    ),  # fmt: skip
    "nemotron_h": lambda: transformers.NemotronHConfig(
        hybrid_override_pattern="M*M-",
        mamba_num_heads=4,
        mamba_head_dim=8,
        n_groups=1,
        ssm_state_size=8,
        chunk_size=16,
        **SHAPE,
    ),  # fmt: skip
}


@torch.no_grad()
@pytest.mark.parametrize("kind", list(MODELS))
def test_captured_states_are_hf_hidden_states_whatever_the_final_norm_is_called(kind) -> None:
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(MODELS[kind]()).eval()
    ids = torch.randint(0, 64, (2, 7))
    want = model(ids, output_hidden_states=True).hidden_states  # L + 1 states, the last after the norm
    layers = [0, 2, 4, -1]
    with capture_hidden(model, layers) as got:
        model(ids)
    assert sorted(got) == sorted(layers)
    for i in layers:
        torch.testing.assert_close(got[i], want[i], atol=1e-6, rtol=0)
    assert not torch.allclose(got[4], want[3])  # the final norm's output, not the last layer's


def test_a_decoder_without_a_known_final_norm_is_named() -> None:
    decoder = torch.nn.Module()
    decoder.layers = torch.nn.ModuleList()
    with pytest.raises(HeadError, match=r"^Module has no final norm named any of .*head\.layers\)$"):
        final_norm(decoder)
