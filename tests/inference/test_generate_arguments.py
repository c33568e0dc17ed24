"""What generate / stream / generate_batch do with their arguments: how a prompt string and chat messages
become ids, the context limit's exact edge, seeds, unknown arguments, the returned text without special
tokens, and the text a stream holds back for a partial character handed out at its end."""

from __future__ import annotations

import copy

import pytest
import torch
from tokenizers import processors

from spechead.inference.drafters.prompt_lookup import PromptLookupDrafter
from spechead.inference.generator import SpeculativeGenerator

PROMPT = "What is the capital of France?"
SAMPLED = dict(temperature=1.0, seed=7)


@pytest.fixture(scope="module")
def setup(tiny_llama, chatml_tokenizer):
    model = tiny_llama(len(chatml_tokenizer), layers=2, hidden=32, seed=3)
    model.generation_config.eos_token_id = None
    return model, chatml_tokenizer


def test_a_prompt_string_gets_the_tokenizers_special_tokens(setup):
    """A prompt string is tokenized as the model's tokenizer does by default, special tokens included (a
    Llama tokenizer's BOS): generate(prompt) decodes the same ids as input_ids=tokenizer(prompt)."""
    model, tok = setup
    with_bos = copy.deepcopy(tok)
    bos = with_bos.bos_token_id
    with_bos.backend_tokenizer.post_processor = processors.TemplateProcessing(
        single="<s> $A", special_tokens=[("<s>", bos)]
    )
    ids = with_bos(PROMPT)["input_ids"]
    assert ids[0] == bos and ids[1:] == tok(PROMPT)["input_ids"]
    gen = SpeculativeGenerator(model, with_bos, None)
    assert (
        gen.generate(PROMPT, max_new_tokens=10).token_ids
        == gen.generate(input_ids=ids, max_new_tokens=10).token_ids
    )
    assert (
        gen.generate(PROMPT, max_new_tokens=10).token_ids
        != gen.generate(input_ids=ids[1:], max_new_tokens=10).token_ids
    )


def test_messages_are_answered_after_the_generation_prompt(setup):
    """messages= renders the chat template WITH the generation prompt (the assistant header), so the
    target writes the assistant's answer: the same ids as input_ids= of that rendering."""
    model, tok = setup
    gen = SpeculativeGenerator(model, tok, None)
    messages = [{"role": "user", "content": PROMPT}]
    ids = tok.apply_chat_template(messages, add_generation_prompt=True, return_dict=False)
    bare = tok.apply_chat_template(messages, add_generation_prompt=False, return_dict=False)
    assert len(ids) > len(bare)
    out = gen.generate(messages=messages, max_new_tokens=10).token_ids
    assert out == gen.generate(input_ids=ids, max_new_tokens=10).token_ids
    assert out != gen.generate(input_ids=bare, max_new_tokens=10).token_ids
    rows = gen.generate_batch(messages=[messages, messages], max_new_tokens=10)
    assert [r.token_ids for r in rows] == [out, out]


def test_the_context_limit_is_exact(setup):
    """prompt + max_new_tokens may fill the target's context exactly, one token more is a one-line
    ValueError before any decoding."""
    model, tok = setup
    gen = SpeculativeGenerator(model, tok, None)
    context = model.config.max_position_embeddings
    assert len(gen.generate(input_ids=[5] * (context - 2), max_new_tokens=2).token_ids) == 2
    with pytest.raises(ValueError, match="exceeds the target's context"):
        gen.generate(input_ids=[5] * (context - 2), max_new_tokens=3)


def test_seeds_make_sampling_reproducible_in_generate_and_stream(setup):
    """seed= seeds the sampling: generate twice with one seed gives the same draw, another seed another
    draw, and stream with that seed yields exactly generate's text."""
    model, tok = setup
    gen = SpeculativeGenerator(model, tok, PromptLookupDrafter())
    first = gen.generate(PROMPT, max_new_tokens=16, **SAMPLED)
    assert gen.generate(PROMPT, max_new_tokens=16, **SAMPLED).token_ids == first.token_ids
    assert gen.generate(PROMPT, max_new_tokens=16, temperature=1.0, seed=8).token_ids != first.token_ids
    assert "".join(gen.stream(PROMPT, max_new_tokens=16, **SAMPLED)) == first.text


def test_stream_refuses_unknown_arguments(setup):
    """A misspelt argument to stream (max_tokens for max_new_tokens) is a TypeError naming it, not
    silently ignored (generate refuses it the same way)."""
    model, tok = setup
    gen = SpeculativeGenerator(model, tok, None)
    with pytest.raises(TypeError, match="max_tokens"):
        list(gen.stream(PROMPT, max_tokens=4))


def test_the_text_leaves_out_special_tokens(setup):
    """result.text is the decoded ids WITHOUT special tokens: an answer ending at the chat template's
    end-of-turn (the tokenizer's EOS) does not show it, in generate's text nor in stream's pieces."""
    model, tok = setup
    model = copy.deepcopy(model)
    gen = SpeculativeGenerator(model, tok, None)
    first = gen.generate(PROMPT, max_new_tokens=1).token_ids[0]
    with (
        torch.no_grad()
    ):  # the EOS row: the first answer token's, a little larger (it wins wherever that would)
        model.lm_head.weight[tok.eos_token_id] = 1.5 * model.lm_head.weight[first]
    result = SpeculativeGenerator(model, tok, None).generate(PROMPT, max_new_tokens=8)
    assert result.token_ids[-1] == tok.eos_token_id
    assert result.text == tok.decode(result.token_ids, skip_special_tokens=True)
    assert tok.eos_token not in result.text
    gen = SpeculativeGenerator(model, tok, None)
    assert "".join(gen.stream(PROMPT, max_new_tokens=8)) == result.text  # a stream's pieces likewise


def _cut_in_a_character(gen, tok, max_new: int = 40) -> int:
    """A number of new tokens whose text ends inside a multi-byte character (the random target writes
    byte tokens), so a stream holds its last bytes back until the end."""
    ids = gen.generate(PROMPT, max_new_tokens=max_new).token_ids
    cuts = [n for n in range(1, max_new + 1) if tok.decode(ids[:n]).endswith("\ufffd")]
    assert cuts, "the target wrote no partial character: pick another seed"
    return cuts[0]


def test_a_stream_ending_inside_a_character_hands_out_the_rest(setup):
    """When the answer ends inside a multi-byte character, the bytes held back are flushed at the end:
    the pieces of stream (and of each stream_batch row) join to exactly generate's text."""
    model, tok = setup
    gen = SpeculativeGenerator(model, tok, None)
    n = _cut_in_a_character(gen, tok)
    whole = gen.generate(PROMPT, max_new_tokens=n).text
    assert whole.endswith("\ufffd")
    streamed = list(gen.stream(PROMPT, max_new_tokens=n))
    assert "".join(streamed) == whole and all(streamed)  # (no empty piece handed out)
    pieces = ["", ""]
    for row, piece in gen.stream_batch([PROMPT, "hello"], max_new_tokens=[n, 4]):
        pieces[row] += piece
    assert pieces == [r.text for r in gen.generate_batch([PROMPT, "hello"], max_new_tokens=[n, 4])]


def test_bad_batch_arguments_are_one_line_errors(setup):
    """generate_batch takes exactly one of prompts / messages / input_ids, as a non-empty list (a bare
    string is not a batch of its characters), and a bad row is named in the error."""
    model, tok = setup
    gen = SpeculativeGenerator(model, tok, None)
    cases = [
        (dict(), "exactly one of prompts="),
        (dict(prompts=["a"], input_ids=[[5]]), "exactly one of prompts="),
        (dict(prompts="hello"), "non-empty list"),
        (dict(prompts=[]), "non-empty list"),
        (dict(input_ids=[[5], [5] * 600]), "row 1: prompt \\(600 tokens\\)"),
        (dict(input_ids=[[5], []]), "row 1: the prompt is empty"),
        (dict(input_ids=[[5], [6]], max_new_tokens=[4, 0]), "row 1: max_new_tokens must be > 0"),
        (dict(input_ids=[[5], [6]], seed=[1, 2, 3]), "seed has 3 values for 2 prompts"),
    ]
    for kwargs, needle in cases:
        with pytest.raises(ValueError, match=needle):
            gen.generate_batch(**kwargs)
