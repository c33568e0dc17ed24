"""The architectures users serve x every head family: each head trains a few steps on a tiny model built
from transformers' config class, and decoding with it equals the target's own `generate` at batch 1 and
3 (greedy), and a sampled run decodes; a hybrid target (recurrent / Mamba layers) trains, and decoding it
is either equal to `generate` or refused in one line, never silently different.

Random weights: losslessness does not depend on a head's quality, and a few steps prove the family's
recipe runs end to end (capture, objective, loss, checkpoint, save, reload) on that architecture.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import transformers

from spechead.heads import load_head
from spechead.heads.families import family_of
from spechead.inference.evaluation.measure import decode_eval_hook
from spechead.inference.generator import SpeculativeGenerator
from spechead.inference.loading import merge_head_adapter
from spechead.training.trainer import train

SHAPE = dict(
    hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
    max_position_embeddings=256,
)  # fmt: skip
MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16)
# Config class + extra fields per architecture (tiny: 4 layers, width 32; windows of 8 tokens).
ARCHS: dict[str, tuple[str, dict]] = {
    "llama": ("LlamaConfig", {}),
    "qwen2": ("Qwen2Config", {}),
    "qwen3": ("Qwen3Config", {"head_dim": 8}),
    "qwen3_moe": ("Qwen3MoeConfig", {"head_dim": 8, **MOE}),
    "mistral_window": ("MistralConfig", {"sliding_window": 8}),
    "gemma2": ("Gemma2Config", {"head_dim": 8, "sliding_window": 8}),
    "gemma3": ("Gemma3TextConfig", {"head_dim": 8, "sliding_window": 8}),
    "phi3": ("Phi3Config", {}),
    "gpt_oss": (
        "GptOssConfig",
        {"head_dim": 8, "num_local_experts": 4, "num_experts_per_tok": 2, "sliding_window": 8},
    ),
    "olmo2": ("Olmo2Config", {}),
    "granite": ("GraniteConfig", {}),
    "deepseek_v3": (
        "DeepseekV3Config",
        {
            "num_key_value_heads": 4,
            "kv_lora_rank": 16,
            "q_lora_rank": 24,
            "qk_rope_head_dim": 8,
            "qk_nope_head_dim": 8,
            "v_head_dim": 8,
            "n_routed_experts": 4,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 16,
            "n_shared_experts": 1,
            "first_k_dense_replace": 1,
            "n_group": 1,
            "topk_group": 1,
        },
    ),  # fmt: skip
    "qwen3_next": (
        "Qwen3NextConfig",
        {
            "head_dim": 8,
            **MOE,
            "linear_num_value_heads": 2,
            "linear_num_key_heads": 2,
            "linear_key_head_dim": 8,
            "linear_value_head_dim": 8,
            "full_attention_interval": 2,
        },
    ),  # fmt: skip
    "falcon_h1": (
        "FalconH1Config",
        {
            "mamba_d_ssm": 32,
            "mamba_n_heads": 4,
            "mamba_d_head": 8,
            "mamba_n_groups": 1,
            "mamba_d_state": 8,
            "mamba_chunk_size": 16,
        },
    ),  # fmt: skip  (its final norm is `final_layernorm`)
}
HYBRID = {"qwen3_next", "falcon_h1"}
FAMILIES = ("medusa", "medusa2", "eagle", "eagle3", "peagle", "dflash")
N = 12  # new tokens per answer
PROMPTS = [[5, 9, 14, 20, 33, 41, 7, 3, 12, 18, 25], [11, 4, 8], [30, 2, 6, 19, 27, 1]]


def _tokenizer_ids(tok) -> dict:
    return {"eos_token_id": None, "bos_token_id": tok.bos_token_id, "pad_token_id": tok.pad_token_id}


@pytest.fixture(scope="module")
def arch_dir(request, tmp_path_factory, chatml_tokenizer) -> tuple[str, Path]:
    """(name, directory) of a saved tiny target of architecture `request.param` + the ChatML tokenizer."""
    name = request.param
    class_name, extra = ARCHS[name]
    config_class = getattr(transformers, class_name)
    config = config_class(
        vocab_size=len(chatml_tokenizer), **{**SHAPE, **extra}, **_tokenizer_ids(chatml_tokenizer)
    )
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config)
    # Larger weights than the init: sharper distributions, so argmax near-ties (where kernels may
    # legitimately differ by one ulp) are rare and a wrong logit shows as another token.
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.mul_(4.0)
    path = tmp_path_factory.mktemp(f"arch_{name}")
    model.save_pretrained(path)
    chatml_tokenizer.save_pretrained(path)
    return name, path


def _references(target_dir: Path, head_dir: Path, prompts: list[list[int]]) -> list[list[int]]:
    """The target's own greedy answers (`generate`), with a Medusa-2 head's LoRA adapter merged in."""
    model = merge_head_adapter(transformers.AutoModelForCausalLM.from_pretrained(target_dir), str(head_dir))
    model.eval()
    out = []
    for prompt in prompts:
        ids = model.generate(
            torch.tensor([prompt]), max_new_tokens=N, do_sample=False, eos_token_id=None, pad_token_id=0
        )
        out.append(ids[0, len(prompt) :].tolist())
    return out


def _train(tmp_path: Path, target_dir: Path, family: str, chat_file: Path, kit, **more) -> Path:
    extra = {
        "head": family,
        "trainer.max_steps": 2,
        "trainer.eval_every": 2,
        "trainer.save_every": 2,
        "trainer.eval_batches": 1,
        "trainer.batch_size": 2,
        "trainer.max_length": 48,
    }
    if family == "eagle3":
        extra["head.ttt_steps"] = 2
    if family in ("peagle", "dflash"):
        extra["head.block_size"] = 3
    hook = decode_eval_hook if more.get("trainer.decode_eval_every") else None
    settings = kit.settings(kit.overrides(target_dir, chat_file, tmp_path / "run", **{**extra, **more}))
    result = train(settings, decode_eval=hook)
    assert result.steps == 2
    return result.head_dir


ARCH_PARAMS = [pytest.param(a, id=a) for a in ARCHS]


@pytest.mark.parametrize("arch_dir", ARCH_PARAMS, indirect=True)
@pytest.mark.parametrize("family", FAMILIES)
def test_every_family_trains_and_decodes_as_generate(
    arch_dir, family, tmp_path, chat_file, training_kit, capsys
):
    name, arch_dir = arch_dir
    hybrid = name in HYBRID  # its decode evals are skipped in one line; the head still trains
    more = {"trainer.decode_eval_every": 1, "trainer.decode_eval_prompts": 1} if hybrid else {}
    head_dir = _train(tmp_path, arch_dir, family, chat_file, training_kit, **more)
    if hybrid:
        assert "decode eval and tree tuning: skipped (" in capsys.readouterr().out
    assert family_of(load_head(head_dir).config).name == family
    options = {"tree": [[0], [1], [0, 0], [0, 1], [0, 0, 0]]} if family.startswith("eagle") else {}
    if hybrid:
        with pytest.raises(ValueError) as err:
            gen = SpeculativeGenerator.from_pretrained(
                str(arch_dir), str(head_dir), calibrate=False, **options
            )
            gen.generate(input_ids=PROMPTS[0], max_new_tokens=N)
        assert "\n" not in str(err.value) and "hybrid" in str(err.value).lower()
        return
    gen = SpeculativeGenerator.from_pretrained(str(arch_dir), str(head_dir), calibrate=False, **options)
    gen.eos = set()
    refs = _references(arch_dir, head_dir, PROMPTS)
    assert gen.generate(input_ids=PROMPTS[0], max_new_tokens=N).token_ids == refs[0]
    rows = gen.generate_batch(input_ids=PROMPTS, max_new_tokens=N, tree_for_batch=False)
    assert [r.token_ids for r in rows] == refs
    sampled = gen.generate(input_ids=PROMPTS[1], max_new_tokens=N, temperature=1.0, seed=0)
    assert len(sampled.token_ids) == N
