"""SpeculativeGenerator.from_pretrained(target, head) with heads in reference projects' layouts: they
are recognised, converted, given what the target implies (EAGLE-3 default layers) and decode losslessly;
so do the parallel drafters (P-EAGLE, DFlash) exported to the layouts vLLM and SGLang serve."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoConfig

from spechead.heads.eagle import EagleConfig, EagleHead
from spechead.heads.eagle3 import Eagle3Config, Eagle3Head, default_eagle3_layers
from spechead.heads.formats import export_head
from spechead.inference.drafters.eagle import EagleDrafter
from spechead.inference.generator import SpeculativeGenerator

from .drafters.parallel_heads import dflash_head, peagle_head
from .test_batch import PROMPTS
from .test_generator import plain_greedy

PROMPT = "What is the capital of France?"


def randomised(head):
    torch.manual_seed(0)
    with torch.no_grad():
        for p in head.parameters():
            p.normal_(0, 0.1)
    return head


@pytest.fixture(scope="module")
def plain(tiny_target_dir) -> list[int]:
    return (
        SpeculativeGenerator.from_pretrained(str(tiny_target_dir))
        .generate(PROMPT, max_new_tokens=12)
        .token_ids
    )


def llama_fields(target_config) -> dict:
    """The Llama config fields a published head repeats from its target (transformers v4 names)."""
    text = target_config.to_dict()
    sizes = ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "vocab_size")
    return {k: text[k] for k in sizes} | {"model_type": "llama", "rms_norm_eps": 1e-6, "rope_theta": 10000.0}


def official_eagle3(target_config, directory):
    """An EAGLE-3 head in the official layout, which records no layers (the target's default applies)."""
    layers = default_eagle3_layers(target_config.num_hidden_layers)
    head = randomised(Eagle3Head(Eagle3Config.from_target(target_config, target_layers=layers)))
    directory.mkdir()
    config = llama_fields(target_config) | {
        "architectures": ["LlamaForCausalLMEagle3"],
        "num_hidden_layers": 1,
    }
    config["draft_vocab_size"] = head.config.draft_vocab_size
    (directory / "config.json").write_text(json.dumps(config))
    torch.save(head.state_dict(), directory / "pytorch_model.bin")  # midlayer.*, fc, norm, lm_head, d2t, t2d
    return head


def published_eagle(target_config, directory):
    """An EAGLE-1 head as the EAGLE authors publish it: Llama config + pytorch_model.bin."""
    head = randomised(EagleHead(EagleConfig.from_target(target_config, first_layer_input_norm=False)))
    directory.mkdir()
    config = llama_fields(target_config) | {"architectures": ["LlamaForCausalLM"], "num_hidden_layers": 1}
    (directory / "config.json").write_text(json.dumps(config))
    torch.save(head.state_dict(), directory / "pytorch_model.bin")
    return head


@pytest.mark.parametrize("make", [official_eagle3, published_eagle])
def test_reference_heads_decode_losslessly(tiny_target_dir, tmp_path, plain, make) -> None:
    target_config = AutoConfig.from_pretrained(tiny_target_dir)
    source = make(target_config, tmp_path / "head")
    gen = SpeculativeGenerator.from_pretrained(str(tiny_target_dir), str(tmp_path / "head"))
    assert isinstance(gen.drafter, EagleDrafter)
    head = gen.drafter.head
    assert type(head) is type(source) and head.config.target_layers == source.config.target_layers
    mine, theirs = head.state_dict(), source.state_dict()
    assert mine.keys() == theirs.keys() and all(torch.equal(mine[k], theirs[k]) for k in mine)
    assert gen.generate(PROMPT, max_new_tokens=12).token_ids == plain


@pytest.mark.parametrize("family", ["peagle", "peagle_own_embedding", "dflash", "dflash_mask_by_name"])
def test_exported_parallel_drafters_decode_losslessly_once_imported(
    tiny_target_dir, tmp_path, family
) -> None:
    """P-EAGLE in speculators' layout, DFlash in the z-lab / SGLang layout, each fitted a little, exported,
    then loaded by the generator from the directory: greedy decoding equals plain decoding, and the
    imported drafter's paths of several tokens are accepted (it drafts what the fitted head drafts).
    peagle_own_embedding: the head fits its own embedding (from a random start, far from the target's),
    which ships with embed_requires_grad true; drafting with the target's would accept little.
    dflash_mask_by_name: the config names its mask token (dflash_config.mask_token), not its id, as SGLang
    reads it: the generator finds the id in the target's tokenizer."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(tiny_target_dir).eval()
    model.generation_config.eos_token_id = None
    mask, prompt = model.config.vocab_size - 1, PROMPTS[0]
    own = family == "peagle_own_embedding"
    if family.startswith("peagle"):
        head = peagle_head(model, [prompt], steps=40, target_layers=[1, 2, 3], own_embedding=own)
        out = export_head(head, "speculators", tmp_path / "head", mask_token_id=mask)
    else:
        head = dflash_head(model, [prompt], steps=40, target_layers=[1, 2, 3], mask_token_id=mask)
        out = export_head(head, "sglang", tmp_path / "head")
    if family == "dflash_mask_by_name":
        config = json.loads((out / "config.json").read_text())
        token = AutoTokenizer.from_pretrained(tiny_target_dir).convert_ids_to_tokens(mask)
        config["dflash_config"] = {**config["dflash_config"], "mask_token": token}
        del config["dflash_config"]["mask_token_id"]
        (out / "config.json").write_text(json.dumps(config))
    gen = SpeculativeGenerator.from_pretrained(str(tiny_target_dir), str(out))
    if family.startswith("dflash"):
        assert gen.drafter.head.config.mask_token_id == mask
    gen.eos = set()
    assert type(gen.drafter.head) is type(head) and gen.drafter.head.config.target_layers == [1, 2, 3]
    assert getattr(gen.drafter.head.config, "own_embedding", False) is own
    result = gen.generate(input_ids=prompt, max_new_tokens=16)
    assert result.token_ids == plain_greedy(model, prompt, 16)
    assert max(result.stats.accept_lengths) > 2, result.stats.accept_lengths
    if own:  # decoding reads the head's own table: the target's in its place drafts worse, still lossless
        with torch.no_grad():
            gen.drafter.head.embed_tokens.weight.copy_(gen.drafter.head.target_embed_tokens.weight)
        worse = gen.generate(input_ids=prompt, max_new_tokens=16)
        assert worse.token_ids == result.token_ids
        assert len(worse.stats.accept_lengths) > len(result.stats.accept_lengths)  # more passes
