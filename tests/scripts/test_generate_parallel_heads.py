"""scripts/generate.py with a parallel head (DFlash, P-EAGLE) given input that does not fit it.

A block (K drafts) longer than the context left is no error: the engine verifies only the first nodes
that fit (`BatchDraft.cut(room)`, lossless) and stops at max_new_tokens, so the text is plain decoding's.
Asking for more tokens than the target's positions, or a head of another target (hidden width,
vocabulary, depth), is one `error:` line and exit status 2."""

from __future__ import annotations

import pytest
import torch

from spechead.heads import DFlashConfig, DFlashHead, PEagleConfig, PEagleHead
from spechead.inference.generator import SpeculativeGenerator

from ..inference.test_generator import plain_greedy

CONTEXT = 16  # the small target's max_position_embeddings
BLOCK = 20  # every head's block: longer than the whole context


def save_target(model, tokenizer, path):
    """model + tokenizer saved in `path` (a --target directory)."""
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def save_head(kind: str, model, path, **fields):
    """A random DFlash / P-EAGLE head (block BLOCK) for `model`, saved in `path`."""
    torch.manual_seed(0)
    cfg, vocab = model.config, model.config.vocab_size
    if kind == "dflash":
        head = DFlashHead(DFlashConfig.from_target(cfg, block_size=BLOCK, num_layers=1, **fields))
    else:
        head = PEagleHead(PEagleConfig.from_target(cfg, draft_vocab_size=vocab, block_size=BLOCK, **fields))
    return head.save_pretrained(path)


@pytest.fixture(scope="module")
def small_target(tiny_llama, chatml_tokenizer, tmp_path_factory):
    """A tiny target of CONTEXT positions."""
    model = tiny_llama(len(chatml_tokenizer), seed=3)
    model.config.max_position_embeddings = CONTEXT
    return save_target(model, chatml_tokenizer, tmp_path_factory.mktemp("small"))


def one_error_line(capsys) -> str:
    """The run's stderr, which must be one `error:` line (the target's loading bar aside)."""
    err = capsys.readouterr().err.replace("\r", "\n").splitlines()
    lines = [line for line in err if line.strip() and not line.startswith("Loading weights")]
    assert len(lines) == 1 and lines[0].startswith("error: "), lines
    return lines[0]


@pytest.mark.parametrize("kind", ["dflash", "peagle"])
def test_a_block_longer_than_the_context_left_decodes_as_plain(
    kind, script, small_target, chatml_tokenizer, tmp_path, capsys
):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(small_target, dtype=torch.float32)
    head = save_head(kind, model, tmp_path / "head")
    generate = script("generate")
    prompt = len(chatml_tokenizer("hi")["input_ids"])
    for argv in (
        ["--prompt", "hi", "--max-new-tokens", str(CONTEXT - prompt)],  # up to the target's last position
        ["--prompt", "hi", "--prompt", "a b c", "--max-new-tokens", "3"],  # a batch, fewer tokens than K
    ):
        common = ["--target", str(small_target), "--compile", "off", *argv]
        assert generate.main(common) == 0
        plain = capsys.readouterr().out
        assert generate.main([*common, "--drafter", str(head)]) == 0
        assert capsys.readouterr().out == plain
    # a fixed KV cache of the context's size: the tree is cut to the slots left (`BatchDraft.cut`)
    fixed = SpeculativeGenerator.from_pretrained(
        str(small_target), str(head), max_cache_len=CONTEXT, compile=False, calibrate=False
    )
    ids = chatml_tokenizer("hi")["input_ids"]
    drafted = fixed.generate(input_ids=ids, max_new_tokens=CONTEXT - prompt)
    assert drafted.token_ids == plain_greedy(model, ids, CONTEXT - prompt) and drafted.stats.drafted_tokens
    too_many = ["--prompt", "hi", "--max-new-tokens", str(CONTEXT - prompt + 1), "--drafter", str(head)]
    assert generate.main(["--target", str(small_target), *too_many]) == 2
    assert "exceeds the target's context of 16 tokens" in one_error_line(capsys)


@pytest.mark.parametrize(
    ("other", "message"),
    [
        ({"hidden": 48}, "head expects hidden_size 32 (it was trained on"),
        ({"vocab": 1}, "head expects vocab_size 384 (it was trained on"),
        ({"layers": 6}, "head was trained on a target with 4 layers"),
    ],
    ids=["hidden-width", "vocabulary", "depth"],
)
def test_a_dflash_head_of_another_target_is_one_line(
    script, tiny_target_dir, tiny_llama, chatml_tokenizer, tmp_path, capsys, other, message
):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_target_dir, dtype=torch.float32)
    head = save_head("dflash", model, tmp_path / "head", target_name_or_path=str(tiny_target_dir))
    vocab = len(chatml_tokenizer) + other.get("vocab", 0)
    wrong = tiny_llama(vocab, layers=other.get("layers", 4), hidden=other.get("hidden", 32))
    target = save_target(wrong, chatml_tokenizer, tmp_path / "other")
    argv = ["--target", str(target), "--drafter", str(head), "--prompt", "hi", "--max-new-tokens", "4"]
    assert script("generate").main(argv) == 2
    line = one_error_line(capsys)
    assert message in line and "load the head trained for this target" in line, line
