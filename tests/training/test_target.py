"""The frozen target: loading from a directory, freezing, and hooks that equal output_hidden_states."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import transformers
import yaml

from spechead.heads.errors import HeadError
from spechead.training.errors import TrainError
from spechead.training.target import TargetConfig, attention_for, load_target, load_tokenizer


@pytest.fixture(scope="module")
def target(tiny_target_dir):
    return load_target(TargetConfig(path=str(tiny_target_dir), attn_implementation="eager"))


def test_loaded_frozen_and_described(target, tiny_target_dir):
    assert not target.model.training
    assert all(not p.requires_grad for p in target.model.parameters())
    assert (target.num_layers, target.hidden_size) == (4, 32)
    assert target.vocab_size == target.model.config.vocab_size
    assert target.name_or_path == str(tiny_target_dir)


def test_capture_equals_hf_hidden_states(target):
    torch.manual_seed(0)
    ids = torch.randint(0, target.vocab_size, (2, 9))
    mask = torch.ones_like(ids)
    mask[1, 6:] = 0
    ref = target.model(input_ids=ids, attention_mask=mask, output_hidden_states=True)
    layers = [0, 1, 2, 4, -1, -3]
    cap = target.capture(ids, mask, layers, with_logits=True)
    expected = [ref.hidden_states[i] for i in layers]
    for got, want in zip(cap.hidden, expected):
        torch.testing.assert_close(got, want, rtol=0, atol=0)
    torch.testing.assert_close(cap.logits, ref.logits)
    # The final state is after the norm: it is what lm_head sees.
    torch.testing.assert_close(target.lm_head(cap.hidden[3]), ref.logits)
    assert cap.hidden[3] is not None and cap.hidden[4].shape == (2, 9, 32)


def test_capture_without_logits_skips_lm_head(target):
    ids = torch.randint(0, target.vocab_size, (1, 5))
    calls = []
    hooks_before = sum(len(m._forward_hooks) for m in target.model.modules())
    handle = target.lm_head.register_forward_hook(lambda *a: calls.append(1))
    try:
        cap = target.capture(ids, None, [-1], with_logits=False)
    finally:
        handle.remove()
    assert cap.logits is None and not calls
    assert sum(len(m._forward_hooks) for m in target.model.modules()) == hooks_before  # hooks removed


def test_layer_out_of_range(target):
    with pytest.raises(HeadError, match="does not exist"):
        target.capture(torch.zeros(1, 3, dtype=torch.long), None, [5])


def test_missing_local_path(tmp_path):
    with pytest.raises(TrainError, match="no such directory"):
        load_target(TargetConfig(path=str(tmp_path / "nope")))


def test_unreachable_hub_id():
    with pytest.raises(TrainError, match="Hub"):
        load_tokenizer(TargetConfig(path="no-such-org/no-such-model"))


def test_directory_without_a_model(tmp_path):
    (tmp_path / "readme.txt").write_text("not a model")
    with pytest.raises(TrainError, match="could not be loaded"):
        load_target(TargetConfig(path=str(tmp_path)))


def test_chat_template_override(tiny_target_dir, tmp_path):
    jinja = tmp_path / "t.jinja"
    jinja.write_text("{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}")
    tok = load_tokenizer(TargetConfig(path=str(tiny_target_dir), chat_template=str(jinja)))
    text = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False)
    assert text == "[user] hi\n"


def test_auto_attention_runs_what_the_target_can_and_sdpa_on_one_that_cannot_names_the_fix(
    gemma2_target_dir, tiny_target_dir
):
    """The default ("auto") loads Gemma-2 (no sdpa in transformers) eager and a Llama sdpa; sdpa asked
    for a class that cannot run it fails in one line naming the class and the setting to change."""
    target = load_target(TargetConfig(path=str(gemma2_target_dir)))
    assert target.model.config._attn_implementation == "eager"
    assert load_target(TargetConfig(path=str(tiny_target_dir))).model.config._attn_implementation == "sdpa"
    with pytest.raises(
        TrainError,
        match=r"^model\.attn_implementation=sdpa: .*Gemma2Config.* set model\.attn_implementation=auto .*or eager$",
    ):
        load_target(TargetConfig(path=str(gemma2_target_dir), attn_implementation="sdpa"))


# Each Hub preset of configs/model by the config class transformers builds its architecture from.
LLAMAS = ("llama3-8b", "llama3-8b-instruct", "llama3-70b", "llama3-70b-instruct", "llama3.1-8b")
PRESET_ARCHS = {
    **dict.fromkeys((*LLAMAS, "llama3.1-8b-instruct", "llama3.1-70b-instruct"), "LlamaConfig"),
    "mistral-7b-instruct": "MistralConfig",
    "qwen2.5-7b-instruct": "Qwen2Config",
    "qwen3-8b": "Qwen3Config",
    "gpt-oss-20b": "GptOssConfig",
    "gpt-oss-120b": "GptOssConfig",
    "gemma-2-9b-it": "Gemma2Config",
    "phi-4": "Phi3Config",
}


def test_every_hub_preset_asks_for_an_attention_its_architecture_runs(tmp_path):
    """A preset's model.attn_implementation resolves for its architecture without an error: never sdpa
    for GPT-OSS's sinks or Gemma-2's soft-capping (auto, which loads them eager)."""
    root = Path(__file__).resolve().parents[2] / "configs" / "model"
    presets = {p.stem: yaml.safe_load(p.read_text()) for p in root.glob("*.yaml")}
    presets = {name: p for name, p in presets.items() if name not in ("demo", "local")}
    assert set(presets) == set(PRESET_ARCHS)  # a new preset names its architecture above
    for name, preset in presets.items():
        getattr(transformers, PRESET_ARCHS[name])().save_pretrained(tmp_path / name)
        cfg = TargetConfig(path=str(tmp_path / name), attn_implementation=preset["attn_implementation"])
        assert attention_for(cfg) == (
            "eager" if PRESET_ARCHS[name] in ("GptOssConfig", "Gemma2Config") else "sdpa"
        )


def test_tokenizer_without_pad_token_pads_with_eos(chatml_tokenizer, tmp_path):
    """A tokenizer that defines no pad token (Llama's) gets eos as its pad token."""
    import copy

    tok = copy.deepcopy(chatml_tokenizer)
    tok.pad_token = None
    tok.save_pretrained(tmp_path)
    loaded = load_tokenizer(TargetConfig(path=str(tmp_path)))
    assert loaded.pad_token == "<|im_end|>" and loaded.pad_token_id == loaded.eos_token_id


def test_each_process_loads_the_target_straight_onto_its_device(tiny_target_dir, placements):
    """Outside ZeRO-3 the target's weights go to the process's device as they are read (device_map), not
    a whole copy per process staged in host memory (ZeRO-3 partitions instead: test_deepspeed.py)."""
    load_target(TargetConfig(path=str(tiny_target_dir)), torch.device("cpu"))
    assert placements == [torch.device("cpu")]
