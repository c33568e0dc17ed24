"""memory_fit.py: a target too large for its device is one line before any weight is read."""

from __future__ import annotations

import json
import time

import pytest
import torch
from transformers import LlamaConfig

from spechead.inference import SpeculativeGenerator
from spechead.inference.memory_fit import device_memory, weight_bytes


def huge_config(**kw) -> LlamaConfig:
    """A Llama of 5 * 10^12 weights (20 TB in float32): larger than any machine."""
    return LlamaConfig(
        vocab_size=1_000_000, hidden_size=1_000_000, intermediate_size=8, num_hidden_layers=1,
        num_attention_heads=1000, num_key_value_heads=1000, tie_word_embeddings=True, **kw,
    )  # fmt: skip


@pytest.fixture
def huge_target_dir(tmp_path):
    """A config.json and nothing else: without the check, the load would fail later on missing weights."""
    huge_config().save_pretrained(tmp_path)
    return tmp_path


@pytest.mark.parametrize("tied", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_weight_bytes_are_the_loaded_models_bytes(tiny_llama, tied, dtype):
    config = tiny_llama(96, layers=2, hidden=32).config
    config.tie_word_embeddings = tied  # (untied: the lm_head a weight of its own, counted once more)
    model = type(tiny_llama(96))(config).to(dtype)
    assert (model.lm_head.weight is model.get_input_embeddings().weight) == tied
    real = sum(p.numel() * p.element_size() for p in model.parameters())
    assert weight_bytes(model.config, dtype) == real


def test_a_quantized_checkpoint_is_not_counted(tiny_llama):
    config = tiny_llama(64, layers=1, hidden=32).config
    config.quantization_config = {"quant_method": "fp8"}  # (its weights are not dtype-sized)
    assert weight_bytes(config, torch.bfloat16) is None


def test_the_cpu_has_its_physical_memory():
    total, what = device_memory(torch.device("cpu"))
    assert total > 2**30 and what == f"this machine has {total / 1e9:.1f} GB of memory"


def test_a_target_larger_than_the_machine_is_one_line_before_loading(huge_target_dir):
    start = time.perf_counter()
    with pytest.raises(ValueError) as err:
        SpeculativeGenerator.from_pretrained(str(huge_target_dir), None, device="cpu")
    line = str(err.value)
    assert "\n" not in line and time.perf_counter() - start < 30
    # 5 * 10^12 weights (the embedding, q, k, v, o) of 4 bytes
    assert line.startswith(f"target {huge_target_dir}: its weights need 20000.1 GB in float32 but ")
    assert (
        "this machine has" in line and "not split over several GPUs" in line and "scripts/export.py" in line
    )
    assert "bfloat16" not in line  # (it would not fit in bfloat16 either)
    with pytest.raises(ValueError, match="GB in bfloat16 but"):
        SpeculativeGenerator.from_pretrained(str(huge_target_dir), None, device="cpu", dtype="bfloat16")


def test_a_target_that_fits_in_bfloat16_is_told_so(tmp_path):
    """float32 weights of 1.5x this machine's memory: in bfloat16 they would fit (0.75x)."""
    memory, _ = device_memory(torch.device("cpu"))
    LlamaConfig(
        vocab_size=int(1.5 * memory / 4 / 1024), hidden_size=1024, intermediate_size=8, num_hidden_layers=1,
        num_attention_heads=8, num_key_value_heads=8, tie_word_embeddings=True,
    ).save_pretrained(tmp_path)  # fmt: skip
    need = weight_bytes(LlamaConfig.from_pretrained(tmp_path), torch.float32)
    with pytest.raises(
        ValueError, match=f"load it in bfloat16 \\({need / 2e9:.1f} GB: dtype / --dtype\\), use a"
    ):
        SpeculativeGenerator.from_pretrained(str(tmp_path), None, device="cpu")


def test_a_quantized_target_is_left_to_its_loader(huge_target_dir):
    config = json.loads((huge_target_dir / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "activation_scheme": "dynamic"}
    (huge_target_dir / "config.json").write_text(json.dumps(config))
    with pytest.raises(Exception) as err:  # transformers' own error (no weights here), not ours
        SpeculativeGenerator.from_pretrained(str(huge_target_dir), None, device="cpu")
    assert "its weights need" not in str(err.value)


@pytest.mark.skipif(torch.cuda.is_available(), reason="a machine without CUDA")
def test_cuda_on_a_machine_without_it_is_one_line(tiny_target_dir):
    with pytest.raises(
        ValueError, match=r"^device cuda: CUDA is not available on this machine .*use device cpu$"
    ):
        SpeculativeGenerator.from_pretrained(str(tiny_target_dir), None, device="cuda")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a_target_larger_than_the_gpu_names_its_free_memory(huge_target_dir):
    with pytest.raises(
        ValueError, match=r"GB in bfloat16 but cuda(:0)? has [\d.]+ GB free of [\d.]+ GB; spechead"
    ):
        SpeculativeGenerator.from_pretrained(str(huge_target_dir), None, device="cuda")
